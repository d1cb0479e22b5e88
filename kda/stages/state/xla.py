"""state: the XLA implementation; the math is in kda.stages.state.

The reference's scan, with each chunk's tiles taken head-major inside the step ([HV, BT, D]), so its
two products are batched matmuls over the heads with no transpose of the state; the chunk's tiles
are small enough to stay in cache. Sequence boundaries are selects, as in the reference: the state
entering a sequence's first chunk is its initial state (a select, so nothing of the chunk before
reaches it) and chunks of no sequence carry zeros.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._xla import compiled
from kda._vma import vary_like
from kda.padding import chunk_table
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.state import Out, chunk_decay

HI = lax.Precision.HIGHEST


@compiled
def apply(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size):
  f32 = jnp.float32
  kg, w, u = (to_chunks(x.astype(f32), chunk_size) for x in (kg, w, u))   # [NTa, BT, HV, D]
  NTa = kg.shape[0]
  h0 = initial_state.astype(f32)
  table = chunk_table(aligned_cu, NTa, chunk_size)
  decay = chunk_decay(gc_int, gc_frac, chunk_size)              # [NTa, HV, K]
  hm = lambda x: jnp.swapaxes(x, 0, 1)                          # one chunk's [BT, HV, D] -> [HV, BT, D]

  def step(carry, x):
    S, final = carry
    kg_c, w_c, u_c, d_c, n, first, last = x
    owned = n >= 0
    n = jnp.maximum(n, 0)
    S = jnp.where(first, h0[n], jnp.where(owned, S, 0.0))
    v_new = hm(u_c) - jnp.einsum("htk,hkv->htv", hm(w_c), S, precision=HI)
    S_next = d_c[:, :, None] * S + jnp.einsum("htk,htv->hkv", hm(kg_c), v_new, precision=HI)
    final = final.at[n].set(jnp.where(last, S_next, final[n]))
    return (S_next, final), (S, hm(v_new))

  xs = (kg, w, u, decay, table.seq, table.first, table.last)
  init = vary_like((jnp.zeros(h0.shape[1:], f32), h0), xs)   # empty sequences keep initial_state
  (_, final), (h, v_new) = lax.scan(step, init, xs)
  return Out(h[None], from_chunks(v_new), final)
