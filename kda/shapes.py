"""Notation and the checks of user input.

    B   batch rows                     T   tokens per row (packed: all sequences)
    H   query/key heads                HV  value heads (HV % H == 0; value head j reads q/k head j // (HV // H))
    K   key head dim                   V   value head dim
    N   number of sequences            BT  chunk size (16, 32 or 64)
    Ta  aligned length (every sequence starts on a multiple of BT; a multiple of BT)
    NT  chunks per sequence            NTa chunks of the aligned buffer (Ta // BT)

Inside the pipeline every tensor is packed into one row: [1, Ta, HV, D].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CHUNK_SIZES = (16, 32, 64)


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_rank(name, x, rank, layout):
  if not hasattr(x, "shape") or x.ndim != rank:
    got = getattr(x, "shape", type(x).__name__)
    raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {got}")


def check_float(name, x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, float16, float64), got {x.dtype}")


def check_int(name, x):
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")


def check_shape(name, x, expected, layout):
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {tuple(expected)} ({layout}), got {tuple(x.shape)}")


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def check_fits_int32(name, x):
  """A concrete integer array's values fit int32 (checked before any cast, which would wrap them)."""
  if not is_concrete(x) or x.dtype == np.int32:
    return
  a = np.asarray(x)
  if a.size == 0:
    return
  lo, hi = int(a.min()), int(a.max())
  if lo < INT32_MIN or hi > INT32_MAX:
    bad = hi if hi > INT32_MAX else lo
    i = tuple(int(j) for j in np.unravel_index(int(np.argmax(a) if hi > INT32_MAX else np.argmin(a)), a.shape))
    where = ", ".join(str(j) for j in i)
    raise ValueError(f"{name} values must fit int32 [{INT32_MIN}, {INT32_MAX}], got {name}[{where}]={bad} "
                     f"(dtype {a.dtype})")


def check_head_sizes(name, x, axes):
  """Head counts and head dims are >= 1: axes maps an axis of x to its name (e.g. {2: "H", 3: "K"})."""
  for axis, what in axes.items():
    if x.shape[axis] < 1:
      raise ValueError(f"{name} must have {what} >= 1 (axis {axis}), got {what}={x.shape[axis]} "
                       f"in shape {tuple(x.shape)}")


def check_cu_seqlens_values(cu_seqlens, T):
  """Value checks of a concrete cu_seqlens (skipped under jit: see docs/api.md)."""
  if not is_concrete(cu_seqlens):
    return
  cu = np.asarray(cu_seqlens)
  if cu[0] != 0:
    raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={int(cu[0])}")
  d = np.diff(cu)
  if np.any(d < 0):
    i = int(np.argmax(d < 0))
    raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={int(cu[i])} > "
                     f"cu_seqlens[{i + 1}]={int(cu[i + 1])}")
  if cu[-1] > T:
    raise ValueError(f"cu_seqlens[-1] must be <= T={T}, got {int(cu[-1])}")
