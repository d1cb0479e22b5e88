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
import jax.numpy as jnp
from jax import lax

from kda.padding import chunk_table
from kda.stages.base import Stage
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.state import chunk_decay

NAME = "bwd_dh"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  dh0: jax.Array       # [N, HV, K, V] float32
  du: jax.Array        # [1, Ta, HV, V] float32, total cotangent of v_new (= of u)
  dqg: jax.Array       # [1, Ta, HV, K] float32
  dkg: jax.Array       # [1, Ta, HV, K] float32
  dw: jax.Array        # [1, Ta, HV, K] float32
  dgc_last: jax.Array  # [1, NTa, HV, K] float32


def reference(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, *, scale, chunk_size):
  f32 = jnp.float32
  qg, kg, w, v_new, do, dv = (to_chunks(x.astype(f32), chunk_size) for x in (qg, kg, w, v_new, do, dv))
  NTa = qg.shape[0]
  dht = dht.astype(f32)
  table = chunk_table(aligned_cu, NTa, chunk_size)
  decay = chunk_decay(gc_int, gc_frac, chunk_size)              # [NTa, HV, K]
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)

  def step(carry, x):
    dS, dh0 = carry
    qg_c, kg_c, w_c, S, vn_c, do_c, dv_c, d_c, n, first, last = x
    owned = n >= 0
    n = jnp.maximum(n, 0)
    dS = jnp.where(last, dht[n], jnp.where(owned, dS, 0.0))   # cotangent of the state leaving c
    du = dv_c + ein("thk,hkv->thv", kg_c, dS)
    dqg = scale * ein("thv,hkv->thk", do_c, S)
    dkg = ein("thv,hkv->thk", vn_c, dS)
    dw = -ein("thv,hkv->thk", du, S)
    dgc_last = d_c * ein("hkv,hkv->hk", S, dS)
    dS_in = d_c[:, :, None] * dS + scale * ein("thk,thv->hkv", qg_c, do_c) - ein("thk,thv->hkv", w_c, du)
    dh0 = dh0.at[n].set(jnp.where(first, dS_in, dh0[n]))
    return (dS_in, dh0), (du, dqg, dkg, dw, dgc_last)

  init = (jnp.zeros(dht.shape[1:], f32), dht)          # empty sequences pass dht straight to dh0
  xs = (qg, kg, w, h[0].astype(f32), v_new, do, dv, decay, table.seq, table.first, table.last)
  (_, dh0), (du, dqg, dkg, dw, dgc_last) = lax.scan(step, init, xs, reverse=True)
  return Out(dh0, *(from_chunks(x) for x in (du, dqg, dkg, dw)), dgc_last[None])


STAGE = Stage(NAME, reference=reference)
