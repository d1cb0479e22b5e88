"""bwd_recompute (S0): rebuild, from the saved inputs, what the backward needs of the forward.

The forward saves its inputs and the intra-chunk matrices Aqk and Ainv = (I + Akk)^-1 only (both
[1, Ta, HV, BT]: O(T * BT) per head, like FLA's saved A and Akk). Everything else is recomputed
here, so no [NTa, HV, K, V] state buffer lives from the forward to the backward:

    gc       = chunk-local cumsum of the activated gate, in two parts (the gate stage)
    w = Ainv @ (beta * k * exp(gc)),  u = Ainv @ (beta * v)       (WY factors, no new inverse)
    qg = q * exp(gc),  kg = k * exp(gc_last - gc)
    h, v_new = state(kg, w, u, gc, initial_state)                 (the state stage; h[c] enters chunk c)

In:  q, k [1, Ta, HV, K], v [1, Ta, HV, V], g [1, Ta, HV, K] raw, beta [1, Ta, HV] (as `prepare`
     returns them: aligned, l2-normalised, head-mapped, gate-neutralised), valid [1, Ta] bool,
     A_log [HV] or None, dt_bias [HV*K] or None, Ainv [1, Ta, HV, BT] float32,
     initial_state [N, HV, K, V] float32, aligned_cu [N+1] int32.
Out: gc_int, gc_frac, w, qg, kg [1, Ta, HV, K], u, v_new [1, Ta, HV, V], h [1, NTa, HV, K, V]; all
     float32.
Padding: identical to the forward stages: gc is flat after a sequence's last real token and
w = u = qg = kg = v_new = 0 at padding tokens (k = v = q = beta = 0 there, Ainv's rows are one-hot).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages import gate, state
from kda.stages.base import Stage
from kda.stages.intra import chunk_decays, from_chunks, to_chunks

NAME = "bwd_recompute"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  gc_int: jax.Array   # [1, Ta, HV, K] float32 (gate.Out)
  gc_frac: jax.Array  # [1, Ta, HV, K] float32
  w: jax.Array      # [1, Ta, HV, K] float32
  u: jax.Array      # [1, Ta, HV, V] float32
  qg: jax.Array     # [1, Ta, HV, K] float32
  kg: jax.Array     # [1, Ta, HV, K] float32
  h: jax.Array      # [1, NTa, HV, K, V] float32, state entering each chunk
  v_new: jax.Array  # [1, Ta, HV, V] float32


def wy_from_inverse(q, k, v, beta, gc_int, gc_frac, Ainv, *, chunk_size):
  """(w, u, qg, kg) [1, Ta, HV, D] float32 from the saved Ainv (the intra stage's formulas)."""
  f32 = jnp.float32
  q, k, v, beta, gi, gf, Ainv = (to_chunks(x.astype(f32), chunk_size)
                                 for x in (q, k, v, beta, gc_int, gc_frac, Ainv))
  b = beta[..., None]
  e_start, e_last = chunk_decays(gi, gf)
  w = jnp.einsum("cihj,cjhk->cihk", Ainv, b * k * e_start, precision=HI)
  u = jnp.einsum("cihj,cjhv->cihv", Ainv, b * v, precision=HI)
  qg = q * e_start
  kg = k * e_last
  return tuple(from_chunks(x) for x in (w, u, qg, kg))


def reference(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
              use_gate_in_kernel, lower_bound):
  gt = gate.reference(g, valid, A_log, dt_bias, chunk_size=chunk_size,
                      use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  w, u, qg, kg = wy_from_inverse(q, k, v, beta, gt.gc_int, gt.gc_frac, Ainv, chunk_size=chunk_size)
  st = state.reference(kg, w, u, gt.gc_int, gt.gc_frac, initial_state, aligned_cu, chunk_size=chunk_size)
  return Out(gt.gc_int, gt.gc_frac, w, u, qg, kg, st.h, st.v_new)


STAGE = Stage(NAME, reference=reference)
