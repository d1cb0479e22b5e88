"""The aligned layout: every sequence starts on a multiple of BT, gaps are zeros.

A packed buffer of T tokens holds N sequences, sequence n at tokens [starts[n], starts[n] + lens[n])
(contiguous for cu_seqlens; with segment_ids there may be padding tokens between sequences). The
aligned buffer puts sequence n at [aligned_cu[n], aligned_cu[n] + lens[n]), aligned_cu[n] a multiple
of BT. Its length Ta (`aligned_length`) is static: for traced lengths the bound
round_up(T + N * (BT - 1), BT), enough for any lengths; for concrete ones the exact aligned length
rounded up to a bucket (at most 1/8 more, so few shapes compile). Positions
of the aligned buffer that hold no real token (a sequence's last partial chunk, and the tail after
aligned_cu[-1]) are padding: zeros after `align`.

Everything here is jnp on possibly traced lengths, with static shapes, so under jit a new length
profile never recompiles. Gathers use index = size (one past the end) with mode="fill": a slot that owns no token
reads an explicit zero, never position 0 or a neighbour.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda import shapes


class Layout(NamedTuple):
  starts: jax.Array      # [N] int32, first packed token of each sequence
  lens: jax.Array        # [N] int32
  aligned_cu: jax.Array  # [N+1] int32, multiples of BT
  T: int                 # packed length (static)
  Ta: int                # aligned length (static)
  chunk_size: int        # BT (static)

  @property
  def N(self) -> int:
    return self.lens.shape[0]

  @property
  def NTa(self) -> int:
    return self.Ta // self.chunk_size


def aligned_length(T: int, N: int, chunk_size: int, lens=None) -> int:
  """The aligned buffer's length Ta (a multiple of BT, at least BT).

  Without concrete `lens` (traced under jit): the static bound T + N * (BT - 1), enough for any
  lengths, so a new length profile never recompiles. With concrete `lens`: the exact aligned length
  sum(round_up(len, BT)) rounded up to a bucket (`bucket`), so that few distinct shapes compile.
  """
  bound = shapes.round_up(T + N * (chunk_size - 1), chunk_size) if N else shapes.round_up(max(T, 1), chunk_size)
  if lens is None or not shapes.is_concrete(lens):
    return bound
  lens = np.asarray(lens, np.int64)
  exact = int(np.sum((lens + chunk_size - 1) // chunk_size)) * chunk_size
  return bucket(max(exact, chunk_size), chunk_size)


def bucket(n: int, chunk_size: int) -> int:
  """n rounded up to a multiple of max(BT, 2**(bit_length(n) - 4)): at most 1/8 more than n, and 8
  sizes per doubling of n."""
  q = max(chunk_size, 1 << max(int(n).bit_length() - 4, 0))
  return shapes.round_up(n, q)


def aligned_cu_seqlens(lens, chunk_size):
  padded = (lens + chunk_size - 1) // chunk_size * chunk_size
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded).astype(jnp.int32)])


def make_layout(starts, lens, T: int, chunk_size: int) -> Layout:
  Ta = aligned_length(T, len(lens), chunk_size, lens)
  starts = jnp.asarray(starts, jnp.int32)
  lens = jnp.asarray(lens, jnp.int32)
  return Layout(starts, lens, aligned_cu_seqlens(lens, chunk_size), T, Ta, chunk_size)


def layout_from_cu_seqlens(cu_seqlens, T: int, chunk_size: int) -> Layout:
  if shapes.is_concrete(cu_seqlens):      # lengths known now (also inside a trace): the exact Ta
    cu = np.asarray(cu_seqlens).astype(np.int32)
    return make_layout(cu[:-1], np.diff(cu), T, chunk_size)
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  return make_layout(cu[:-1], cu[1:] - cu[:-1], T, chunk_size)


def search_right(sorted_values, queries):
  """jnp.searchsorted(sorted_values, queries, side="right") as an unrolled binary search: no while
  loop (on a GPU a while loop is a chain of tiny launches per iteration, on the critical path of
  every call), the same integers."""
  return jnp.searchsorted(sorted_values, queries, side="right", method="scan_unrolled")


def search_left(sorted_values, queries):
  """jnp.searchsorted(sorted_values, queries, side="left"), unrolled as `search_right`."""
  return jnp.searchsorted(sorted_values, queries, side="left", method="scan_unrolled")


def _aligned_positions(layout: Layout):
  """For every aligned position p: (sequence n, offset j in it, is a real token)."""
  p = jnp.arange(layout.Ta, dtype=jnp.int32)
  N = layout.N
  n = jnp.clip(search_right(layout.aligned_cu, p) - 1, 0, max(N - 1, 0))
  if N == 0:
    return n, p, jnp.zeros_like(p, bool)
  j = p - layout.aligned_cu[n]
  real = (p < layout.aligned_cu[-1]) & (j < layout.lens[n])
  return n, j, real


def valid_mask(layout: Layout):
  """[Ta] bool: True where the aligned position holds a real token."""
  return _aligned_positions(layout)[2]


def align_index(layout: Layout):
  """[Ta] int32: packed source of each aligned position; T (out of range: reads 0) for padding."""
  n, j, real = _aligned_positions(layout)
  return jnp.where(real, layout.starts[n] + j if layout.N else j, layout.T).astype(jnp.int32)


def unalign_index(layout: Layout):
  """[T] int32: aligned source of each packed token; Ta (out of range: reads 0) for tokens of no sequence."""
  src = align_index(layout)
  dest = jnp.arange(layout.Ta, dtype=jnp.int32)
  idx = jnp.full((layout.T,), layout.Ta, jnp.int32)
  return idx.at[src].set(dest, mode="drop")   # padding slots have src == T: dropped


@jax.custom_vjp
def _moved(x, index, inverse):
  """x[:, index] (0 where index is out of range). `index` is injective on its in-range entries and
  `inverse` its inverse (out of range where no entry points), so the transpose is the gather
  ct[:, inverse], not the scatter-add autodiff would make (atomics over unknown duplicates)."""
  return jnp.take(x, index, axis=1, mode="fill", fill_value=0)


def _moved_fwd(x, index, inverse):
  return _moved(x, index, inverse), (index, inverse)


def _moved_bwd(res, ct):
  index, inverse = res
  return jnp.take(ct, inverse, axis=1, mode="fill", fill_value=0), None, None


_moved.defvjp(_moved_fwd, _moved_bwd)


def align_with(layout: Layout, x):
  """x [1, T, ...] -> [1, Ta, ...] with zeros at padding positions (its transpose is unalign_with)."""
  return _moved(x, align_index(layout), unalign_index(layout))


def unalign_with(layout: Layout, x):
  """x [1, Ta, ...] -> [1, T, ...]; tokens of no sequence get exact zeros (transpose: align_with)."""
  return _moved(x, unalign_index(layout), align_index(layout))


def packed_owned_mask(layout: Layout):
  """[T] bool: True where the packed token belongs to a sequence."""
  return unalign_index(layout) < layout.Ta


class ChunkTable(NamedTuple):
  seq: jax.Array     # [NTa] int32, sequence of each aligned chunk, -1 for the tail after aligned_cu[-1]
  local: jax.Array   # [NTa] int32, index of the chunk inside its sequence (0 for the tail)
  first: jax.Array   # [NTa] bool, first chunk of its sequence
  last: jax.Array    # [NTa] bool, last chunk of its sequence


class ChunkRows(NamedTuple):
  """Where each aligned chunk's tokens sit in the packed buffer: aligned row c * BT + r holds packed
  token src[c] + r for r < count[c]; rows r >= count[c] are padding. Kernels that read packed
  inputs (or write packed outputs) through it fold align / unalign into their loads and stores."""
  src: jax.Array     # [NTa] int32, packed row of the chunk's first row (0 for the tail)
  count: jax.Array   # [NTa] int32, real tokens of the chunk, in [0, BT] (0 for the tail)


def chunk_rows(layout: Layout) -> ChunkRows:
  BT = layout.chunk_size
  table = chunk_table(layout.aligned_cu, layout.NTa, BT)
  n = jnp.maximum(table.seq, 0)
  owned = table.seq >= 0
  if layout.N == 0:
    zero = jnp.zeros((layout.NTa,), jnp.int32)
    return ChunkRows(zero, zero)
  offset = table.local * BT
  src = jnp.where(owned, layout.starts[n] + offset, 0).astype(jnp.int32)
  count = jnp.where(owned, jnp.clip(layout.lens[n] - offset, 0, BT), 0).astype(jnp.int32)
  return ChunkRows(src, count)


def chunk_table(aligned_cu, NTa: int, chunk_size: int) -> ChunkTable:
  start = jnp.arange(NTa, dtype=jnp.int32) * chunk_size
  N = aligned_cu.shape[0] - 1
  n = jnp.clip(search_right(aligned_cu, start) - 1, 0, max(N - 1, 0))
  owned = start < aligned_cu[-1]
  seq = jnp.where(owned, n, -1).astype(jnp.int32)
  local = jnp.where(owned, (start - aligned_cu[n]) // chunk_size, 0).astype(jnp.int32)
  first = owned & (local == 0)
  last = owned & (start + chunk_size == aligned_cu[jnp.minimum(n + 1, N)])
  return ChunkTable(seq, local, first, last)


def packed_gaps(rows: ChunkRows, aligned_cu, T: int, chunk_size: int):
  """(start, end, lo, hi) int32: each sequence's packed rows [start, end) ([N] each; T, T for an
  empty one) and the packed gaps [lo, hi) ([N + 1] each) that no sequence owns: gap k is the range
  before the k-th sequence in packed order and gap N the range after the last, so gaps and
  sequences tile [0, T). Gathered from rows at each sequence's first and last chunk (a sequence's
  chunks are consecutive in the packed buffer); N-sized XLA ops only."""
  BT = chunk_size
  NTa = rows.src.shape[0]
  aligned_cu = jnp.asarray(aligned_cu, jnp.int32)
  c0, c1 = aligned_cu[:-1] // BT, aligned_cu[1:] // BT
  has = c1 > c0
  first, last = jnp.clip(c0, 0, NTa - 1), jnp.clip(c1 - 1, 0, NTa - 1)
  start = jnp.where(has, rows.src[first], T).astype(jnp.int32)
  end = jnp.where(has, rows.src[last] + rows.count[last], T).astype(jnp.int32)
  by = jnp.argsort(start, stable=True)
  s = jnp.concatenate([start[by], jnp.full((1,), T, jnp.int32)])
  e = jnp.concatenate([end[by], jnp.full((1,), T, jnp.int32)])
  lo = jnp.concatenate([jnp.zeros((1,), jnp.int32), jax.lax.cummax(e[:-1])])   # the owned end before
  hi = jnp.maximum(s, lo)
  return start, end, lo, hi


def gap_pieces(rows: ChunkRows, aligned_cu, T: int, chunk_size: int):
  """[2, P] int32 (first row, row count <= BT) of the pieces of at most BT rows tiling the packed
  gaps (`packed_gaps`), P = cdiv(T, BT) + N + 1 (enough for any lengths), unused pieces of count 0.
  Kernels writing a packed output zero these rows (program c takes pieces c, c + programs, ...),
  so tokens of no sequence get exact zeros without a pass over the output."""
  BT = chunk_size
  N = aligned_cu.shape[0] - 1
  P = -(-T // BT) + N + 1
  _, _, lo, hi = packed_gaps(rows, aligned_cu, T, BT)
  n = (hi - lo + BT - 1) // BT                                   # pieces of each gap
  cum = jnp.cumsum(n).astype(jnp.int32)
  p = jnp.arange(P, dtype=jnp.int32)
  gap = jnp.clip(search_right(cum, p), 0, N)
  first = lo[gap] + (p - (cum[gap] - n[gap])) * BT
  count = jnp.where(p < cum[-1], jnp.clip(hi[gap] - first, 0, BT), 0)
  return jnp.stack([jnp.where(count > 0, first, 0), count]).astype(jnp.int32)
