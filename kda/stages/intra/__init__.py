"""intra: everything inside one chunk of BT tokens, per value head.

    Akk[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(gc_i[c] - gc_j[c])    j < i
    Aqk[i, j] = scale  * sum_c q_i[c] k_j[c] exp(gc_i[c] - gc_j[c])    j <= i
    Ainv = (I + Akk)^-1                       unit lower triangular (forward substitution)
    w = Ainv @ (beta * k * exp(gc)),  u = Ainv @ (beta * v)             the WY representation
    qg = q * exp(gc),  kg = k * exp(gc_last - gc)

In:  q, k [1, Ta, HV, K] (q/k already mapped to value heads), v [1, Ta, HV, V], beta [1, Ta, HV],
     gc_int, gc_frac [1, Ta, HV, K] float32 (the gate stage's two parts of gc; every exponent below
     is formed from them with gate.exponent), aligned_cu [N+1] int32 or None (chunks at or past
     aligned_cu[-1] belong to no sequence: a kernel may only zero-fill them).
Out: Akk, Aqk, Ainv [1, Ta, HV, BT] (row i of chunk c at token c*BT + i), w, qg, kg [1, Ta, HV, K],
     u [1, Ta, HV, V]; float32 from the reference, bf16 from the kernels when q/k/v are bf16 (the
     dtype policy; the fields, not their dtypes, are the interface).
Numerics: the exponent difference gc_i - gc_j is formed and masked (j <= i, so <= 0) before exp, so
no factor overflows whatever the gates, and from the two parts of gc, so it keeps float32 accuracy
however large they are. Padding: q = k = v = beta = 0 there, so padding rows and
columns of Akk and Aqk are 0, Ainv's padding rows are one-hot, and u = w = qg = kg = 0.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.base import Stage
from kda.stages.gate import exponent

NAME = "intra"


class Out(NamedTuple):
  Akk: jax.Array   # [1, Ta, HV, BT] strictly lower, beta_i folded in
  Aqk: jax.Array   # [1, Ta, HV, BT] lower with diagonal, scale folded in
  Ainv: jax.Array  # [1, Ta, HV, BT] (I + Akk)^-1
  w: jax.Array     # [1, Ta, HV, K]
  u: jax.Array     # [1, Ta, HV, V]
  qg: jax.Array    # [1, Ta, HV, K]
  kg: jax.Array    # [1, Ta, HV, K]


def to_chunks(x, chunk_size):
  """[1, Ta, ...] -> [NTa, BT, ...]."""
  return x.reshape((x.shape[1] // chunk_size, chunk_size) + x.shape[2:])


def from_chunks(x):
  """[NTa, BT, ...] -> [1, Ta, ...]."""
  return x.reshape((1, x.shape[0] * x.shape[1]) + x.shape[2:])


def pair_decay(gi, gf, strict):
  """exp(gc_i - gc_j) over the causal pairs of each chunk, 0 elsewhere: [NTa, BT(i), BT(j), HV, K],
  from the chunked parts gi, gf [NTa, BT, HV, K] of gc.

  The difference is masked before exp, so it never overflows."""
  BT = gi.shape[1]
  i = jnp.arange(BT)[:, None]
  j = jnp.arange(BT)[None, :]
  mask = ((j < i) if strict else (j <= i))[None, :, :, None, None]
  d = exponent(gi[:, :, None], gf[:, :, None], gi[:, None, :], gf[:, None, :])
  return jnp.where(mask, jnp.exp(jnp.where(mask, d, 0.0)), 0.0)


# elements of the pair tensors [n, BT, BT, HV, K] the references form at once (512 MiB in float32)
PAIR_BLOCK = 2 ** 27


def over_chunk_blocks(f, gi, *xs, limit=PAIR_BLOCK):
  """f(gi, *xs) for a function f of chunked arrays ([NTa, ...] each, chunks independent; gi
  [NTa, BT, HV, K] sizes the pair tensors), evaluated over blocks of chunks whose pair tensors
  (`pair_decay`) hold at most `limit` elements: one block where every chunk fits (f itself), else
  lax.map over equal blocks, the chunks padded with zeros to a multiple of the block (a remainder
  block would be a second copy of f, concatenated: twice the compile). Memory and array indices
  then stay bounded however many chunks."""
  xs = (gi,) + xs
  NTa, BT, HV, K = gi.shape
  block = max(1, limit // (BT * BT * HV * K))
  if NTa <= block:
    return f(*xs)
  blocks = -(-NTa // block)
  size = -(-NTa // blocks)
  pad = blocks * size - NTa
  xs = tuple(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in xs)
  one = lambda ys: jax.tree.map(lambda y: y[0], f(*(y[None] for y in ys)))
  return jax.tree.map(lambda y: y[:NTa], lax.map(one, xs, batch_size=size))


def chunk_decays(gi, gf):
  """Chunked parts of gc -> (exp(gc), exp(gc_last - gc)), each [NTa, BT, HV, K]."""
  return jnp.exp(exponent(gi, gf)), jnp.exp(exponent(gi[:, -1:], gf[:, -1:], gi, gf))


from kda.stages.intra import mosaic_gpu, mosaic_tpu, pallas, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, pallas=pallas, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
