"""The padding layer: align every sequence to a multiple of BT, neutralise padding gates, unalign.

Public functions (docs/api.md): `align`, `neutralize_gate`, `unalign`; plus the layout helpers the
pipeline and the tools use (`Layout`, `chunk_table`, segment_ids conversion).
"""
from __future__ import annotations

import jax.numpy as jnp

from kda.padding.layout import (ChunkRows, ChunkTable, Layout, chunk_rows, align_index, align_with, aligned_cu_seqlens,
                                gap_pieces, packed_gaps, search_left, search_right,
                                aligned_length, chunk_table, layout_from_cu_seqlens, make_layout,
                                packed_owned_mask, unalign_index, unalign_with, valid_mask)
from kda.padding.capacity import pad_to_capacity
from kda.padding.segments import (count_segments, segment_ids_to_cu_seqlens, segment_ids_to_seqs,
                                  seqs_to_cu_seqlens)

NEUTRAL_GATE = -1e4


def align(tensors, cu_seqlens, chunk_size):
  """tensors: [1, T, ...] arrays -> (same structure at [1, Ta, ...], aligned_cu_seqlens [N+1]).

  Sequence n moves to [aligned_cu[n], aligned_cu[n] + len_n); every other position is 0. Tokens
  past cu_seqlens[-1] are never read. Ta is `aligned_length`: round_up(T + N * (BT - 1), BT) for a
  traced cu_seqlens, the exact aligned length rounded up to a bucket for a concrete one.
  """
  tensors = list(tensors)
  layout = layout_from_cu_seqlens(cu_seqlens, tensors[0].shape[1], chunk_size)
  return [align_with(layout, x) for x in tensors], layout.aligned_cu


def neutralize_gate(g, valid_mask):
  """Raw gates g [B, T, HV, K] with positions where valid_mask [B, T] is False set to -1e4,
  so both gate activations give ~0 there (softplus(-1e4 + b) and sigmoid(-large) vanish)."""
  return jnp.where(valid_mask[:, :, None, None], g, jnp.asarray(NEUTRAL_GATE, g.dtype))


def unalign(x, cu_seqlens, aligned_cu_seqlens, T):
  """x [1, Ta, ...] aligned -> [1, T, ...] packed. Padding slots are dropped; tokens past
  cu_seqlens[-1] get exact zeros (their index is one past the end, gathered with fill)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  acu = jnp.asarray(aligned_cu_seqlens, jnp.int32)
  Ta = x.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)
  n = jnp.clip(search_right(cu, t) - 1, 0, max(cu.shape[0] - 2, 0))
  idx = jnp.where(t < cu[-1], acu[n] + t - cu[n], Ta)
  return jnp.take(x, idx, axis=1, mode="fill", fill_value=0)


__all__ = [
    "align", "neutralize_gate", "unalign", "pad_to_capacity", "NEUTRAL_GATE", "Layout", "ChunkTable", "chunk_table", "ChunkRows", "chunk_rows",
    "make_layout", "layout_from_cu_seqlens", "aligned_cu_seqlens", "aligned_length", "valid_mask",
    "align_index", "unalign_index", "align_with", "unalign_with", "packed_owned_mask",
    "count_segments", "segment_ids_to_seqs", "segment_ids_to_cu_seqlens", "seqs_to_cu_seqlens", "packed_gaps", "gap_pieces",
]
