"""bwd_dh (S2): the state gradient, chunk by chunk in reverse time, per sequence.

Forward, chunk c with S = h[c] entering it: o = scale * qg @ S + Aqk @ v_new, v_new = u - w @ S,
S_next = exp(gc_last)[:, None] * S + kg^T @ v_new. Let dS_next be the cotangent of S_next (dht[n] for
the last chunk of sequence n, else what chunk c + 1 sends back). Then

    dv_new = dv + kg @ dS_next                         dv: S1's part (Aqk^T @ do)
    dS     = exp(gc_last)[:, None] * dS_next + scale * qg^T @ do - w^T @ dv_new

and dS goes to chunk c - 1, or to dh0[n] at the sequence's first chunk.

In:  qg, kg, w [1, Ta, HV, K] f32, gc [1, Ta, HV, K] f32, do [1, Ta, HV, V], dv [1, Ta, HV, V] f32,
     dht [N, HV, K, V] f32 (final-state cotangent), aligned_cu [N+1] int32 (multiples of BT).
Out: dh [1, NTa, HV, K, V] float32: dh[c] = dS_next, the cotangent of the state LEAVING chunk c
     (what FLA stores; bwd_wy pairs it with h[c], the state entering c); 0 for chunks after
     aligned_cu[-1].
     dh0 [N, HV, K, V] float32: the cotangent of initial_state (dht[n] for an empty sequence, whose
     final state is its initial state).
     dv [1, Ta, HV, V] float32: dv_new, the total v_new cotangent.
Padding: qg = kg = w = do = dv = 0 at padding tokens, so they add nothing; gc is flat after the last
real token, so exp(gc_last) is the decay of the real tokens alone; sequences never exchange dS (the
carry is replaced at every sequence's last chunk).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.padding import chunk_table
from kda.stages.base import Stage
from kda.stages.intra import from_chunks, to_chunks

NAME = "bwd_dh"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  dh: jax.Array   # [1, NTa, HV, K, V] float32, cotangent of the state leaving each chunk
  dh0: jax.Array  # [N, HV, K, V] float32
  dv: jax.Array   # [1, Ta, HV, V] float32, total cotangent of v_new


def reference(qg, kg, w, gc, do, dv, dht, aligned_cu, *, scale, chunk_size):
  f32 = jnp.float32
  qg, kg, w, gc, do, dv = (to_chunks(x.astype(f32), chunk_size) for x in (qg, kg, w, gc, do, dv))
  NTa = qg.shape[0]
  dht = dht.astype(f32)
  table = chunk_table(aligned_cu, NTa, chunk_size)
  decay = jnp.exp(gc[:, -1])                                    # [NTa, HV, K]

  def step(carry, x):
    dS, dh0 = carry
    qg_c, kg_c, w_c, do_c, dv_c, d_c, n, first, last = x
    owned = n >= 0
    n = jnp.maximum(n, 0)
    dS = jnp.where(last, dht[n], jnp.where(owned, dS, 0.0))
    dv_new = dv_c + jnp.einsum("thk,hkv->thv", kg_c, dS, precision=HI)
    dS_in = (d_c[:, :, None] * dS + scale * jnp.einsum("thk,thv->hkv", qg_c, do_c, precision=HI)
             - jnp.einsum("thk,thv->hkv", w_c, dv_new, precision=HI))
    dh0 = dh0.at[n].set(jnp.where(first, dS_in, dh0[n]))
    return (dS_in, dh0), (dS, dv_new)

  init = (jnp.zeros(dht.shape[1:], f32), dht)          # empty sequences pass dht straight to dh0
  xs = (qg, kg, w, do, dv, decay, table.seq, table.first, table.last)
  (_, dh0), (dh, dv_new) = lax.scan(step, init, xs, reverse=True)
  return Out(dh[None], dh0, from_chunks(dv_new))


STAGE = Stage(NAME, reference=reference)
