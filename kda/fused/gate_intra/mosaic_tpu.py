"""gate -> intra fused, Pallas Mosaic TPU: the gate activation, its chunk cumsum and everything of
intra in one kernel (the math is in kda.stages.gate and kda.stages.intra), so the activated gate
never goes through HBM and gc is read by no second kernel.

`apply(q, k, v, beta, g, valid, A_log, dt_bias, aligned_cu=None, *, scale, chunk_size,
use_gate_in_kernel, lower_bound, ...)` on the aligned inputs of both stages (g raw, valid [1, Ta])
-> Out(gc_int, gc_frac, Aqk, Ainv, w, u, qg, kg, decay): the gate's two parts of gc (float32; None
with Config(store_gc=False)) and the intra fields the forward and its residuals need (Akk, used by
nothing downstream, and the activated g are not stored), plus decay [NTa, HV, K] float32 =
state.chunk_decay(gc_int, gc_frac), which kda.fused.state_output.mosaic_tpu takes in their place.

Kernel: grid (HV / MB, NTa), both "parallel", no scratch; program (p, c) takes value heads
[p MB, (p+1) MB) of chunk c: blocks g (MB, BT, Kp) raw, valid (BT, 1), A_log (MB, 1, 1), dt_bias
(MB, 1, Kp), q, k (MB, BT, Kp), v (MB, BT, Vp), beta (MB, BT, 1) in; gc_int, gc_frac, w, qg, kg
(MB, BT, Kp), u (MB, BT, Vp), Aqk, Ainv (MB, BT, BT), decay (MB, 1, Kp) of [HV, NTa, 1, Kp] out. The
body is the gate kernel's `gate_chunk` then the intra kernel's `intra_chunk` on its gc parts
(their docstrings: tril-dot cumsums at HIGHEST; 16-row sub-blocks, exact pairwise diagonal,
float32 substitution, bf16 dot operands for bf16 q/k/v), and exp of gc's last row for decay:
the same operations as the two stage kernels, so the same bits.

VMEM (BT = 64, K = V = 128; kda._mosaic_tpu.budget): the intra kernel's blocks and values plus g in,
gc and decay out, the gate's values: MB = 8 on every generation, 17.0 MiB (bf16) / 19.5 MiB (f32),
limits asked 21 / 24 MiB on v5e and the default 32 MiB on v6e and v7x; the smallest limit that
compiles is 13.7 MiB (bf16, v7x; tools.tpu_aot --min-vmem).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu as tpu
from kda.stages.gate import exponent
from kda.stages.gate import mosaic_tpu as gate_tpu
from kda.stages.intra import mosaic_tpu as intra_tpu

F32 = tpu.F32
NAME = "gate_intra"


@dataclasses.dataclass(frozen=True)
class Config:
  """MB value heads per program (rounded down to a divisor of HV); store_gc: whether gc_int and
  gc_frac leave the kernel (the unfused state stage reads them; the fused state + output kernel
  takes decay instead)."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)
  store_gc: bool = True

  def __post_init__(self):
    tpu.check_config(self)


class Out(NamedTuple):
  gc_int: Optional[jax.Array]   # [1, Ta, HV, K] float32 (gate.Out's)
  gc_frac: Optional[jax.Array]  # [1, Ta, HV, K] float32
  Aqk: jax.Array                # [1, Ta, HV, BT] q's dtype (intra.Out's from here on)
  Ainv: jax.Array               # [1, Ta, HV, BT]
  w: jax.Array                  # [1, Ta, HV, K]
  u: jax.Array                  # [1, Ta, HV, V]
  qg: jax.Array                 # [1, Ta, HV, K]
  kg: jax.Array                 # [1, Ta, HV, K]
  decay: jax.Array              # [NTa, HV, K] float32, exp(gc) at each chunk's last row


