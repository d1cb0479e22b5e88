"""intra: the jnp reference; the math is in kda.stages.intra."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.intra import Out, chunk_decays, from_chunks, over_chunk_blocks, pair_decay, to_chunks

HI = lax.Precision.HIGHEST


def chunk_matrices(q, k, beta, gi, gf, scale):
  """Chunked inputs (f32) -> Akk, Aqk as [NTa, HV, BT, BT]."""
  def block(gi, gf, q, k, beta):
    Akk = jnp.einsum("cihk,cjhk,cijhk->chij", k, k, pair_decay(gi, gf, True), precision=HI)
    Akk = Akk * jnp.moveaxis(beta, 1, 2)[..., None]
    Aqk = scale * jnp.einsum("cihk,cjhk,cijhk->chij", q, k, pair_decay(gi, gf, False), precision=HI)
    return Akk, Aqk
  return over_chunk_blocks(block, gi, gf, q, k, beta)


def unit_lower_inverse(A):
  """(I + A)^-1 for strictly lower A [..., BT, BT]."""
  eye = jnp.eye(A.shape[-1], dtype=A.dtype)
  return jax.scipy.linalg.solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True,
                                           unit_diagonal=True)


def apply(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size):
  del aligned_cu   # every chunk is computed (its tail ones give zeros and a one-hot Ainv)
  f32 = jnp.float32
  q, k, v, beta, gi, gf = (to_chunks(x.astype(f32), chunk_size) for x in (q, k, v, beta, gc_int, gc_frac))
  Akk, Aqk = chunk_matrices(q, k, beta, gi, gf, scale)
  Ainv = unit_lower_inverse(Akk)
  e_start, e_last = chunk_decays(gi, gf)
  w = jnp.einsum("chij,cjhk->cihk", Ainv, beta[..., None] * k * e_start, precision=HI)
  u = jnp.einsum("chij,cjhv->cihv", Ainv, beta[..., None] * v, precision=HI)
  qg = q * e_start
  kg = k * e_last
  rows = lambda A: from_chunks(jnp.moveaxis(A, 1, 2))   # [NTa, HV, BT, BT] -> [1, Ta, HV, BT]
  return Out(rows(Akk), rows(Aqk), rows(Ainv), *(from_chunks(x) for x in (w, u, qg, kg)))
