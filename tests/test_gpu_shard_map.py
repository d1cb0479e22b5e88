"""The compiled kernels (impl=None: Mosaic GPU forward on Hopper) inside jax.shard_map and under jit
with explicit-axis sharded inputs, forward and gradients, against the unsharded call.

GPU only (skipped on a CPU, where tests/test_multidevice.py covers the reference path and the
interpreted kernels on emulated devices): run it on the device with
`python3 -m pytest tests/test_gpu_shard_map.py -q`. A one-device mesh suffices to check that the
kernels run under shard_map's varying-type checks and the internal partitioning (kda.sharding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kda

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")

HEADS = P(None, None, "model")


def _inputs():
  T, H, K, V = 384, 2, 128, 128
  ks = jax.random.split(jax.random.PRNGKey(3), 5)
  bf = jnp.bfloat16
  q, k = (jax.random.normal(s, (1, T, H, K)).astype(bf) for s in ks[:2])
  v = jax.random.normal(ks[2], (1, T, H, V)).astype(bf)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (1, T, H, K))) / 8
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H))).astype(bf)
  return (q, k, v, g, beta), jnp.array([0, 100, 164, 300, 384], jnp.int32)


def _attend(q, k, v, g, beta, cu):
  return kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]


def _close(a, b, tol):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.isfinite(a).all()
  assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-30)


def _put(mesh, a, spec):
  return jax.device_put(a, NamedSharding(mesh, spec))


def test_kernels_inside_shard_map_forward_and_grad():
  mesh = jax.make_mesh((jax.device_count(),), ("model",))   # explicit axes: inputs must carry the sharding
  x, cu = _inputs()
  x, cu = tuple(_put(mesh, a, HEADS) for a in x), _put(mesh, cu, P())
  sharded = jax.shard_map(_attend, mesh=mesh, in_specs=(HEADS,) * 5 + (P(),), out_specs=HEADS)
  _close(jax.jit(sharded)(*x, cu), jax.jit(_attend)(*x, cu), 1e-6)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a, cu).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))
  for got, want in zip(grad(sharded)(*x), grad(_attend)(*x)):
    _close(got, want, 1e-5)


def test_kernels_under_jit_with_explicit_sharded_inputs():
  mesh = jax.make_mesh((jax.device_count(),), ("model",))
  x, cu = _inputs()
  got = jax.jit(_attend)(*(_put(mesh, a, HEADS) for a in x), _put(mesh, cu, P()))
  _close(got, jax.jit(_attend)(*x, cu), 1e-6)
