"""bwd_dh: the jnp reference; the math is in kda.stages.bwd_dh."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._vma import vary_like
from kda.padding import chunk_table
from kda.stages.bwd_dh import Out
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.state import chunk_decay

HI = lax.Precision.HIGHEST


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

  xs = (qg, kg, w, h[0].astype(f32), v_new, do, dv, decay, table.seq, table.first, table.last)
  init = vary_like((jnp.zeros(dht.shape[1:], f32), dht), xs)   # empty sequences pass dht straight to dh0
  (_, dh0), (du, dqg, dkg, dw, dgc_last) = lax.scan(step, init, xs, reverse=True)
  return Out(dh0, *(from_chunks(x) for x in (du, dqg, dkg, dw)), dgc_last[None])
