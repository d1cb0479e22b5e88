"""bwd_dh (S2): the state gradient, chunk by chunk in reverse time, and every term that needs it or h.

Forward, chunk c with S = h[c] entering it: o = scale * qg @ S + Aqk @ v_new, v_new = u - w @ S,
S_next = exp(gc_last)[:, None] * S + kg^T @ v_new. Let dS_next be the cotangent of S_next (dht[n] for
the last chunk of sequence n, else what chunk c + 1 sends back). Then

    du       = dv + kg @ dS_next                       dv: S1's part (Aqk^T @ do); du = dv_new
    dqg      = scale * do @ S^T
    dkg      = v_new @ dS_next^T
    dw       = -du @ S^T
    dgc_last = exp(gc_last) * sum_V(S * dS_next)       through the decay of S_next only
    dS       = exp(gc_last)[:, None] * dS_next + scale * qg^T @ do - w^T @ du

and dS goes to chunk c - 1, or to dh0[n] at the sequence's first chunk. This is the vjp of the state
recurrence and the inter-chunk output term in (qg, kg, w, u, gc_last, initial_state). dS_next lives
one chunk at a time in the scan's carry and h is only read: the backward's one [NTa, HV, K, V]
buffer is S0's h, and nothing this stage returns grows with K * V per chunk.

In:  qg, kg, w [1, Ta, HV, K] f32, gc_int, gc_frac [1, Ta, HV, K] f32 (gate.Out), h [1, NTa, HV, K, V] f32 (S0: state
     entering each chunk), v_new [1, Ta, HV, V] f32, do [1, Ta, HV, V], dv [1, Ta, HV, V] f32,
     dht [N, HV, K, V] f32 (final-state cotangent), aligned_cu [N+1] int32 (multiples of BT).
Out: dh0 [N, HV, K, V] float32: the cotangent of initial_state (dht[n] for an empty sequence, whose
     final state is its initial state).
     du [1, Ta, HV, V] float32: the total cotangent of v_new, i.e. of u.
     dqg, dkg, dw [1, Ta, HV, K] float32: the cotangents of qg, kg, w through the state.
     dgc_last [1, NTa, HV, K] float32: the cotangent of gc at each chunk's last row through the decay.
Padding: qg = kg = w = v_new = do = dv = 0 at padding tokens, so they add nothing to dS (dqg, dkg, dw
at padding tokens are multiplied by their q, k, beta = 0 in S3); gc is flat after the last real
token, so exp(gc_last) is the decay of the real tokens alone; sequences never exchange dS (the carry
is replaced at every sequence's last chunk); chunks after aligned_cu[-1] have dS_next = 0 and h = 0,
so dkg = dgc_last = 0 and du = dv there.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "bwd_dh"


class Out(NamedTuple):
  dh0: jax.Array       # [N, HV, K, V] float32
  du: jax.Array        # [1, Ta, HV, V] float32, total cotangent of v_new (= of u)
  dqg: jax.Array       # [1, Ta, HV, K] float32
  dkg: jax.Array       # [1, Ta, HV, K] float32
  dw: jax.Array        # [1, Ta, HV, K] float32
  dgc_last: jax.Array  # [1, NTa, HV, K] float32


from kda.stages.bwd_dh import mosaic_gpu, mosaic_tpu, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
