"""bwd_intra: the jnp reference; the math is in kda.stages.bwd_intra."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda.stages.bwd_intra import Out, summed
from kda.stages.intra import from_chunks, over_chunk_blocks, pair_decay, to_chunks

HI = lax.Precision.HIGHEST


def apply(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu=None, *, scale, chunk_size,
          grad_dtype=None):
  """aligned_cu is not used: every chunk is computed (no token at the tail, so no term there).
  grad_dtype: dq's and dk's dtype (float32 unless given)."""
  del aligned_cu
  f32 = jnp.float32
  dAkk = summed(dAkk)
  q, k, beta, gi, gf, dAqk, dAkk = (to_chunks(x.astype(f32), chunk_size)
                                    for x in (q, k, beta, gc_int, gc_frac, dAqk, dAkk))
  ein = lambda s, *a: jnp.einsum(s, *a, precision=HI)

  def block(gi, gf, q, k, beta, dAqk, dAkk):
    Es = pair_decay(gi, gf, True)                                # [n, BT(i), BT(j), HV, K], j < i
    b = beta[..., None]
    dqAs = scale * ein("cihj,cjhk,cijhk->cihk", dAqk, k, Es)           # the pairs j < i
    dkAs = scale * ein("cihj,cihk,cijhk->cjhk", dAqk, q, Es)
    d = scale * jnp.moveaxis(jnp.diagonal(dAqk, axis1=1, axis2=3), 1, 2)[..., None]   # [n, BT, HV, 1]
    dqA, dkA = dqAs + d * k, dkAs + d * q                               # and the diagonal, E = 1
    G = ein("cihj,cjhk,cijhk->cihk", dAkk, k, Es)
    dkK1 = b * G
    dkK2 = ein("cihj,cihk,cijhk->cjhk", dAkk * beta[..., None], k, Es)
    dgc_t = q * dqAs - k * dkAs + k * dkK1 - k * dkK2
    return dqA, dkA + dkK1 + dkK2, jnp.sum(k * G, -1), dgc_t

  dq_t, dk_t, dbeta_t, dgc_t = over_chunk_blocks(block, gi, gf, q, k, beta, dAqk, dAkk)
  add = lambda acc, x: acc.astype(f32) + from_chunks(x)
  out = lambda acc, x: add(acc, x).astype(grad_dtype or f32)
  return Out(out(dq, dq_t), out(dk, dk_t), add(dbeta, dbeta_t), add(dgc, dgc_t))
