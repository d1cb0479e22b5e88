"""chunk_kda(..., validate=True): run-time checks of values that may be traced.

Under `jax.jit` the values of cu_seqlens, segment_ids and the float inputs are unknown while the
call is traced, so the eager checks of kda.api cannot see them. Each check here is a reduction on
the device to a flag, the first offending flat index and the value(s) there; one
`jax.debug.callback` sends those scalars to the host, which raises a ValueError naming the argument,
the index and the value. jax surfaces it where it surfaces callback errors: a JaxRuntimeError at the
first blocking use of the result (its message holds the ValueError's). Works under jit and grad on
every backend; with validate=False (the default) nothing here is traced.

What is checked, in this order (the first failing check is the one reported):
  cu_seqlens  starts at 0, never decreases, ends <= T
  segment_ids >= 0, and at most N sequences (runs of equal positive ids)
  A_log, dt_bias, initial_state  finite
  q, k, v, beta  finite at tokens of a sequence (tokens of no sequence are never read)
  g           activated gate <= 0 at tokens of a sequence (-inf allowed; NaN and +inf are not)
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda.stages import gate


class _Check(NamedTuple):
  message: str   # format string over `where` (the index as "[i, j, ...]") and `vals`
  shape: tuple   # of the array the flat index points into
  bad: jax.Array   # bool scalar
  index: jax.Array  # int32 scalar: the first bad flat index
  vals: tuple      # scalars at that index


def _first(name, message, x, bad_mask, *extra):
  flat = bad_mask.reshape(-1)
  i = jnp.argmax(flat).astype(jnp.int32)
  vals = tuple(jnp.asarray(a).reshape(-1)[i] for a in (x,) + extra)
  return _Check(message.replace("{name}", name), tuple(x.shape), jnp.any(flat), i, vals)


def _raise(static, dynamic):
  for (message, shape), (bad, index, vals) in zip(static, dynamic):
    if bool(bad):
      where = "[" + ", ".join(str(int(j)) for j in np.unravel_index(int(index), shape)) + "]"
      raise ValueError(message.format(where=where, vals=[v.item() for v in vals]))


def _token_mask(B, T, cu_seqlens, segment_ids):
  """[B, T] bool: tokens that belong to a sequence."""
  if cu_seqlens is not None:
    return (jnp.arange(T) < jnp.asarray(cu_seqlens)[-1])[None]
  if segment_ids is not None:
    return jnp.asarray(segment_ids) > 0
  return jnp.ones((B, T), bool)


def checks(q, k, v, g, beta, *, cu_seqlens, segment_ids, N, initial_state, A_log, dt_bias,
           use_gate_in_kernel, lower_bound):
  """Traces the checks and the callback that raises on the first failing one."""
  B, T = q.shape[:2]
  found: list[_Check] = []
  if cu_seqlens is not None:
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    found.append(_first("cu_seqlens", "cu_seqlens must start at 0, got cu_seqlens{where}={vals[0]}",
                        cu[:1], cu[:1] != 0))
    if cu.shape[0] > 1:
      d = cu[1:] < cu[:-1]
      found.append(_first("cu_seqlens", "cu_seqlens must be non-decreasing, got cu_seqlens{where}="
                          "{vals[0]} > the next entry, {vals[1]}", cu[:-1], d, cu[1:]))
    found.append(_first("cu_seqlens", f"cu_seqlens[-1] must be <= T={T}, got {{vals[0]}}", cu[-1:],
                        cu[-1:] > T))
  if segment_ids is not None:
    seg = jnp.asarray(segment_ids).astype(jnp.int32)
    found.append(_first("segment_ids", "segment_ids must be >= 0 (0 marks padding), got "
                        "segment_ids{where}={vals[0]}", seg, seg < 0))
    prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
    runs = jnp.sum((seg > 0) & (seg != prev)).reshape(1)
    found.append(_first("segment_ids", f"segment_ids must hold at most N={N} sequences (runs of equal "
                        f"positive ids; N from num_segments or initial_state), got {{vals[0]}}",
                        runs, runs > N))
  for name, x in (("A_log", A_log), ("dt_bias", dt_bias), ("initial_state", initial_state)):
    if x is not None:
      found.append(_first(name, "{name} must be finite, got {name}{where}={vals[0]}", x,
                          ~jnp.isfinite(x)))
  owned = _token_mask(B, T, cu_seqlens, segment_ids)
  for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
    m = owned.reshape(owned.shape + (1,) * (x.ndim - 2))
    found.append(_first(name, "{name} must be finite at tokens of a sequence, got {name}{where}={vals[0]}",
                        x, m & ~jnp.isfinite(x)))
  g_act = gate.activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  what = "activated gates" if use_gate_in_kernel else "gates (log space)"
  found.append(_first("g", f"g: {what} must be <= 0 (-inf allowed) at tokens of a sequence, got "
                      "g{where}={vals[0]}" + (" (activated: {vals[1]})" if use_gate_in_kernel else ""),
                      g, owned[:, :, None, None] & ~(g_act <= 0), g_act))
  static = tuple((c.message, c.shape) for c in found)
  dynamic = tuple((c.bad, c.index, c.vals) for c in found)
  jax.debug.callback(lambda d: _raise(static, d), dynamic)
