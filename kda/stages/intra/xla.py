"""intra: the XLA implementation (fast and lean on a CPU, any backend); the math is in kda.stages.intra.

The reference forms exp(gc_i - gc_j) for every pair of a chunk ([NTa, BT, BT, HV, K], 1 GiB per copy
at T = 8192, HV = 4, K = 128). Here every strict pair is a product of two factors, each <= 1, and
the chunk's scores become small matmuls. Halve the chunk recursively: at level s (s = BT/2, ...,
2, 1) each block of 2s rows splits into a first half (columns j) and a second half (rows i), and
with r = gc at the first row of the second half

    exp(gc_i - gc_j) = exp(gc_i - r) * exp(r - gc_j)          j in the first half, i in the second

Both exponents are <= 0 (gates are non-positive, gc falls along the chunk), so no factor overflows,
and one underflows only where the decay itself is below it. Every strict pair (j < i) lies in
exactly one such block, so with F = exp(gc_i - r) on the rows and C = exp(r - gc_j) on the columns

    Akk[i, j] = beta_i * ((k F)_i . (k C)_j),    Aqk[i, j] = scale * ((q F)_i . (k C)_j)

one [2s, K] x [K, s] matmul per block (k and q stacked, so one matmul per level for both), and
Aqk's diagonal is scale * q_i . k_i (its decay is 1). Levels together: about the MACs of one dense [BT, BT, K] product
and 2 log2(BT) exps per element of k: no pairwise tensor, nothing larger than the inputs (the
16-row sub-blocks of the kernels, with a pairwise masked exp on their diagonal blocks, cost a
[.., 16, 16, K] tensor per sub-block: several times this path's time on a CPU). Every exponent is
formed from the two parts of gc with gate.exponent, so strong gates (-1e4, the -128 floor) keep
float32 accuracy.

The levels' blocks are gathered into the [BT, BT] matrices in one step (`block_map`: a static map
from each lower-triangle entry to its level's block), and each level's inputs pass through an
optimization barrier with the previous level's result, so that XLA neither fuses across levels nor
forms every level's operands up front (a CPU pays for every fresh MiB of temporaries in page
faults; fewer, larger steps also compile faster). Arrays stay in the aligned layout [NTa, BT, HV, D]
(XLA lays out each matmul's operands as it forms them; explicit head-major copies measured slower).
Ainv by a batched triangular solve; w, u, qg, kg as in the reference. Float32 throughout, as the
reference.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from kda._xla import compiled
from kda.stages.gate import exponent
from kda.stages.intra import Out, from_chunks, to_chunks
from kda.stages.intra.reference import unit_lower_inverse

HI = lax.Precision.HIGHEST


def levels(chunk_size):
  """The half-block sizes s of the recursive halving: BT/2, ..., 2, 1."""
  out, s = [], chunk_size // 2
  while s >= 1:
    out.append(s)
    s //= 2
  return tuple(out)


def halves(x, s):
  """Chunked [NTa, BT, ...] -> [NTa, BT/(2s), 2, s, ...]: level s's blocks of 2s rows, by half."""
  return x.reshape((x.shape[0], x.shape[1] // (2 * s), 2, s) + x.shape[2:])


def first(x, s):
  """Chunked [NTa, BT, ...] -> the rows of level s's first halves [NTa, BT/(2s), s, ...]."""
  return halves(x, s)[:, :, 0]


def second(x, s):
  """Chunked [NTa, BT, ...] -> the rows of level s's second halves [NTa, BT/(2s), s, ...]."""
  return halves(x, s)[:, :, 1]


def factors(gi, gf, s):
  """Level s's factors from gc's chunked parts [NTa, BT, HV, K] -> (F, C), each
  [NTa, BT/(2s), s, HV, K]: F = exp(gc_i - r) on the second halves' rows, C = exp(r - gc_j) on the
  first halves' rows, r = gc at the second half's first row. Both exponents are <= 0."""
  hi, hf = halves(gi, s), halves(gf, s)
  ri, rf = hi[:, :, 1, :1], hf[:, :, 1, :1]
  F = jnp.exp(exponent(hi[:, :, 1], hf[:, :, 1], ri, rf))
  C = jnp.exp(exponent(ri, rf, hi[:, :, 0], hf[:, :, 0]))
  return F, C


@functools.lru_cache(maxsize=None)
def block_map(chunk_size, heads, stacked):
  """The levels' blocks of `stacked` [BT, BT] matrices per head, as one chunk's flat vector: level s
  (in levels() order) holds its blocks in the order [BT/(2s), HV, s(i), X, s(j)] (what
  jnp.einsum("cmihxk,cmjhk->cmhixj") returns), then the diagonal [HV, X, BT], then one zero slot.
  -> (index [HV * X * BT * BT]: the slot of each matrix entry (h, x, i, j), the zero slot where
  j > i; source [slots - 1]: the matrix entry of each slot but the zero one; offsets {s: first slot})."""
  BT, H, X = chunk_size, heads, stacked
  offsets, coords, at = {}, [], 0
  for s in levels(BT):
    m, h, ii, x, jj = np.meshgrid(np.arange(BT // (2 * s)), np.arange(H), np.arange(s), np.arange(X),
                                  np.arange(s), indexing="ij")
    offsets[s] = at
    coords.append((h, x, m * 2 * s + s + ii, m * 2 * s + jj))
    at += m.size
  h, x, i = np.meshgrid(np.arange(H), np.arange(X), np.arange(BT), indexing="ij")
  coords.append((h, x, i, i))
  h, x, i, j = (np.concatenate([c[n].reshape(-1) for c in coords]) for n in range(4))
  source = ((h * X + x) * BT + i) * BT + j
  index = np.full(H * X * BT * BT, source.size, np.int64)    # the zero slot
  index[source] = np.arange(source.size)
  return index.astype(np.int32), source.astype(np.int32), offsets


def sequential(carry, done):
  """carry, passed through an optimization barrier with `done`: what reads the result is neither
  fused with what made `done` nor formed before the barrier is reached."""
  return lax.optimization_barrier((carry, done))[0]


def scores(q, k, gi, gf):
  """Chunked q, k, gc parts [NTa, BT, HV, K] -> S [NTa, HV, 2, BT, BT] with the decays: S[:, :, 0] =
  k k^T (strictly lower), S[:, :, 1] = q k^T (lower, with the diagonal q_i . k_i); no beta, no scale."""
  NTa, BT, HV = k.shape[:3]
  X = jnp.stack([k, q], -2)                                  # [NTa, BT, HV, 2, K]
  parts = []
  for s in levels(BT):
    if parts:
      X, k, gi, gf = sequential((X, k, gi, gf), parts[-1])
    F, C = factors(gi, gf, s)                                # [NTa, nb, s, HV, K]
    XF = second(X, s) * F[..., None, :]
    kC = first(k, s) * C
    parts.append(jnp.einsum("cmihxk,cmjhk->cmhixj", XF, kC, precision=HI).reshape(NTa, -1))
  diag = jnp.einsum("cihk,cihk->chi", q, k, precision=HI)
  parts += [jnp.stack([jnp.zeros_like(diag), diag], 2).reshape(NTa, -1), jnp.zeros((NTa, 1), jnp.float32)]
  index, _, _ = block_map(BT, HV, 2)
  return jnp.take(jnp.concatenate(parts, -1), index, axis=-1).reshape(NTa, HV, 2, BT, BT)


def blocks(M):
  """The inverse of `scores`' assembly off the diagonal: M [NTa, HV, X, BT, BT] -> {s: level s's
  blocks [NTa, BT/(2s), HV, X, s(i), s(j)]} (second-half rows x first-half columns)."""
  NTa, HV, X, BT = M.shape[:4]
  _, source, offsets = block_map(BT, HV, X)
  flat = jnp.take(M.reshape(NTa, -1), source, axis=-1)
  out = {}
  for s in levels(BT):
    n = BT * s // 2 * HV * X
    out[s] = flat[:, offsets[s]:offsets[s] + n].reshape(NTa, BT // (2 * s), HV, s, X, s).swapaxes(3, 4)
  return out


@compiled
def apply(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size):
  del aligned_cu   # every chunk is computed (its tail ones give zeros and a one-hot Ainv)
  f32 = jnp.float32
  q, k, v, beta, gi, gf = (to_chunks(x.astype(f32), chunk_size) for x in (q, k, v, beta, gc_int, gc_frac))
  S = scores(q, k, gi, gf)
  # the rest once the scores exist (XLA would form its operands first and hold them)
  q, k, v, beta, gi, gf = sequential((q, k, v, beta, gi, gf), S)
  Akk = jnp.moveaxis(beta, 1, 2)[..., None] * S[:, :, 0]    # [NTa, HV, BT, BT], beta_i on row i
  Aqk = scale * S[:, :, 1]
  e_start = jnp.exp(exponent(gi, gf))
  qg = q * e_start
  kg = k * jnp.exp(exponent(gi[:, -1:], gf[:, -1:], gi, gf))
  Ainv = unit_lower_inverse(Akk)
  b = beta[..., None]
  w = jnp.einsum("chij,cjhk->cihk", Ainv, b * k * e_start, precision=HI)
  u = jnp.einsum("chij,cjhv->cihv", Ainv, b * v, precision=HI)
  rows = lambda A: from_chunks(jnp.moveaxis(A, 1, 2))        # [NTa, HV, BT, BT] -> [1, Ta, HV, BT]
  out = (rows(Akk), rows(Aqk), rows(Ainv), *(from_chunks(x) for x in (w, u, qg, kg)))
  return Out(*lax.optimization_barrier(out))                  # formed here, not inside a consumer
