"""Many short sequences as fewer, longer pieces (the pipeline's segment_pieces).

Each piece starts at a sequence start and holds the sequences that start before the next piece's
start, chunked as one sequence, with a gate of -inf at each of their later starts (the resets). The
gate stage floors it to GATE_FLOOR, whose decay exp(-128) is exactly 0 in float32: no term crosses
a reset and the state entering a sequence is zero, as in the recurrence; the reset gate's gradient
is 0 (so is the true one: it only decays the zero initial state). The intra and bwd_intra kernels
take the resets as segment masks (`segment_rows`), so that a chunk holding one keeps their bounded
path. Fewer chunks (489 sequences of 1-128 tokens in 32768: a static bound of 528 chunks against 994
aligned ones) and half the memory.

Exact only where a piece may start from zero and drop its end: a zero initial state and an unused
final state, log-space gates (a built-in activation may not reach the floor), sequences that tile
the stream (cu_seqlens or fixed-length rows; segment_ids may leave gaps), and more sequences than
pieces (`takes`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kda import shapes
from kda.padding.layout import Layout, chunk_rows, make_layout, search_left


def count(HV: int, pieces: int, walks: int) -> int:
  """The pieces of a call with HV value heads: at least `walks` serial walks (pieces x heads), so
  that few heads do not serialise the state kernels."""
  return max(pieces, -(-walks // max(HV, 1)))


def takes(pieces: int, *, contiguous: bool, initial_state, output_final_state: bool, N: int,
          use_gate_in_kernel: bool) -> bool:
  """Whether a call's N sequences may run as `pieces` pieces (module docstring); pieces 0: never."""
  return (pieces > 0 and contiguous and N > pieces and initial_state is None and not output_final_state
          and not use_gate_in_kernel)


def segmented(layout: Layout, pieces: int):
  """layout -> (the layout of `pieces` sequences over the same tokens, the other sequence starts
  [N] int32 (T where a start is a piece's): the resets, where the gate is taken as -inf
  (`reset_gates`; the packed kernels take them as `segment_rows`). Piece j starts at the first
  sequence start at or after j * ceil(end / pieces) (end: the last sequence's end); pieces may be
  empty. Starts at T (empty sequences at the end) are dropped."""
  P = pieces
  starts, ends = layout.starts, layout.starts + layout.lens
  concrete = shapes.is_concrete(starts) and shapes.is_concrete(ends)
  xp = np if concrete else jnp
  starts, end = xp.asarray(starts, xp.int32), xp.asarray(ends[-1], xp.int32)
  step = (end + P - 1) // P
  queries = xp.arange(P, dtype=xp.int32) * step
  at = np.searchsorted(starts, queries, side="left") if concrete else search_left(starts, queries)
  first = xp.where(at < starts.shape[0], starts[xp.minimum(at, starts.shape[0] - 1)], end)
  first = xp.minimum(first, end).astype(xp.int32)
  lens = xp.diff(xp.concatenate([first, end.reshape(1)])).astype(xp.int32)
  reset = jnp.where(jnp.isin(jnp.asarray(starts), jnp.asarray(first)), layout.T, jnp.asarray(starts))
  return make_layout(first, lens, layout.T, layout.chunk_size), reset.astype(jnp.int32)


def at_reset(g):
  """The gate at a reset: -inf (the gate stage floors it to -128: no decay crosses it), but a NaN or
  +inf stays, so that kda.confine sees it. Selects only, so the gate kernels take it as it is."""
  inf = jnp.float32(jnp.inf)
  return jnp.where(g == g, jnp.where(g == inf, g, -inf), g)


def reset_gates(g, resets):
  """Packed g [1, T, HV, K] with `at_reset` at a segmented layout's resets (`segmented`): what the
  unpacked paths run on."""
  return g.at[0, resets].set(at_reset(g.at[0, resets].get(mode="fill", fill_value=0)), mode="drop")


def segment_rows(layout: Layout, resets) -> jax.Array:
  """[2, Ta] float32 per aligned row of a segmented layout (`resets`: segmented()'s second result):
  [0] n, the resets among its chunk's tokens up to it; [1] the chunk row where its segment starts
  (0 for the chunk's first segment). Rows past a chunk's tokens take its last token's values, the
  tail's are 0. The intra kernels mask their pairs to n_i == n_j (j >= start_i) and add 128 n to
  gc_int, which takes the resets' -128 steps out of their decays (exact integers)."""
  BT, T = layout.chunk_size, layout.T
  rows = chunk_rows(layout)
  ind = jnp.zeros((T + 1,), jnp.int32).at[resets].set(1, mode="drop")[:T]   # empty sequences repeat a start
  before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ind)])     # resets in [0, t)
  r = jnp.minimum(jnp.arange(BT, dtype=jnp.int32)[None], jnp.maximum(rows.count - 1, 0)[:, None])
  pos = rows.src[:, None] + r                                                  # [NTa, BT], < T
  live = (rows.count > 0)[:, None]
  n = jnp.where(live, before[pos + 1] - before[rows.src][:, None], 0)
  at = jnp.where(live & (ind[jnp.minimum(pos, T - 1)] > 0), r, 0)              # the row of a reset
  start = lax.cummax(at, axis=1)
  return jnp.stack([n.reshape(-1), start.reshape(-1)]).astype(jnp.float32)
