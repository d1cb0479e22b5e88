"""bwd_recompute: the XLA implementation; the math is in kda.stages.bwd_recompute.

The reference's steps through the XLA implementations of the gate and state stages (the WY factors
from the saved Ainv are the reference's matmuls): the same records, the forward's faster paths.
"""
from __future__ import annotations

from kda._xla import compiled
from kda.stages import gate, state
from kda.stages.bwd_recompute import Out
from kda.stages.bwd_recompute.reference import wy_from_inverse


@compiled
def apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
          use_gate_in_kernel, lower_bound, zero_h0=False):
  """zero_h0 (initial_state is zeros) changes nothing here: the zeros are used as given."""
  del zero_h0
  gt = gate.xla.apply(g, valid, A_log, dt_bias, chunk_size=chunk_size,
                      use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  w, u, qg, kg = wy_from_inverse(q, k, v, beta, gt.gc_int, gt.gc_frac, Ainv, chunk_size=chunk_size)
  st = state.xla.apply(kg, w, u, gt.gc_int, gt.gc_frac, initial_state, aligned_cu, chunk_size=chunk_size)
  return Out(gt.gc_int, gt.gc_frac, w, u, qg, kg, st.h, st.v_new)
