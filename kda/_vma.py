"""Varying manual axes (vma) inside `jax.shard_map`, with its default checks (check_vma=True).

Under shard_map every value records the mesh axes it varies over, and JAX checks that types agree:
- a scan's carry-out varies over every axis its inputs do, so a carry initialised from an invariant
  value (zeros made in place, a replicated initial state) would change type across one step:
  `vary_like` casts it up front;
- a kernel's outputs (pallas_call, plgpu.kernel) have the type their launcher declares: `out_struct`;
- Pallas' interpreter and plgpu.kernel cannot take varying inputs at all (jax 0.11.2): `unchecked`
  runs them where the checks are off.
Outside shard_map every vma is empty and all three do nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _vma(x) -> frozenset:
  """The mesh axes x varies over (jax 0.11 spells it `jax.typeof(x).mat.varying`)."""
  if not hasattr(x, "dtype"):
    return frozenset()
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_like(tree, *refs):
  """Every array of `tree` cast to vary over each mesh axis some array of `refs` (or of `tree`)
  varies over."""
  leaves = jax.tree.leaves((tree, refs))
  want = frozenset().union(*(_vma(r) for r in leaves))

  def cast(x):
    missing = tuple(sorted(want - _vma(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A kernel's output type: under shard_map a kernel's outputs vary over every mesh axis its
  inputs do (pallas_call and plgpu.kernel need it said), elsewhere a plain ShapeDtypeStruct."""
  want = frozenset().union(*(_vma(x) for x in jax.tree.leaves(inputs)))
  if not want:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=want))


@jax.custom_jvp
def _no_tangent(x):
  return x


@_no_tangent.defjvp
def _no_tangent_jvp(primals, tangents):
  raise TypeError("kda: kernels that run unchecked under shard_map (kda._vma.unchecked) have no derivative "
                  "there: a second derivative of chunk_kda with these kernels is not supported; use "
                  "impl='reference'")


def unchecked(fn, *args):
  """fn(*args) with vma checks off, its results cast to vary like `args`.

  Pallas' interpreter (interpret mode on a CPU) evaluates a kernel body on the varying blocks it
  slices next to the body's invariant constants, and plgpu.kernel keeps its inputs' varying types on
  the refs while the values computed from them have none; check_vma rejects both (jax 0.11.2). So
  under shard_map `fn` runs in a nested shard_map over no new axes with check_vma=False: per device
  as before, unchecked. Its inputs would keep their varying types in there, while everything
  computed from them would not (scan and loop carries then differ in type), so they enter through a
  no-op bitcast, which an unchecked region types invariant like any other op. The results come back
  typed invariant and are cast up again. Neither the bitcast (no tangent) nor that cast (it
  transposes to a sum) differentiates right, so `fn` must not be differentiated: it is the primal,
  the fwd or the bwd rule of a custom_vjp, and a derivative through it (a second derivative) raises.
  Outside shard_map it is fn(*args).
  """
  if not frozenset().union(*(_vma(x) for x in jax.tree.leaves(args))):
    return fn(*args)
  P = jax.sharding.PartitionSpec
  guard = lambda x: _no_tangent(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x
  strip = lambda x: jax.lax.bitcast_convert_type(x, x.dtype)
  body = lambda *a: fn(*jax.tree.map(strip, a))
  out = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(P(),) * len(args),
                      out_specs=P(), axis_names=frozenset(), check_vma=False)(*jax.tree.map(guard, args))
  return vary_like(out, args)
