"""bwd_recompute (S0): the Mosaic TPU composition; the math is in kda.stages.bwd_recompute.

Three kernels on head-first arrays (kda._mosaic_tpu's layout: [HV, Ta, Dp], D zero-padded to a
multiple of 128 lanes), transposed to the stage layout once at the end:

1. the forward's gate kernel (kda.stages.gate.mosaic_tpu.launch): gc_int, gc_frac;
2. the WY kernel here, w, u, qg, kg from the SAVED Ainv (no scores, no solve). Grid (HV / MB, NTa),
   both "parallel"; per chunk and head, with eg = exp(gc), el = exp(gc_last - gc) (exponents from
   gc's two parts, <= 0):
       w = Ainv @ (beta * k * eg),  u = Ainv @ (beta * v),  qg = q * eg,  kg = k * el
   Blocks q, k, gc_int, gc_frac, w, qg, kg (MB, BT, Kp); v, u (MB, BT, Vp); Ainv (MB, BT, BT); beta
   (MB, BT) per head group (kda._mosaic_tpu_bwd.scalars_in), turned into a column in VMEM;
3. the forward's state kernel (kda.stages.state.mosaic_tpu.launch) on kg, w, u and the chunk decays
   exp(gc_last): h (its transposed [HV, NTa, Vp, Kp] layout) and v_new, no final state.

Dtype policy: bf16 q, k, v -> the WY dots take bf16 operands (Ainv rounded) with float32
accumulation and w, u, qg, kg are stored in bf16, so the state kernel runs its bf16 dots and stores
h, v_new in bf16 (as the forward's kernels store them; the backward stages upcast what they read);
float32 inputs -> HIGHEST and float32 everywhere. gc is float32 always. The WY kernel's VMEM at
K = V = 128, BT = 64, MB = 16: 6.8 MiB (bf16) / 10.3 MiB; the gate and state kernels size their own.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu as tpu
from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_recompute import Out
from kda.stages.gate import exponent
from kda.stages.gate import mosaic_tpu as gate_tpu
from kda.stages.state import mosaic_tpu as state_tpu


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1                 # MB of the WY kernel (a divisor of HV)
  gate: Optional[gate_tpu.Config] = None     # None: the gate kernel's defaults
  state: Optional[state_tpu.Config] = None   # None: the state kernel's defaults


def _mm_dtype(q, k, v):
  return tpu.matmul_dtype(q.dtype, k.dtype, v.dtype)


def vmem_need(MB, Kp, Vp, BT, in_dtype, out_dtype) -> int:
  b = T.block_bytes
  ins = 2 * b((MB, BT, Kp), in_dtype) + b((MB, BT, Vp), in_dtype) + b((MB, BT), T.F32)
  ins += 2 * b((MB, BT, Kp), T.F32) + b((MB, BT, BT), T.F32)
  outs = 3 * b((MB, BT, Kp), out_dtype) + b((MB, BT, Vp), out_dtype)
  return 2 * (ins + outs) + 10 * b((BT, max(Kp, Vp)), T.F32)


def default_config(HV, K, V, BT, dtype=T.F32) -> Config:
  Kp, Vp = tpu.lanes(K), tpu.lanes(V)
  mb = T.heads_per_program(HV, vmem_need(1, Kp, Vp, BT, dtype, dtype))
  return Config(max(mb, 1), gate_tpu.default_config(K, BT, T.F32), state_tpu.default_config(K, V, BT, dtype))


def supports(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
             use_gate_in_kernel, lower_bound, zero_h0=False, config=None, **_) -> Optional[str]:
  if q.ndim != 4 or q.shape[0] != 1 or v.ndim != 4:
    return f"q must be [1, Ta, HV, K] and v [1, Ta, HV, V], got {q.shape}, {v.shape}"
  _, Ta, HV, K = q.shape
  V = v.shape[-1]
  if (r := T.chunk_reason(Ta, chunk_size)) is not None:
    return r
  for name, x, shape in (("k", k, q.shape), ("g", g, q.shape), ("beta", beta, (1, Ta, HV)),
                         ("Ainv", Ainv, (1, Ta, HV, chunk_size))):
    if x.shape != shape:
      return f"{name} must have shape {shape}, got {x.shape}"
  if (r := T.dtype_reason((("q", q), ("k", k), ("v", v), ("beta", beta), ("Ainv", Ainv)))) is not None:
    return r
  if (r := T.aligned_cu_reason(aligned_cu)) is not None:
    return r
  dt = _mm_dtype(q, k, v)
  cfg = config or default_config(HV, K, V, chunk_size, dt)
  r = gate_tpu.supports(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                        lower_bound=lower_bound, config=cfg.gate)
  if r is not None:
    return f"gate kernel: {r}"
  S = jax.ShapeDtypeStruct
  r = state_tpu.supports(S(q.shape, dt), S(q.shape, dt), S(v.shape, dt), S(q.shape, T.F32), S(q.shape, T.F32),
                         initial_state, aligned_cu, chunk_size=chunk_size, config=cfg.state)
  if r is not None:
    return f"state kernel: {r}"
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  return T.budget_reason("bwd_recompute (wy)", vmem_need(cfg.heads_per_program, tpu.lanes(K), tpu.lanes(V),
                                                         chunk_size, dt, dt))


def wy_chunk(q, k, v, bcol, gi, gf, gi_last, gf_last, Ainv, *, low):
  """One chunk of one head: (w, u, qg, kg) float32 from the saved Ainv [BT, BT]; q, k, gi, gf
  [BT, Kp]; v [BT, Vp]; bcol [BT, 1]; gi_last, gf_last [1, Kp]."""
  q, k, v = (x.astype(T.F32) for x in (q, k, v))
  eg = jnp.exp(exponent(gi, gf))
  el = jnp.exp(exponent(gi_last, gf_last, gi, gf))
  w = T.mm(Ainv, bcol * k * eg, T.NN, low)
  u = T.mm(Ainv, bcol * v, T.NN, low)
  return w, u, q * eg, k * el


def _wy_kernel(q_r, k_r, v_r, b_r, gi_r, gf_r, A_r, w_o, u_o, qg_o, kg_o, *, MB, BT, low):
  last = pl.ds(BT - 1, 1)

  def head(m):
    w, u, qg, kg = wy_chunk(q_r[m], k_r[m], v_r[m], T.to_col(T.head_row(b_r, m)), gi_r[m], gf_r[m],
                            gi_r[m, last, :], gf_r[m, last, :], A_r[m].astype(T.F32), low=low)
    for o, x in ((w_o, w), (u_o, u), (qg_o, qg), (kg_o, kg)):
      o[m] = x.astype(o.dtype)
  T.head_loop(MB, head)


def wy_launch(q, k, v, beta, gi, gf, Ainv, *, chunk_size, heads, out_dtype, interpret=False):
  """Head-first q, k, gi, gf [HV, Ta, Kp], v [HV, Ta, Vp], Ainv [HV, Ta, BT], beta [1, Ta, HV] ->
  (w, u, qg, kg) head-first in out_dtype."""
  HV, Ta, Kp = q.shape
  Vp, BT = v.shape[-1], chunk_size
  MB = heads
  low = jnp.dtype(out_dtype) == jnp.dtype(T.BF16)
  tok = lambda D: T.token_block(MB, BT, D)
  args = [q, k, v, T.scalars_in(beta.astype(T.F32), MB, BT), gi, gf, Ainv]
  S = jax.ShapeDtypeStruct
  out_shape = [S((HV, Ta, Kp), out_dtype), S((HV, Ta, Vp), out_dtype), S((HV, Ta, Kp), out_dtype),
               S((HV, Ta, Kp), out_dtype)]
  nbytes = (sum(x.size * x.dtype.itemsize for x in args)
            + sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_shape))
  return pl.pallas_call(
      functools.partial(_wy_kernel, MB=MB, BT=BT, low=low),
      grid=(HV // MB, Ta // BT),
      in_specs=[tok(Kp), tok(Kp), tok(Vp), T.group_block(MB, BT), tok(Kp), tok(Kp), tok(BT)],
      out_specs=[tok(Kp), tok(Vp), tok(Kp), tok(Kp)], out_shape=out_shape,
      compiler_params=T.compiler_params(("parallel", "parallel"),
                                        vmem_need(MB, Kp, Vp, BT, q.dtype, out_dtype)),
      cost_estimate=pl.CostEstimate(flops=2 * HV * Ta * BT * (Kp + Vp), transcendentals=2 * HV * Ta * Kp,
                                    bytes_accessed=nbytes),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_recompute_wy",
  )(*args)


def apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
          use_gate_in_kernel, lower_bound, zero_h0=False, interpret=False, config=None) -> Out:
  """zero_h0: initial_state is known to be zero (not read)."""
  T.refuse("bwd_recompute", supports(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu,
                                     chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                                     lower_bound=lower_bound, config=config))
  BT = chunk_size
  _, Ta, HV, K = q.shape
  V, N, NTa = v.shape[-1], aligned_cu.shape[0] - 1, Ta // BT
  dt = _mm_dtype(q, k, v)
  cfg = config or default_config(HV, K, V, BT, dt)
  gcfg = cfg.gate or gate_tpu.default_config(K, BT, g.dtype)
  scfg = cfg.state or state_tpu.default_config(K, V, BT, dt)
  a, bias = gate_tpu.head_params(A_log, dt_bias, HV, K, use_gate_in_kernel=use_gate_in_kernel)
  _, gi, gf = gate_tpu.launch(tpu.to_heads(g), valid[0].astype(T.F32)[:, None], a, bias, chunk_size=BT,
                              use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, config=gcfg,
                              interpret=interpret)
  w, u, qg, kg = wy_launch(tpu.to_heads(q), tpu.to_heads(k), tpu.to_heads(v), beta, gi, gf,
                           tpu.square_to_heads(Ainv.astype(T.F32)), chunk_size=BT,
                           heads=cfg.heads_per_program, out_dtype=dt, interpret=interpret)
  Kp, Vp = gi.shape[-1], u.shape[-1]
  if N == 0:                      # every chunk is tail: S = 0 there
    h, v_new = jnp.zeros((HV, NTa, Vp, Kp), dt), u
  else:
    decay = jnp.exp(exponent(gi[:, BT - 1::BT], gf[:, BT - 1::BT]))[:, :, None, :]   # [HV, NTa, 1, Kp]
    blk, flags = tpu.chunk_flags(aligned_cu.astype(jnp.int32), NTa, BT)
    h0 = None if zero_h0 else tpu.states_to_heads(initial_state)
    st = state_tpu.launch(kg, w, u, decay, h0, blk, flags, N=N, chunk_size=BT, config=scfg, store_final=False,
                          interpret=interpret)
    h, v_new = st.h, st.v_new
  fh = lambda x, D: tpu.from_heads(x, D)
  return Out(fh(gi, K), fh(gf, K), fh(w, K), fh(u, V), fh(qg, K), fh(kg, K), tpu.h_from_heads(h, K, V),
             fh(v_new, V))
