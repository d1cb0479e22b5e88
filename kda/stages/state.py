"""state: the state recurrence across the chunks of each sequence.

For chunk c of a sequence, S the [K, V] float32 state entering it (initial_state[n] for the first):

    h[c]     = S
    v_new    = u - w @ S
    S_next   = exp(gc_last)[:, None] * S + kg^T @ v_new

In:  kg, w [1, Ta, HV, K], u [1, Ta, HV, V], gc [1, Ta, HV, K] float32, initial_state [N, HV, K, V]
     float32, aligned_cu [N+1] int32 (multiples of BT).
Out: h [1, NTa, HV, K, V] float32 (0 for chunks after aligned_cu[-1]), v_new [1, Ta, HV, V] float32,
     final_state [N, HV, K, V] float32 (initial_state[n] for an empty sequence).
Padding: u = w = kg = 0 at padding tokens, so v_new = 0 there and the state leaving a sequence's last
chunk is the state after its last real token (gc is flat over the padding).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.padding import chunk_table
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.base import Stage

NAME = "state"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  h: jax.Array            # [1, NTa, HV, K, V] float32, state entering each chunk
  v_new: jax.Array        # [1, Ta, HV, V] float32
  final_state: jax.Array  # [N, HV, K, V] float32


def reference(kg, w, u, gc, initial_state, aligned_cu, *, chunk_size):
  f32 = jnp.float32
  kg, w, u, gc = (to_chunks(x.astype(f32), chunk_size) for x in (kg, w, u, gc))
  NTa = kg.shape[0]
  h0 = initial_state.astype(f32)
  table = chunk_table(aligned_cu, NTa, chunk_size)
  decay = jnp.exp(gc[:, -1])                                    # [NTa, HV, K]

  def step(carry, x):
    S, final = carry
    kg_c, w_c, u_c, d_c, n, first, last = x
    owned = n >= 0
    n = jnp.maximum(n, 0)
    S = jnp.where(first, h0[n], jnp.where(owned, S, 0.0))
    v_new = u_c - jnp.einsum("thk,hkv->thv", w_c, S, precision=HI)
    S_next = d_c[:, :, None] * S + jnp.einsum("thk,thv->hkv", kg_c, v_new, precision=HI)
    final = final.at[n].set(jnp.where(last, S_next, final[n]))
    return (S_next, final), (S, v_new)

  init = (jnp.zeros(h0.shape[1:], f32), h0)          # empty sequences keep initial_state
  xs = (kg, w, u, decay, table.seq, table.first, table.last)
  (_, final), (h, v_new) = lax.scan(step, init, xs)
  return Out(h[None], from_chunks(v_new), final)


STAGE = Stage(NAME, reference=reference)
