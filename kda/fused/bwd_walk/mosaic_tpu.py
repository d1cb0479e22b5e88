"""bwd_dh -> bwd_wy -> bwd_intra -> bwd_gate fused, Pallas Mosaic TPU: the backward after S0 and S1 in
one reverse walk (the math is in kda.stages.bwd_dh, bwd_wy, bwd_intra and bwd_gate).

`apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, rc, dAqk, dv, do, dht, aligned_cu, *, scale,
chunk_size, use_gate_in_kernel, lower_bound, ...)` with rc the bwd_recompute.Out and dAqk, dv
bwd_dav's -> Out(dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias): the fields the pipeline's gradients
take of those stages (S3's dv, S4's dq, dk, dbeta, S5's dg, dA_log, ddt_bias, S2's dh0). Nothing of
S2, S3 or S4 that only the next stage reads (du, dqg, dkg, dw, dgc_last, dgc, dg_state, dAkk) leaves
VMEM.

Kernel: bwd_dh's walk, grid (HV / MB, NTa), ("parallel", "arbitrary"), chunk NTa - 1 - c at grid step
c, the state cotangent dS [MB, K, V] f32 in VMEM scratch seeded and stored by the same functions as
bwd_dh's kernel (`carried`, `carry`: selects, so a NaN never crosses sequences), the same
scalar-prefetched (seq, flags). Per head of the program, the per-stage kernels' chunk bodies in turn:

    bwd_dh.dh_step      du, dqg, dkg, dw, dgc_last, dS        (decay exp(gc_last) from gc's last row)
    bwd_wy.wy_step      dq, dk, dv, dbeta, dgc, dg_state, dAkk
    bwd_intra.intra_step   dq, dk, dbeta, dgc += the Akk and Aqk paths
    bwd_gate.gate_step  dg (and the dA_log, ddt_bias row sums, accumulated in output blocks that stay
                        resident over the chunk axis)

Blocks (head-first, MB heads, reversed index maps): q, k, g, gc_int, gc_frac, qg, kg, w, dq, dk, dg
(MB, BT, K); v, v_new, do, dv in and out (MB, BT, V); Ainv, dAqk (MB, BT, BT); h (MB, K, V) of S0's
[1, NTa, HV, K, V]; dht, dh0 (MB, K, V) at seq[chunk]; beta, dbeta (MB, BT) head groups; valid
(1, BT); exp(A_log) (MB, 1), dt_bias (MB, K), dA_log and ddt_bias row sums (MB, K) per head group.
Precision as the per-stage kernels: bf16 q -> bf16 MXU operands, float32 accumulation; float32 ->
HIGHEST; cumsums at HIGHEST. VMEM at K = V = 128, BT = 64, MB = 16: 22.6 MiB (bf16) / 26.6 MiB, so
it asks for 45 / 53 MiB (2 x need) and fits v7x's 57.6 MiB budget.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_dh.mosaic_tpu import carried, carry, dh_step, walk_flags, walk_specs
from kda.stages.bwd_gate.mosaic_tpu import gate_step
from kda.stages.bwd_intra.mosaic_tpu import intra_step
from kda.stages.bwd_wy.mosaic_tpu import wy_step
from kda.stages.gate import exponent

NAME = "bwd_walk"


class Out(NamedTuple):
  dq: jax.Array               # [1, Ta, HV, K] grad_dtype (float32 unless given)
  dk: jax.Array               # [1, Ta, HV, K] grad_dtype
  dv: jax.Array               # [1, Ta, HV, V] dv_dtype (float32 unless given)
  dbeta: jax.Array            # [1, Ta, HV] float32
  dg: jax.Array               # [1, Ta, HV, K] float32
  dh0: jax.Array              # [N, HV, K, V] float32
  dA_log: Optional[jax.Array]  # [HV] float32 or None
  ddt_bias: Optional[jax.Array]  # [HV * K] float32 or None


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1   # MB: value heads per program (a divisor of HV)


def vmem_need(MB, K, V, BT, in_dtype, rc_dtype) -> int:
  b = T.block_bytes
  tk, tv = b((MB, BT, K), T.F32), b((MB, BT, V), T.F32)
  ins = (3 * b((MB, BT, K), in_dtype) + b((MB, BT, V), in_dtype) + 2 * tk + 3 * b((MB, BT, K), rc_dtype)
         + b((MB, BT, V), rc_dtype) + 2 * tv + 2 * b((MB, BT, BT), T.F32) + 2 * b((MB, K, V), T.F32)
         + b((MB, BT), T.F32) + b((1, BT), T.F32) + b((MB, 1), T.F32) + b((MB, K), T.F32))
  outs = 3 * tk + tv + b((MB, BT), T.F32) + b((MB, K, V), T.F32) + 2 * b((MB, K), T.F32)
  work = 40 * b((BT, max(K, V, BT)), T.F32) + 4 * b((max(K, BT), V), T.F32)   # one head's values
  return 2 * (ins + outs) + b((MB, K, V), T.F32) + work


def default_config(HV, K, V, BT, in_dtype=T.F32, rc_dtype=T.F32) -> Config:
  return Config(max(T.heads_per_program(HV, vmem_need(1, K, V, BT, in_dtype, rc_dtype)), 1))


def supports(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, rc, dAqk, dv, do, dht, aligned_cu, *, chunk_size,
             use_gate_in_kernel, lower_bound, config=None, **_) -> Optional[str]:
  """None if `apply` takes the call, else why: the per-stage kernels' checks and this kernel's VMEM."""
  from kda.stages.bwd_dh import mosaic_tpu as dh
  from kda.stages.bwd_gate import mosaic_tpu as gt
  from kda.stages.bwd_intra import mosaic_tpu as it
  from kda.stages.bwd_wy import mosaic_tpu as wy
  S = jax.ShapeDtypeStruct
  _, Ta, HV, K = q.shape
  V = v.shape[-1]
  BT = chunk_size
  f = lambda *shape: S(shape, T.F32)
  tk, tb, NTa = f(1, Ta, HV, K), f(1, Ta, HV), Ta // BT
  checks = (
      lambda: dh.supports(rc.qg, rc.kg, rc.w, rc.gc_int, rc.gc_frac, rc.h, rc.v_new, do, dv, dht, aligned_cu,
                          chunk_size=BT),
      lambda: wy.supports(q, k, v, beta, rc.gc_int, rc.gc_frac, Ainv, tk, tk, tk, f(1, Ta, HV, V),
                          f(1, NTa, HV, K), chunk_size=BT),
      lambda: it.supports(q, k, beta, rc.gc_int, rc.gc_frac, dAqk, f(1, Ta, HV, BT), tk, tk, tb, tk, chunk_size=BT),
      lambda: gt.supports(g, valid, A_log, dt_bias, tk, tk, chunk_size=BT, use_gate_in_kernel=use_gate_in_kernel,
                          lower_bound=lower_bound))
  for check in checks:
    if (r := check()) is not None:
      return r
  cfg = config or default_config(HV, K, V, BT, q.dtype, rc.qg.dtype)
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  return T.budget_reason(NAME, vmem_need(cfg.heads_per_program, K, V, BT, q.dtype, rc.qg.dtype))


def _kernel(seq_ref, flag_ref, *refs, MB, NT, BT, scale, low, has_dht, has_dh0, has_a, has_bias, mode):
  del seq_ref   # used by the index maps only
  refs = list(refs)
  take = lambda n: [refs.pop(0) for _ in range(n)]
  q_r, k_r, v_r, g_r, b_r, vl_r, gi_r, gf_r, A_r, qg_r, kg_r, w_r, h_r, vn_r, do_r, dv_r, dAqk_r = take(17)
  a_r = refs.pop(0) if has_a else None
  bias_r = refs.pop(0) if has_bias else None
  dht_r = refs.pop(0) if has_dht else None
  dh0_r = refs.pop(0) if has_dh0 else None
  dq_o, dk_o, dv_o, db_o, dg_o = take(5)
  dA_o = refs.pop(0) if has_a else None
  ddt_o = refs.pop(0) if has_bias else None
  (dS_r,) = refs
  first, last, owned = walk_flags(flag_ref, NT)
  lastrow = pl.ds(BT - 1, 1)
  vcol = T.to_col(vl_r[...])

  @pl.when(pl.program_id(1) == 0)
  def _():
    for o in (dA_o, ddt_o):
      if o is not None:
        o[...] = jnp.zeros(o.shape, o.dtype)

  def head(m):
    q, k, v, gi, gf = q_r[m], k_r[m], v_r[m], gi_r[m], gf_r[m]
    gil, gfl = gi_r[m, lastrow, :], gf_r[m, lastrow, :]
    bcol = T.to_col(T.head_row(b_r, m))
    seed = dht_r[m] if has_dht else jnp.zeros(dS_r.shape[1:], T.F32)
    dSn = carried(dS_r, m, seed, last, owned)
    dec = T.to_col(jnp.exp(exponent(gil, gfl)))
    du, dqg, dkg, dw, dgl, dS = dh_step(h_r[m], dSn, qg_r[m], kg_r[m], w_r[m], vn_r[m], do_r[m], dv_r[m], dec,
                                        scale=scale, low=low)
    carry(dS_r, dh0_r, m, dS, first)
    dq, dk, dv, dbcol, dgc, dgs, dAkk = wy_step(q, k, v, bcol, gi, gf, gil, gfl, A_r[m].astype(T.F32), dqg,
                                                dkg, dw, du, T.to_row(dgl), low=low)
    dq, dk, dbcol, dgc = intra_step(q, k, bcol, gi, gf, dAqk_r[m], dAkk, dq, dk, dbcol, dgc, scale=scale, low=low)
    a = T.head_row(a_r, m) if has_a else None
    bias = T.head_row(bias_r, m) if has_bias else None
    dx, dA = gate_step(g_r[m], vcol, a, bias, dgc, dgs, **mode)
    dq_o[m], dk_o[m], dv_o[m] = dq.astype(dq_o.dtype), dk.astype(dk_o.dtype), dv.astype(dv_o.dtype)
    db_o[pl.ds(m, 1), :] = T.to_row(dbcol)
    dg_o[m] = dx
    if has_a:
      dA_o[pl.ds(m, 1), :] += jnp.sum(dA, axis=0, keepdims=True)
    if has_bias:
      ddt_o[pl.ds(m, 1), :] += jnp.sum(dx, axis=0, keepdims=True)
  T.head_loop(MB, head)


def apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, rc, dAqk, dv, do, dht, aligned_cu, *, scale, chunk_size,
          use_gate_in_kernel, lower_bound, dht_zero=False, need_dh0=True, dv_dtype=None, grad_dtype=None,
          interpret=False, config=None) -> Out:
  """rc: bwd_recompute.Out; dAqk, dv: bwd_dav's. dht_zero: dht is known to be zero (not read);
  need_dh0=False: dh0 is not stored (zeros)."""
  T.refuse(NAME, supports(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, rc, dAqk, dv, do, dht, aligned_cu,
                          chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                          config=config))
  BT = chunk_size
  _, Ta, HV, K = q.shape
  V, NTa, N = v.shape[-1], Ta // BT, aligned_cu.shape[0] - 1
  cfg = config or default_config(HV, K, V, BT, q.dtype, rc.qg.dtype)
  MB = cfg.heads_per_program
  G = HV // MB
  low = jnp.dtype(q.dtype) == jnp.dtype(T.BF16)
  has_dht, has_dh0 = not dht_zero and N > 0, need_dh0 and N > 0
  has_a = use_gate_in_kernel and A_log is not None
  has_bias = use_gate_in_kernel and dt_bias is not None
  gd, vd = jnp.dtype(grad_dtype or T.F32), jnp.dtype(dv_dtype or T.F32)
  seq, flags = T.chunk_flags(aligned_cu.astype(jnp.int32), NTa, BT)
  tok, row, hspec, sspec = walk_specs(MB, BT, NTa)
  rev = lambda c: NTa - 1 - c
  per_head = lambda D: pl.BlockSpec((None, MB, D), lambda hb, c, s, f: (hb, 0, 0))
  hf, f32 = T.head_first, lambda x: x.astype(T.F32)
  args = [hf(q), hf(k), hf(v), hf(g), T.scalars_in(f32(beta), MB, BT), f32(valid).reshape(NTa, 1, BT),
          hf(f32(rc.gc_int)), hf(f32(rc.gc_frac)), hf(Ainv), hf(rc.qg), hf(rc.kg), hf(rc.w), rc.h, hf(rc.v_new),
          hf(do), hf(dv), hf(f32(dAqk))]
  in_specs = [tok(K), tok(K), tok(V), tok(K), row(BT), pl.BlockSpec((None, 1, BT), lambda hb, c, s, f: (rev(c), 0, 0)),
              tok(K), tok(K), tok(BT), tok(K), tok(K), tok(K), hspec(K, V), tok(V), tok(V), tok(V), tok(BT)]
  if has_a:
    args.append(jnp.exp(f32(A_log)).reshape(G, MB, 1))
    in_specs.append(per_head(1))
  if has_bias:
    args.append(f32(dt_bias).reshape(G, MB, K))
    in_specs.append(per_head(K))
  if has_dht:
    args.append(f32(dht))
    in_specs.append(sspec(K, V))
  Sd = jax.ShapeDtypeStruct
  out_shape = ([Sd((N, HV, K, V), T.F32)] * has_dh0
               + [Sd((HV, Ta, K), gd), Sd((HV, Ta, K), gd), Sd((HV, Ta, V), vd), Sd((G, NTa, MB, BT), T.F32),
                  Sd((HV, Ta, K), T.F32)] + [Sd((G, MB, K), T.F32)] * (has_a + has_bias))
  out_specs = ([sspec(K, V)] * has_dh0 + [tok(K), tok(K), tok(V), row(BT), tok(K)]
               + [per_head(K)] * (has_a + has_bias))
  mode = dict(use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  nb = BT // 16
  flops = 2 * HV * Ta * (6 * K * V + BT * (4 * K + 3 * V + 3 * BT) + 2 * K * BT * nb)
  nbytes = (sum(x.size * x.dtype.itemsize for x in args)
            + sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_shape))
  outs = list(pl.pallas_call(
      functools.partial(_kernel, MB=MB, NT=NTa, BT=BT, scale=scale, low=low, has_dht=has_dht, has_dh0=has_dh0,
                        has_a=has_a, has_bias=has_bias, mode=mode),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(G, NTa), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((MB, K, V), T.F32)]),
      out_shape=out_shape,
      compiler_params=T.compiler_params(("parallel", "arbitrary"), vmem_need(MB, K, V, BT, q.dtype, rc.qg.dtype)),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=HV * Ta * K * (20 + 3 * use_gate_in_kernel),
                                    bytes_accessed=nbytes),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_fused",
  )(seq, flags, *args))
  dh0 = outs.pop(0) if has_dh0 else jnp.zeros((N, HV, K, V), T.F32)
  if has_dh0:   # empty sequences own no chunk: their initial state is their final state
    empty = jnp.diff(aligned_cu.astype(jnp.int32)) == 0
    dh0 = jnp.where(empty[:, None, None, None], f32(dht), dh0)
  elif need_dh0:
    dh0 = f32(dht)
  dq, dk, dvo, db, dg = outs[:5]
  dA = jnp.sum(outs[5], axis=-1).reshape(HV) if has_a else None
  ddt = outs[5 + has_a].reshape(HV * K) if has_bias else None
  tm = T.token_major
  return Out(tm(dq), tm(dk), tm(dvo), T.scalars_out(db), tm(dg), dh0, dA, ddt)
