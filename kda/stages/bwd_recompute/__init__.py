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
Out: gc_int, gc_frac, w, qg, kg [1, Ta, HV, K], u, v_new [1, Ta, HV, V], h [1, NTa, HV, K, V];
     float32 from the references; w, u, qg, kg, h, v_new bf16 from the Mosaic GPU kernels for bf16
     inputs (the dtype policy), and from a fallback where they refuse such a call at their head
     dims and chunk size (kda.plan.run rounds it: mosaic_gpu.stores).
Padding: identical to the forward stages: gc is flat after a sequence's last real token and
w = u = qg = kg = v_new = 0 at padding tokens (k = v = q = beta = 0 there, Ainv's rows are one-hot).
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "bwd_recompute"


class Out(NamedTuple):
  gc_int: jax.Array   # [1, Ta, HV, K] float32 (gate.Out)
  gc_frac: jax.Array  # [1, Ta, HV, K] float32
  w: jax.Array      # [1, Ta, HV, K] float32
  u: jax.Array      # [1, Ta, HV, V] float32
  qg: jax.Array     # [1, Ta, HV, K] float32
  kg: jax.Array     # [1, Ta, HV, K] float32
  h: jax.Array      # [1, NTa, HV, K, V] float32, state entering each chunk
  v_new: jax.Array  # [1, Ta, HV, V] float32


from kda.stages.bwd_recompute import mosaic_gpu, mosaic_tpu, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
