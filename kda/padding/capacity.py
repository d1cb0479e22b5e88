"""Fixed capacities for packed batches: one compiled program for every batch of a training loop.

`chunk_kda` compiles once per distinct (T, N): every new number of sequences or total length
recompiles. Padding each batch to capacities fixed for the run (empty sequences at the end, a
tail of tokens that belong to no sequence) keeps both static; neither changes any real token's
result (an empty sequence owns no token, a token past cu_seqlens[-1] is never read).
"""
from __future__ import annotations

import jax
import numpy as np


def pad_to_capacity(arrays, cu_seqlens, *, max_sequences: int, max_tokens: int, initial_state=None):
  """-> (arrays, cu_seqlens, initial_state) padded to fixed capacities.

  arrays: a pytree (tuple, dict, ...) of packed token arrays [1, T, ...] -> [1, max_tokens, ...], the
    tail zero-filled. cu_seqlens [N+1] -> [max_sequences + 1], the last entry repeated (empty
    sequences). initial_state [N, HV, K, V] or None -> [max_sequences, HV, K, V], zeros appended.
  numpy inputs give numpy outputs (a host-side data pipeline), jax inputs jax outputs. The padded
  call's o[:, :T] and final_state[:N] are the unpadded call's.
  """
  is_np = isinstance(cu_seqlens, (np.ndarray, list, tuple))
  xp = np if is_np else jax.numpy
  cu = xp.asarray(cu_seqlens)
  if cu.ndim != 1 or cu.shape[0] < 1:
    raise ValueError(f"cu_seqlens must have shape [N+1], got {tuple(cu.shape)}")
  N = cu.shape[0] - 1
  if N > max_sequences:
    raise ValueError(f"max_sequences must be >= the batch's number of sequences N={N}, got {max_sequences}")
  leaves = jax.tree.leaves(arrays)
  for x in leaves:
    if x.ndim < 2 or x.shape[0] != 1:
      raise ValueError(f"arrays must be packed [1, T, ...], got shape {tuple(x.shape)}")
  T = leaves[0].shape[1] if leaves else 0
  if T > max_tokens:
    raise ValueError(f"max_tokens must be >= the batch's length T={T}, got {max_tokens}")
  pad_t = lambda x: xp.pad(x, [(0, 0), (0, max_tokens - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  arrays = jax.tree.map(pad_t, arrays)
  cu = xp.concatenate([cu, xp.full((max_sequences - N,), cu[-1], cu.dtype)])
  if initial_state is not None:
    h0 = xp.asarray(initial_state)
    if h0.ndim != 4 or h0.shape[0] != N:
      raise ValueError(f"initial_state must have shape [N={N}, HV, K, V], got {tuple(h0.shape)}")
    initial_state = xp.pad(h0, [(0, max_sequences - N), (0, 0), (0, 0), (0, 0)])
  return arrays, cu, initial_state