def tiles(MB, BT, Kp, Vp, dtype, g_dtype, store_gc=True):
  blocks = [((MB, BT, Kp), g_dtype), ((BT, 1), F32), ((MB, 1, 1), F32), ((MB, 1, Kp), F32)]
  blocks += [((MB, BT, Kp), dtype)] * 2 + [((MB, BT, Vp), dtype), ((MB, BT, 1), F32)]
  blocks += [((MB, BT, Kp), F32)] * (2 * store_gc) + [((MB, BT, BT), dtype)] * 2
  blocks += [((MB, BT, Kp), dtype)] * 3 + [((MB, BT, Vp), dtype), ((MB, 1, Kp), F32)]
  temps = intra_tpu.temps(MB, BT, Kp, Vp) + [((MB, BT, Kp), F32)] * 3
  return blocks, [], temps


def default_config(K, V, chunk_size, dtype, gen: Optional[tpu.Generation] = None) -> Config:
  """Heads per program for this generation (kda._mosaic_tpu.default_heads)."""
  gen = gen or tpu.generation()
  return Config(heads=tpu.default_heads(lambda mb: tiles(mb, chunk_size, tpu.lanes(K), tpu.lanes(V), dtype, F32), gen))


def supports(q, k, v, beta, g, valid, A_log, dt_bias, aligned_cu=None, *, scale, chunk_size, use_gate_in_kernel,
             lower_bound, config=None, **_) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  reason = gate_tpu.supports(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                             lower_bound=lower_bound, config=gate_tpu.Config(heads=1))
  if reason:
    return reason
  gc = jax.ShapeDtypeStruct(k.shape, F32)
  reason = intra_tpu.supports(q, k, v, beta, gc, gc, scale=scale, chunk_size=chunk_size,
                              config=intra_tpu.Config(heads=1))
  if reason:
    return reason
  if g.shape != k.shape:
    return f"g must have k's shape {k.shape}, got {g.shape}"
  gen = tpu.generation()
  _, _, HV, K = k.shape
  V = v.shape[-1]
  dt = tpu.matmul_dtype(q.dtype, k.dtype, v.dtype)
  config = config or default_config(K, V, chunk_size, dt, gen)
  MB = tpu.heads_per_program(HV, config.heads)
  b = tpu.budget(*tiles(MB, chunk_size, tpu.lanes(K), tpu.lanes(V), dt, g.dtype, config.store_gc), gen)
  return tpu.budget_reason(NAME, b, gen)


def _kernel(*refs, has_a, has_bias, store_gc, use_gate_in_kernel, lower_bound, scale, mm_dtype):
  refs = list(refs)
  g_ref, valid_ref = refs.pop(0), refs.pop(0)
  a = refs.pop(0)[...] if has_a else None
  bias = refs.pop(0)[...] if has_bias else None
  q_ref, k_ref, v_ref, b_ref = refs[:4]
  refs = refs[4:]
  gi_ref, gf_ref = (refs.pop(0), refs.pop(0)) if store_gc else (None, None)
  a_ref, ainv_ref, w_ref, u_ref, qg_ref, kg_ref, dec_ref = refs
  _, gi, gf = gate_tpu.gate_chunk(g_ref[...], valid_ref[...], a, bias, use_gate_in_kernel=use_gate_in_kernel,
                                  lower_bound=lower_bound)
  if store_gc:
    gi_ref[...], gf_ref[...] = gi, gf
  r = intra_tpu.intra_chunk(q_ref[...], k_ref[...], v_ref[...], b_ref[...], gi, gf, scale=scale, mm_dtype=mm_dtype)
  for ref, x in ((a_ref, r.Aqk), (ainv_ref, r.Ainv), (w_ref, r.w), (u_ref, r.u), (qg_ref, r.qg), (kg_ref, r.kg)):
    ref[...] = x.astype(ref.dtype)
  BT = gi.shape[1]
  dec_ref[...] = jnp.exp(exponent(gi[:, BT - 1:BT], gf[:, BT - 1:BT]))


