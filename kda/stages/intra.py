"""intra: everything inside one chunk of BT tokens, per value head.

    Akk[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(gc_i[c] - gc_j[c])    j < i
    Aqk[i, j] = scale  * sum_c q_i[c] k_j[c] exp(gc_i[c] - gc_j[c])    j <= i
    Ainv = (I + Akk)^-1                       unit lower triangular (forward substitution)
    w = Ainv @ (beta * k * exp(gc)),  u = Ainv @ (beta * v)             the WY representation
    qg = q * exp(gc),  kg = k * exp(gc_last - gc)

In:  q, k [1, Ta, HV, K] (q/k already mapped to value heads), v [1, Ta, HV, V], beta [1, Ta, HV],
     gc [1, Ta, HV, K] float32.
Out: Akk, Aqk, Ainv [1, Ta, HV, BT] (row i of chunk c at token c*BT + i), w, qg, kg [1, Ta, HV, K],
     u [1, Ta, HV, V]; all float32.
Numerics: the exponent difference gc_i - gc_j is formed and masked (j <= i, so <= 0) before exp, so
no factor overflows whatever the gates. Padding: q = k = v = beta = 0 there, so padding rows and
columns of Akk and Aqk are 0, Ainv's padding rows are one-hot, and u = w = qg = kg = 0.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.base import Stage

NAME = "intra"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  Akk: jax.Array   # [1, Ta, HV, BT] float32, strictly lower, beta_i folded in
  Aqk: jax.Array   # [1, Ta, HV, BT] float32, lower with diagonal, scale folded in
  Ainv: jax.Array  # [1, Ta, HV, BT] float32, (I + Akk)^-1
  w: jax.Array     # [1, Ta, HV, K] float32
  u: jax.Array     # [1, Ta, HV, V] float32
  qg: jax.Array    # [1, Ta, HV, K] float32
  kg: jax.Array    # [1, Ta, HV, K] float32


def to_chunks(x, chunk_size):
  """[1, Ta, ...] -> [NTa, BT, ...]."""
  return x.reshape((x.shape[1] // chunk_size, chunk_size) + x.shape[2:])


def from_chunks(x):
  """[NTa, BT, ...] -> [1, Ta, ...]."""
  return x.reshape((1, x.shape[0] * x.shape[1]) + x.shape[2:])


def pair_decay(gc, strict):
  """exp(gc_i - gc_j) over the causal pairs of each chunk, 0 elsewhere: [NTa, BT(i), BT(j), HV, K].

  The difference is masked before exp, so it never overflows."""
  BT = gc.shape[1]
  i = jnp.arange(BT)[:, None]
  j = jnp.arange(BT)[None, :]
  mask = (j < i) if strict else (j <= i)
  d = gc[:, :, None] - gc[:, None, :]
  return jnp.where(mask[None, :, :, None, None], jnp.exp(jnp.where(mask[None, :, :, None, None], d, 0.0)), 0.0)


def chunk_matrices(q, k, beta, gc, scale):
  """Chunked inputs (f32) -> Akk, Aqk as [NTa, HV, BT, BT]."""
  Akk = jnp.einsum("cihk,cjhk,cijhk->chij", k, k, pair_decay(gc, True), precision=HI)
  Akk = Akk * jnp.moveaxis(beta, 1, 2)[..., None]
  Aqk = scale * jnp.einsum("cihk,cjhk,cijhk->chij", q, k, pair_decay(gc, False), precision=HI)
  return Akk, Aqk


def unit_lower_inverse(A):
  """(I + A)^-1 for strictly lower A [..., BT, BT]."""
  eye = jnp.eye(A.shape[-1], dtype=A.dtype)
  return jax.scipy.linalg.solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True,
                                           unit_diagonal=True)


def reference(q, k, v, beta, gc, *, scale, chunk_size):
  f32 = jnp.float32
  q, k, v, beta, gc = (to_chunks(x.astype(f32), chunk_size) for x in (q, k, v, beta, gc))
  Akk, Aqk = chunk_matrices(q, k, beta, gc, scale)
  Ainv = unit_lower_inverse(Akk)
  w = jnp.einsum("chij,cjhk->cihk", Ainv, beta[..., None] * k * jnp.exp(gc), precision=HI)
  u = jnp.einsum("chij,cjhv->cihv", Ainv, beta[..., None] * v, precision=HI)
  qg = q * jnp.exp(gc)
  kg = k * jnp.exp(gc[:, -1:] - gc)
  rows = lambda A: from_chunks(jnp.moveaxis(A, 1, 2))   # [NTa, HV, BT, BT] -> [1, Ta, HV, BT]
  return Out(rows(Akk), rows(Aqk), rows(Ainv), *(from_chunks(x) for x in (w, u, qg, kg)))


STAGE = Stage(NAME, reference=reference)
