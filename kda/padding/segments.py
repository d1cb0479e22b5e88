"""segment_ids (MaxText convention) -> sequence starts and lengths in the packed buffer.

segment_ids [B, T] int: id > 0 names the sequence of a token, 0 marks padding. Each maximal run of
equal positive ids inside one row is one sequence; runs never cross rows. Sequences are numbered row
by row, left to right. The rows are packed into one row of B * T tokens.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np



def _run_starts(segment_ids):
  seg = jnp.asarray(segment_ids)
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=0)
  return ((seg > 0) & (seg != prev)).reshape(-1)   # a row's first column has prev == 0


def count_segments(segment_ids) -> int:
  """Number of sequences in a concrete segment_ids (numpy, so it also works while tracing a function
  that closes over concrete ids)."""
  seg = np.asarray(segment_ids)
  prev = np.pad(seg[:, :-1], ((0, 0), (1, 0)))
  return int(((seg > 0) & (seg != prev)).sum())


def segment_ids_to_seqs(segment_ids, num_segments: int):
  """-> (starts [N], lens [N]) int32 in the packed [B*T] buffer, N = num_segments (static).

  Slots past the number of runs are empty sequences (start at B*T, length 0); runs past N are
  dropped (the API checks that when segment_ids is concrete).
  """
  seg = jnp.asarray(segment_ids)
  BT_total = seg.shape[0] * seg.shape[1]
  is_start = _run_starts(seg)
  run = jnp.cumsum(is_start.astype(jnp.int32)) - 1            # run index of every token (after its start)
  owned = seg.reshape(-1) > 0
  tok = jnp.arange(BT_total, dtype=jnp.int32)
  slot = jnp.where(is_start, run, num_segments)              # out of range -> dropped
  starts = jnp.full((num_segments,), BT_total, jnp.int32).at[slot].set(tok, mode="drop")
  member = jnp.where(owned, run, num_segments)
  lens = jnp.zeros((num_segments,), jnp.int32).at[member].add(1, mode="drop")
  return starts, lens


def seqs_to_cu_seqlens(lens):
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens).astype(jnp.int32)])


def segment_ids_to_cu_seqlens(segment_ids, num_segments: int | None = None):
  """cu_seqlens of the sequences of segment_ids once their padding tokens are squeezed out."""
  if num_segments is None:
    num_segments = count_segments(segment_ids)
  _, lens = segment_ids_to_seqs(segment_ids, num_segments)
  return seqs_to_cu_seqlens(lens)


__all__ = ["count_segments", "segment_ids_to_seqs", "segment_ids_to_cu_seqlens", "seqs_to_cu_seqlens"]
