"""chunk_kda on inputs sharded over an explicit mesh: it partitions itself with an internal shard_map.

Under `jax.jit` with inputs whose shardings use Explicit mesh axes (jax.make_mesh's default), the
sharding of every input is part of its type, so chunk_kda reads it while tracing and runs in a
`jax.shard_map` over the whole mesh: each device computes its own heads and batch rows, and no
kernel sees a global array (pallas_call and plgpu.kernel are not partitioned by XLA, and take only
Manual mesh axes).

- Heads: the mesh axes of q's head dimension (else v's) split H and HV together (value head j
  reads head j // (HV // H), so every device keeps whole GVA groups); A_log and dt_bias follow.
  They must divide H; otherwise the heads are gathered.
- Batch rows: the axes of q's batch dimension, when rows are independent: without cu_seqlens
  (B == 1 then), and with segment_ids only when no state goes in or out (the sequence numbering of
  initial_state / final_state runs across rows). initial_state / final_state [B, ...] follow.
- Every other dimension (T, K, V) is gathered: a sequence needs its tokens and features on one device.

Inside shard_map (every mesh axis Manual), or with Auto axes, where no sharding shows while
tracing, nothing here applies; docs/api.md#multiple-devices says how to call chunk_kda then.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from kda import shapes


def explicit_mesh(*arrays):
  """The mesh of the first array sharded over Explicit mesh axes, else None: the abstract mesh of
  its type while tracing, the concrete one of an array (an eager call places arrays on it).

  While tracing, only the traced arrays count (a concrete array closed over keeps the mesh it was
  placed on, which says nothing about the trace), and a trace inside shard_map (a Manual axis) has
  none."""
  arrays = [x for x in arrays if isinstance(x, jax.Array)]
  traced = [x for x in arrays if not shapes.is_concrete(x)]
  if traced:
    arrays = traced
    if any(AxisType.Manual in m.axis_types for m in map(_abstract_mesh, traced) if m is not None):
      return None
  for x in arrays:
    mesh = _abstract_mesh(x)
    if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
      return x.sharding.mesh if shapes.is_concrete(x) else mesh
  return None


def _abstract_mesh(x):
  return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def whole(mesh, *arrays):
  """The arrays, traced ones sharded over `mesh` resharded to replicated (None: unchanged)."""
  if mesh is None:
    return arrays
  return tuple(jax.sharding.reshard(x, NamedSharding(mesh, P())) if isinstance(x, jax.Array)
               and not shapes.is_concrete(x) and any(_axes(_spec(x), d) for d in range(x.ndim)) else x
               for x in arrays)


def _axes(spec, dim):
  """The mesh axes of dimension `dim` of a PartitionSpec, as a tuple."""
  entry = spec[dim] if dim < len(spec) else None
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec(x):
  return jax.typeof(x).sharding.spec if isinstance(x, jax.Array) else P()


def _size(mesh, axes):
  return math.prod(mesh.shape[a] for a in axes)


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _explicit(mesh, axes):
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return all(types[a] == AxisType.Explicit for a in axes)


def layout_axes(mesh, q, v, *, rows_independent):
  """-> (batch axes, head axes) that chunk_kda splits over (() for none)."""
  B, _, H, _ = q.shape
  heads = _axes(_spec(q), 2) or _axes(_spec(v), 2)
  if heads and (H % _size(mesh, heads) or not _explicit(mesh, heads)):
    heads = ()
  batch = _axes(_spec(q), 0) or _axes(_spec(v), 0)
  if batch and (not rows_independent or B % _size(mesh, batch) or set(batch) & set(heads)
                or not _explicit(mesh, batch)):
    batch = ()
  return batch, heads


def chunk_kda(call, mesh, arrays, *, N, num_segments, output_final_state):
  """call(num_segments=..., **arrays) -> (o, final_state), run per device in a shard_map over `mesh`.

  arrays: q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, segment_ids (None where
  absent); N: the number of sequences of the whole call. Concrete cu_seqlens / segment_ids that
  every device sees whole stay closed over, so the aligned length inside is still the exact one.
  """
  q, v, seg = arrays["q"], arrays["v"], arrays["segment_ids"]
  per_row = arrays["cu_seqlens"] is None and seg is None          # N == B: states follow the rows
  rows_independent = per_row or (arrays["cu_seqlens"] is None and arrays["initial_state"] is None
                                 and not output_final_state)
  batch, heads = layout_axes(mesh, q, v, rows_independent=rows_independent)
  b, h = _entry(batch), _entry(heads)
  s = b if per_row else None
  specs = {"q": P(b, None, h, None), "k": P(b, None, h, None), "v": P(b, None, h, None),
           "g": P(b, None, h, None), "beta": P(b, None, h), "initial_state": P(s, h, None, None),
           "A_log": P(h), "dt_bias": P(h), "cu_seqlens": P(), "segment_ids": P(b, None)}
  if seg is not None and batch:
    num_segments = N              # each device's rows hold at most N sequences; the rest stay empty
  keep = lambda n, x: n in ("cu_seqlens", "segment_ids") and shapes.is_concrete(x) and not (
      n == "segment_ids" and batch)
  traced = {n: x for n, x in arrays.items() if x is not None and not keep(n, x)}
  closed = {n: x for n, x in arrays.items() if n not in traced}
  names = sorted(traced)
  placed = [jax.sharding.reshard(jnp.asarray(traced[n]), NamedSharding(mesh, specs[n])) for n in names]

  def body(*xs):
    o, final_state = call(num_segments=num_segments, **closed, **dict(zip(names, xs)))
    return (o, final_state) if output_final_state else o

  out_specs = (specs["v"], P(s, h, None, None)) if output_final_state else specs["v"]
  out = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs[n] for n in names), out_specs=out_specs,
                      axis_names=frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                                           if t == AxisType.Explicit))(*placed)
  return out if output_final_state else (out, None)


__all__ = ["explicit_mesh", "whole", "layout_axes", "chunk_kda"]
