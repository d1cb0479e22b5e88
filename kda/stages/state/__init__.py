"""state: the state recurrence across the chunks of each sequence.

For chunk c of a sequence, S the [K, V] float32 state entering it (initial_state[n] for the first):

    h[c]     = S
    v_new    = u - w @ S
    S_next   = exp(gc_last)[:, None] * S + kg^T @ v_new

In:  kg, w [1, Ta, HV, K], u [1, Ta, HV, V], gc_int, gc_frac [1, Ta, HV, K] float32 (the gate stage's
     two parts of gc; only each chunk's last row is read), initial_state [N, HV, K, V] float32,
     aligned_cu [N+1] int32 (multiples of BT).
Out: h [1, NTa, HV, K, V] float32 (0 for chunks after aligned_cu[-1]), v_new [1, Ta, HV, V] float32
     (both bf16 from the mosaic_gpu kernel when kg, w, u are bf16: the dtype policy),
     final_state [N, HV, K, V] float32 (initial_state[n] for an empty sequence).
Padding: u = w = kg = 0 at padding tokens, so v_new = 0 there and the state leaving a sequence's last
chunk is the state after its last real token (gc is flat over the padding).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda.stages.base import Stage
from kda.stages.gate import exponent
from kda.stages.intra import to_chunks

NAME = "state"


class Out(NamedTuple):
  h: jax.Array            # [1, NTa, HV, K, V] float32, state entering each chunk
  v_new: jax.Array        # [1, Ta, HV, V] float32
  final_state: jax.Array  # [N, HV, K, V] float32


def chunk_decay(gc_int, gc_frac, chunk_size):
  """exp(gc_last) of every chunk: [NTa, HV, K] float32."""
  last = lambda x: to_chunks(x.astype(jnp.float32), chunk_size)[:, -1]
  return jnp.exp(exponent(last(gc_int), last(gc_frac)))


from kda.stages.state import mosaic_gpu, mosaic_tpu, pallas, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, pallas=pallas, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
