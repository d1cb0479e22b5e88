"""The cheap glue steps around the stages, shared by the pipeline and the packed groups: the
per-token preparation of q and k, the alignment of the inputs, the name scopes of profiles, and the
backward's records."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda import padding
from kda._mosaic_gpu import from_pairs
from kda.stages import bwd_recompute


def scope(name: str):
  """The name scope of a pipeline piece (kda.<stage>, kda.state+output, ...): XLA's ops and the
  kernels of that piece carry it in profiles (tools.profile groups the device time by it)."""
  return jax.named_scope(f"kda.{name}")


def l2norm(x):
  """x / sqrt(sum(x**2, -1) + 1e-6) in float32, back in x's dtype."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def query_keys(plan, q, k, HV):
  """q, k per token, aligned or packed: use_qk_l2norm (a zero row stays zero), then the GVA repeat
  (value head j reads head j // (HV // H))."""
  if plan.use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  rep = HV // q.shape[2]
  if rep > 1:
    q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
  return q, k


def zero_bad(x, keep_neg_inf=False):
  """x with its non-finite values replaced by 0 (-inf kept where keep_neg_inf: a valid gate)."""
  ok = jnp.isfinite(x) | (x == -jnp.inf) if keep_neg_inf else jnp.isfinite(x)
  return jnp.where(ok, x, jnp.zeros((), x.dtype))


def cleaned(q, k, v, g, beta):
  """The inputs as kda.confine's rerun takes them: non-finite values replaced by 0, -inf gates kept."""
  with scope("confine"):
    return zero_bad(q), zero_bad(k), zero_bad(v), zero_bad(g, keep_neg_inf=True), zero_bad(beta)


@jax.custom_vjp
def clean_cotangent(x):
  """x, whose cotangent comes back with its non-finite values replaced by 0 (kda.confine's rerun
  differentiated by JAX's autodiff)."""
  return x


clean_cotangent.defvjp(lambda x: (x, None), lambda _, ct: (zero_bad(ct),))


def prepare(plan, layout, q, k, v, g, beta):
  """Packed [1, T, ...] inputs -> aligned, l2-normalised, head-mapped, gate-neutralised inputs and
  the [1, Ta] real-token mask."""
  q, k, v, beta = (padding.align_with(layout, x) for x in (q, k, v, beta))
  valid = padding.valid_mask(layout)[None]
  q, k = query_keys(plan, q, k, v.shape[2])                      # after align: padding stays 0
  g = padding.align_with(layout, g)
  if plan.use_gate_in_kernel:
    g = padding.neutralize_gate(g, valid)
  return q, k, v, g, beta, valid


def o_dtype(v):
  """The dtype a fused kernel stores o in: v's where that is bf16 (o ends in it), else float32."""
  return jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32


class Kept(NamedTuple):
  """What the forward formed of S0's outputs, kept for the backward (PipelineConfig.keep_forward):
  S0 then runs only its state kernel. Aligned [1, Ta, HV, D], zeros at padding and tail tokens."""
  gc_int: jax.Array   # float32 (gate.Out)
  gc_frac: jax.Array  # float32
  w: jax.Array        # K columns, intra's dtype (bf16 from kernels for bf16 inputs)
  u: jax.Array        # V columns
  qg: jax.Array       # K columns
  kg: jax.Array       # K columns


class Saved(NamedTuple):
  """What the custom VJP keeps of the forward besides its inputs: O(T * BT) per head, no state;
  with `kept`, S0's O(T * K) inputs of the state kernel too."""
  Aqk: jax.Array   # [1, Ta, HV, BT] intra's dtype (bf16 from kernels for bf16 inputs)
  Ainv: jax.Array  # [1, Ta, HV, BT] (I + Akk)^-1, intra's dtype
  kept: Kept | None = None


def finite(xs, real=None) -> jax.Array:
  """() bool: every element of every array in xs ([1, T, ...]) is finite; with real ([T] bool), at
  those tokens only."""
  def ok(x):
    f = jnp.isfinite(x)
    return (f if real is None else f | ~real.reshape((1, -1) + (1,) * (x.ndim - 2))).all()
  return functools.reduce(jnp.logical_and, [ok(x) for x in xs])


def from_kept(plan, kept: Kept, initial_state, aligned_cu):
  """S0's outputs (a bwd_recompute.Out) from the forward's: the plan's state stage forms h, v_new."""
  with scope("bwd_recompute"):
    st = plan.run("state", kept.kg, kept.w, kept.u, kept.gc_int, kept.gc_frac, initial_state, aligned_cu,
                  **plan.stage_kwargs("state"))
  return bwd_recompute.Out(kept.gc_int, kept.gc_frac, kept.w, kept.u, kept.qg, kept.kg, st.h, st.v_new)


