"""bwd_recompute: the Pallas Mosaic GPU (Hopper) implementation; the math is in kda.stages.bwd_recompute.

The forward's own Mosaic GPU kernels, run again on the saved inputs: the gate kernel (gc in two
parts), the intra kernels (w, u, qg, kg; they also form Akk, Aqk and the inverse again, which costs
one solve but gives Ainv bit for bit as the forward stored it, the same kernel on the same inputs)
and the state kernel (h, v_new). The saved Ainv is not read. Outputs follow the dtype policy: gc
float32; w, u, qg, kg, h, v_new bf16, as the forward's kernels store them for bf16 inputs (the
backward stages upcast what they read). `takes` is the conjunction of the three kernels'
predicates (bf16 q, k, v; chunk_size 64; K, V in {64, 128}).
"""
from __future__ import annotations

from typing import Optional

import jax

from kda.stages.bwd_recompute import Out
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import mosaic_gpu as intra_mgpu
from kda.stages.state import mosaic_gpu as state_mgpu

_BF16 = "bfloat16"


def takes(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
          use_gate_in_kernel, lower_bound, **_) -> Optional[str]:
  """None if the three kernels take the call, else the first reason."""
  reason = gate_mgpu.takes(g, valid, A_log, dt_bias, chunk_size=chunk_size,
                           use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  if reason is not None:
    return reason
  S = jax.ShapeDtypeStruct
  gc = S(k.shape, "float32")
  reason = intra_mgpu.takes(q, k, v, beta, gc, gc, aligned_cu, scale=1.0, chunk_size=chunk_size)
  if reason is not None:
    return reason
  kb = S(k.shape, _BF16)
  return state_mgpu.takes(kb, kb, S(v.shape, _BF16), gc, gc, initial_state, aligned_cu, chunk_size=chunk_size)


def apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
          use_gate_in_kernel, lower_bound, interpret=False):
  del Ainv       # formed again by the intra kernels, bit for bit
  reason = takes(q, k, v, g, beta, valid, A_log, dt_bias, None, initial_state, aligned_cu, chunk_size=chunk_size,
                 use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_recompute: {reason}")
  gt = gate_mgpu.apply(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                       lower_bound=lower_bound, interpret=interpret)
  it = intra_mgpu.apply(q, k, v, beta, gt.gc_int, gt.gc_frac, aligned_cu, scale=1.0, chunk_size=chunk_size,
                        interpret=interpret)
  st = state_mgpu.apply(it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                        interpret=interpret)
  return Out(gt.gc_int, gt.gc_frac, it.w, it.u, it.qg, it.kg, st.h, st.v_new)
