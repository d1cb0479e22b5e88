"""bwd_dh: the XLA implementation; the math is in kda.stages.bwd_dh.

The reference's reverse scan, with each chunk's tiles taken head-major inside the step ([HV, BT, D]),
so its products are batched matmuls over the heads with no transpose of the state or its cotangent
(the tiles stay in cache). Sequence boundaries are selects, as in the reference: the cotangent
leaving a sequence's last chunk is its dht, chunks of no sequence carry zeros.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._xla import compiled
from kda._vma import vary_like
from kda.padding import chunk_table
from kda.stages.bwd_dh import Out
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.state import chunk_decay

HI = lax.Precision.HIGHEST


@compiled
def apply(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, *, scale, chunk_size, dht_zero=False,
          need_dh0=True):
  """dht_zero, need_dh0 (the kernels' switches) change nothing here: dht is used as given and dh0
  returned."""
  del dht_zero, need_dh0
  f32 = jnp.float32
  qg, kg, w, v_new, do, dv = (to_chunks(x.astype(f32), chunk_size) for x in (qg, kg, w, v_new, do, dv))
  NTa = qg.shape[0]
  dht = dht.astype(f32)
  table = chunk_table(aligned_cu, NTa, chunk_size)
  decay = chunk_decay(gc_int, gc_frac, chunk_size)              # [NTa, HV, K]
  hm = lambda x: jnp.swapaxes(x, 0, 1)                          # one chunk's [BT, HV, D] <-> [HV, BT, D]
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)

  def step(carry, x):
    dS, dh0 = carry
    qg_c, kg_c, w_c, S, vn_c, do_c, dv_c, d_c, n, first, last = x
    qg_c, kg_c, w_c, vn_c, do_c, dv_c = (hm(t) for t in (qg_c, kg_c, w_c, vn_c, do_c, dv_c))
    owned = n >= 0
    n = jnp.maximum(n, 0)
    dS = jnp.where(last, dht[n], jnp.where(owned, dS, 0.0))   # cotangent of the state leaving c
    du = dv_c + ein("htk,hkv->htv", kg_c, dS)
    dqg = scale * ein("htv,hkv->htk", do_c, S)
    dkg = ein("htv,hkv->htk", vn_c, dS)
    dw = -ein("htv,hkv->htk", du, S)
    dgc_last = d_c * jnp.sum(S * dS, -1)
    dS_in = d_c[:, :, None] * dS + scale * ein("htk,htv->hkv", qg_c, do_c) - ein("htk,htv->hkv", w_c, du)
    dh0 = dh0.at[n].set(jnp.where(first, dS_in, dh0[n]))
    return (dS_in, dh0), (hm(du), hm(dqg), hm(dkg), hm(dw), dgc_last)

  xs = (qg, kg, w, h[0].astype(f32), v_new, do, dv, decay, table.seq, table.first, table.last)
  init = vary_like((jnp.zeros(dht.shape[1:], f32), dht), xs)   # empty sequences pass dht straight to dh0
  (_, dh0), (du, dqg, dkg, dw, dgc_last) = lax.scan(step, init, xs, reverse=True)
  return Out(dh0, *(from_chunks(x) for x in (du, dqg, dkg, dw)), dgc_last[None])