class Grads(NamedTuple):
  """Cotangents of forward's inputs, each like its input (None where the input is None); `finite`,
  where the backward was asked for it (kda.confine), a () bool: whether everything S0 recomputed
  from the inputs (w, u, qg, kg at every token) was finite, so every input was."""
  q: jax.Array              # [1, T, H, K]
  k: jax.Array              # [1, T, H, K]
  v: jax.Array              # [1, T, HV, V]
  g: jax.Array              # [1, T, HV, K]
  beta: jax.Array           # [1, T, HV]
  initial_state: jax.Array  # [N, HV, K, V] float32
  A_log: jax.Array | None   # [HV]
  dt_bias: jax.Array | None  # [HV * K]
  finite: jax.Array | None = None


def s2_du_kw(plan, dh_args, wy_inputs, **wy_extra) -> dict:
  """S2's {"du_dtype": bfloat16} where S2 and S3 both run their Mosaic GPU kernels and S3 takes du
  as one bf16 term (bwd_wy's cotangent_terms=1): S3's bits are the same, du takes half the bytes,
  and S2 stores it over v_new (and dw over du's float32 buffer), which lowers the backward's peak.
  Else {}. dh_args: S2's arguments; wy_inputs: S3's (q, k, v, beta, gc_int, gc_frac, Ainv);
  wy_extra: S3's keywords beyond the plan's."""
  cfg = plan.config("bwd_wy", "mosaic_gpu")
  if cfg is None or cfg.cotangent_terms != 1:
    return {}
  if plan.choose("bwd_dh", *dh_args, **plan.stage_kwargs("bwd_dh")) != "mosaic_gpu":
    return {}
  qg, v_new, aligned_cu = dh_args[0], dh_args[6], dh_args[-1]
  S, f32 = jax.ShapeDtypeStruct, jnp.float32
  _, Ta, HV, K = qg.shape
  terms = (S(qg.shape, f32),) * 3 + (S(v_new.shape, jnp.bfloat16), S((1, Ta // plan.chunk_size, HV, K), f32))
  if plan.choose("bwd_wy", *wy_inputs, *terms, aligned_cu, **plan.stage_kwargs("bwd_wy"), **wy_extra) != "mosaic_gpu":
    return {}
  return dict(du_dtype=jnp.bfloat16)


def pairs_kw(plan, du_kw, q, v) -> dict:
  """{"pairs": True} where S2 stores du in bf16 for S3's kernel (`s2_du_kw`'s answer du_kw) and
  K == V == 2 * chunk_size: S2 then stores dqg, dkg as their pairs (kda._mosaic_gpu.pair_store,
  ~2^-17 relative) over h's and dh's buffers, S3 dq, dk as theirs over those, and S4 reads them
  there, so none of the four takes a float32 buffer (where they did, S2's terms kernel was the
  backward's peak). Else {}."""
  if "du_dtype" in du_kw and q.shape[-1] == v.shape[-1] == 2 * plan.chunk_size:
    return dict(pairs=True)
  return {}


def keep_pairs(plan, name, args, pairs, **extra):
  """(pairs, args) for S3 or S4 (`name`) whose arguments 7 and 8 are the previous stage's pairs:
  unchanged where its kernel takes them, else ({}, args with those two back in float32)."""
  if pairs and plan.choose(name, *args, **plan.stage_kwargs(name), **extra, **pairs) != "mosaic_gpu":
    slabs = pairs["pairs"] == "slabs"
    return {}, args[:7] + (from_pairs(args[7], slabs=slabs), from_pairs(args[8], slabs=slabs)) + args[9:]
  return pairs, args


def defer_qg_kw(plan, s3_kernel: bool, q, k, beta, gc, dAqk, terms, aligned_cu, **extra) -> dict:
  """{"defer_qg": True} where S3 runs its Mosaic GPU kernel (s3_kernel) and S4's takes the call with
  S2's dqg in dq's place (q, k, beta aligned; gc S0's two parts; dAqk S1's; terms S2's Out; extra:
  S4's keywords beyond the plan's): S3 then reads neither q nor dqg and stores no dq, and S4 forms
  dq = dqg exp(gc) and adds dqg q exp(gc) to dgc (bwd_wy's and bwd_intra's `defer_qg`): the same
  terms, one [Ta, HV, K] float32 read and store fewer. Else {} (and where PipelineConfig.defer_qg
  is off)."""
  if not (plan.config("pipeline").defer_qg and s3_kernel):
    return {}
  dbeta = jax.ShapeDtypeStruct(beta.shape, jnp.float32)      # S3's dAkk, dk, dbeta, dgc as S4 gets them
  args = (q, k, beta, *gc, dAqk, dAqk, terms.dqg, terms.dkg, dbeta, terms.dw, aligned_cu)
  if plan.choose("bwd_intra", *args, **plan.stage_kwargs("bwd_intra"), **extra) == "mosaic_gpu":
    return dict(defer_qg=True)
  return {}
