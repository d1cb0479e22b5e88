"""bwd_wy: the jnp reference; the math is in kda.stages.bwd_wy."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda.stages.bwd_wy import Out
from kda.stages.intra import chunk_decays, from_chunks, to_chunks

HI = lax.Precision.HIGHEST


def apply(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *, chunk_size,
          dv_dtype=None):
  """aligned_cu is not used: every chunk is computed (the tail's inputs are zeros, so its outputs are).
  dv_dtype: dv's dtype (float32 unless given)."""
  del aligned_cu
  f32 = jnp.float32
  BT = chunk_size
  q, k, v, beta, gi, gf, Ainv, dqg, dkg, dw, du = (
      to_chunks(x.astype(f32), BT) for x in (q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du))
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)
  b = beta[..., None]
  eg, el = chunk_decays(gi, gf)                                  # exp(gc), exp(gc_last - gc)
  qg, kg, kb, vb = q * eg, k * el, b * k * eg, b * v

  dkb = ein("cihj,cihk->cjhk", Ainv, dw)                         # Ainv^T @ dw
  dvb = ein("cihj,cihv->cjhv", Ainv, du)                         # Ainv^T @ du
  dAinv = ein("cihk,cjhk->cihj", dw, kb) + ein("cihv,cjhv->cihj", du, vb)
  M = ein("ciha,cihb->cahb", Ainv, ein("cihj,cbhj->cihb", dAinv, Ainv))   # Ainv^T dAinv Ainv^T
  strict = jnp.arange(BT)[None, :, None, None] > jnp.arange(BT)[None, None, None, :]
  dAkk = jnp.where(strict, -M, 0.0)

  dq = dqg * eg
  dk = dkg * el + dkb * b * eg
  dv = dvb * b
  dbeta = jnp.sum(dkb * k * eg, -1) + jnp.sum(dvb * v, -1)
  dgc = dqg * qg + dkb * kb
  x = dkg * kg
  before = jnp.cumsum(jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1), axis=1)   # s < t
  dg_state = before + dgc_last[0].astype(f32)[:, None]
  dv = dv.astype(dv_dtype or f32)
  return Out(*(from_chunks(x) for x in (dq, dk, dv, dbeta, dgc, dg_state, dAkk)))
