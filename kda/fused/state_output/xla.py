"""state -> output fused, XLA (jnp): the state recurrence and the output in one scan over the chunks
(the math is in kda.stages.state and kda.stages.output). Per chunk c, S the state entering it:

    v_new = u_c - w_c @ S
    o_c   = scale * qg_c @ S + Aqk_c @ v_new
    S     = exp(gc_last)[:, None] * S + kg_c^T @ v_new

so neither h ([NTa, HV, K, V]) nor v_new is ever stored: on a CPU every fresh MiB of temporaries
costs page faults, and the two stages' scans become one. Each chunk's tiles are taken head-major
inside the step ([HV, BT, D], batched matmuls over the heads). Sequence boundaries are selects, as
in the state stage: S entering a sequence's first chunk is its initial state, chunks of no
sequence carry zeros. Float32 throughout (o in `out_dtype` where given).

`apply(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size, ...)` ->
(o [1, Ta, HV, V], final_state [N, HV, K, V] float32), the fields the pipeline reads of the two
stages' records; `supports` takes the aligned layout with gc (not the packed rows, the inverse mode
or a precomputed decay, which only the kernels take).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._xla import compiled
from kda._vma import vary_like
from kda.padding import chunk_table
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.state import chunk_decay

HI = lax.Precision.HIGHEST


def supports(*args, rows=None, decay=None, inverse=None, **kwargs):
  """None for the aligned layout (any shape and dtype), else why not."""
  if rows is not None or decay is not None or inverse:
    return "the xla scan takes the aligned layout and gc (no packed rows, inverse mode or decay)"
  return None


@compiled
def apply(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size, out_dtype=None,
          zero_h0=False, store_final=True):
  """zero_h0, store_final (the kernels' switches) change nothing here."""
  del zero_h0, store_final
  f32 = jnp.float32
  kg, w, u, qg, Aqk = (to_chunks(x.astype(f32), chunk_size) for x in (kg, w, u, qg, Aqk))
  NTa = kg.shape[0]
  h0 = initial_state.astype(f32)
  table = chunk_table(aligned_cu, NTa, chunk_size)
  decay = chunk_decay(gc_int, gc_frac, chunk_size)              # [NTa, HV, K]
  hm = lambda x: jnp.swapaxes(x, 0, 1)                          # one chunk's [BT, HV, D] <-> [HV, BT, D]
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)

  def step(carry, x):
    S, final = carry
    kg_c, w_c, u_c, qg_c, A_c, d_c, n, first, last = x
    owned = n >= 0
    n = jnp.maximum(n, 0)
    S = jnp.where(first, h0[n], jnp.where(owned, S, 0.0))
    v_new = hm(u_c) - ein("htk,hkv->htv", hm(w_c), S)
    o = scale * ein("htk,hkv->htv", hm(qg_c), S) + ein("htj,hjv->htv", hm(A_c), v_new)
    S_next = d_c[:, :, None] * S + ein("htk,htv->hkv", hm(kg_c), v_new)
    final = final.at[n].set(jnp.where(last, S_next, final[n]))
    return (S_next, final), hm(o)

  xs = (kg, w, u, qg, Aqk, decay, table.seq, table.first, table.last)
  init = vary_like((jnp.zeros(h0.shape[1:], f32), h0), xs)   # empty sequences keep initial_state
  (_, final), o = lax.scan(step, init, xs)
  o = from_chunks(o)
  return (o if out_dtype is None else o.astype(out_dtype)), final