def launch(g, valid, a_log, bias, q, k, v, beta, *, scale, chunk_size, use_gate_in_kernel, lower_bound, config,
           interpret=False):
  """The kernel on head-first arrays (gate_tpu.launch's g, valid, a_log, bias and intra_tpu.launch's
  q, k, v, beta) -> [gc_int, gc_frac (if config.store_gc),] Aqk, Ainv, w, u, qg, kg, decay [HV, NTa, 1, Kp]."""
  HV, Ta, Kp = k.shape
  Vp = v.shape[-1]
  BT, gen = chunk_size, tpu.generation()
  NTa = Ta // BT
  MB = tpu.heads_per_program(HV, config.heads)
  store_gc = config.store_gc
  has_a, has_bias = a_log is not None, bias is not None
  row = lambda D: pl.BlockSpec((MB, BT, D), lambda p, c: (p, c, 0))
  head = lambda D: pl.BlockSpec((MB, 1, D), lambda p, c: (p, 0, 0))
  in_specs = [row(Kp), pl.BlockSpec((BT, 1), lambda p, c: (c, 0))] + [head(1)] * has_a + [head(Kp)] * has_bias
  in_specs += [row(Kp), row(Kp), row(Vp), row(1)]
  args = [x for x in (g, valid, a_log, bias) if x is not None] + [q, k, v, beta]
  dt = q.dtype
  shapes = [((HV, Ta, Kp), F32)] * (2 * store_gc) + [((HV, Ta, BT), dt)] * 2 + [((HV, Ta, Kp), dt)]
  shapes += [((HV, Ta, Vp), dt)] + [((HV, Ta, Kp), dt)] * 2
  outs = [tpu.struct(s, d, *args) for s, d in shapes] + [tpu.struct((HV, NTa, 1, Kp), F32, *args)]
  out_specs = [row(s[-1]) for s, _ in shapes] + [pl.BlockSpec((MB, None, 1, Kp), lambda p, c: (p, c, 0, 0))]
  b = tpu.budget(*tiles(MB, BT, Kp, Vp, dt, g.dtype, store_gc), gen)
  kernel = functools.partial(_kernel, has_a=has_a, has_bias=has_bias, store_gc=store_gc,
                             use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, scale=float(scale),
                             mm_dtype=tpu.matmul_dtype(dt))
  n = HV * Ta * Kp
  return pl.pallas_call(
      kernel, grid=(HV // MB, NTa), in_specs=in_specs, out_specs=out_specs, out_shape=outs,
      compiler_params=tpu.compiler_params(("parallel", "parallel"), b, config.vmem_limit),
      cost_estimate=tpu.cost(intra_tpu.flops(HV, Ta, BT, Kp, Vp) + 4 * n * BT,
                             HV * Ta * (tpu.SUB + BT // tpu.SUB + 3 + 3 * use_gate_in_kernel) * Kp,
                             tpu.nbytes(*args) + tpu.nbytes(*outs)),
      interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}_tpu")(*args)


def apply(q, k, v, beta, g, valid, A_log, dt_bias, aligned_cu=None, *, scale, chunk_size, use_gate_in_kernel,
          lower_bound, interpret=False, config=None) -> Out:
  del aligned_cu   # every chunk is computed, as the stages do
  reason = supports(q, k, v, beta, g, valid, A_log, dt_bias, scale=scale, chunk_size=chunk_size,
                    use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_tpu gate_intra kernel: {reason}")
  _, Ta, HV, K = k.shape
  V = v.shape[-1]
  dt = tpu.matmul_dtype(q.dtype, k.dtype, v.dtype)
  config = config or default_config(K, V, chunk_size, dt)
  a, bias = gate_tpu.head_params(A_log, dt_bias, HV, K, use_gate_in_kernel=use_gate_in_kernel)
  res = list(launch(tpu.to_heads(g), valid[0].astype(F32)[:, None], a, bias, tpu.to_heads(q, dt),
                    tpu.to_heads(k, dt), tpu.to_heads(v, dt), tpu.column_to_heads(beta), scale=scale,
                    chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                    config=config, interpret=interpret))
  gc = [tpu.from_heads(res.pop(0), K) for _ in range(2)] if config.store_gc else [None, None]
  Aqk, Ainv, w, u, qg, kg, decay = res
  sq = lambda x: jnp.swapaxes(x, 0, 1)[None]
  return Out(*gc, sq(Aqk), sq(Ainv), tpu.from_heads(w, K), tpu.from_heads(u, V), tpu.from_heads(qg, K),
             tpu.from_heads(kg, K), jnp.swapaxes(decay[:, :, 0, :K], 0, 1))
