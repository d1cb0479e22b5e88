"""With initial_state=None and output_final_state=False the Mosaic GPU
state kernels skip the zero initial state and the unused final state (forward: the fused state +
output kernel; backward: S0's state kernel and bwd_dh's walk, which also skips the zero final-state
cotangent and the dropped dh0). Same bits as explicit zero states (simulator); CUDA lowering of the
variants."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda import plan as planning
from kda.fused.state_output import mosaic_gpu as state_output
from kda.stages.bwd_dh import mosaic_gpu as mgd
from kda.stages.state import mosaic_gpu as mgs
from tests.test_fused_state_output import fused_case
from tests.stages.test_bwd_dh_mosaic import make_case as dh_case
from tests.stages.test_state_mosaic import make_case as state_case
from tests.test_pipeline import _packed_case


@pytest.mark.large      # ~25 s in the simulator (CI budget): the per-kernel tests below run by default
def test_chunk_kda_grad_is_the_same_with_the_states_elided(monkeypatch):
  x, kw = _packed_case()
  kw = {k: v for k, v in kw.items() if k not in ("initial_state", "output_final_state")}
  seen = []

  def spy(real, tag):
    names = ("zero_h0", "store_final", "dht_zero", "need_dh0")
    return lambda *a, **k: seen.append((tag, {n: k[n] for n in names if n in k})) or real(*a, **k)

  monkeypatch.setattr(state_output, "apply", spy(state_output.apply, "fused"))
  monkeypatch.setattr(mgs, "apply", spy(mgs.apply, "state"))            # S0 calls it by attribute
  monkeypatch.setattr(mgd, "apply", spy(mgd.apply, "walk"))

  # short_len=0: the 1-token sequence runs the chunk kernels in both calls (with states it would take
  # kda.short's float32 recurrence, whose rounding differs)
  config = {"pipeline": planning.PipelineConfig(short_len=0)}

  def grads(**states):
    def loss(q, k, v, g, beta):
      o = kda.chunk_kda(q, k, v, g, beta, **kw, **states, impl="mosaic_gpu", config=config)[0]
      return jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0).astype(jnp.float32) ** 2)
    return jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*x))

  N, HV, K, V = kw["cu_seqlens"].shape[0] - 1, x[2].shape[2], x[0].shape[3], x[2].shape[3]
  plain = grads(initial_state=jnp.zeros((N, HV, K, V), jnp.float32), output_final_state=True)
  assert all(not flags for _, flags in seen), seen
  seen.clear()
  elided = grads()
  flags = dict(seen)
  assert flags["fused"] == dict(zero_h0=True, store_final=False), flags
  assert flags["state"] == dict(zero_h0=True, store_final=False), flags
  assert flags["walk"] == dict(dht_zero=True, need_dh0=False), flags
  for a, b in zip(elided, plain):
    assert np.isfinite(np.asarray(jnp.asarray(b, jnp.float32))).all()
    np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)))


def test_elided_variants_lower_for_cuda():
  S = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  Ta, HV, K, V, N = 4096, 2, 128, 128, 5
  kx, vx, gx = S((1, Ta, HV, K), bf), S((1, Ta, HV, V), bf), S((1, Ta, HV, K), f32)
  h0, cu = S((N, HV, K, V), f32), S((N + 1,), jnp.int32)
  lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
  for kw in (dict(zero_h0=True), dict(store_final=False), dict(zero_h0=True, store_final=False)):
    txt = lower(lambda *a: mgs.apply(*a, chunk_size=64, **kw), kx, kx, vx, gx, gx, h0, cu)
    assert "mosaic_gpu" in txt
    txt = lower(lambda *a: state_output.apply(*a, scale=0.1, chunk_size=64, **kw),
                kx, kx, vx, kx, S((1, Ta, HV, 64), bf), gx, gx, h0, cu)
    assert "mosaic_gpu" in txt
  dh_args = (kx, kx, kx, gx, gx, S((1, Ta // 64, HV, K, V), bf), vx, S((1, Ta, HV, V), f32),
             S((1, Ta, HV, V), f32), h0, cu)
  for kw in (dict(dht_zero=True), dict(need_dh0=False), dict(dht_zero=True, need_dh0=False)):
    assert "mosaic_gpu" in lower(lambda *a: mgd.apply(*a, scale=0.1, chunk_size=64, **kw), *dh_args)


def _same(a, b, name):
  np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)), name)


LENS = [1, 63, 0, 64, 65]


def test_state_kernel_variants_same_bits():
  (kg, w, u, gi, gf, h0, acu), _, _ = state_case(LENS, 64, 64, poison=False)
  zero = jnp.zeros_like(h0)
  f = lambda **kw: jax.block_until_ready(jax.jit(functools.partial(
      mgs.apply, chunk_size=64, interpret=True, **kw))(kg, w, u, gi, gf, zero, acu))
  plain, elided = f(), f(zero_h0=True, store_final=False)
  _same(elided.h, plain.h, "h")
  _same(elided.v_new, plain.v_new, "v_new")
  assert not np.asarray(elided.final_state).any() and np.asarray(plain.final_state).any()


def test_fused_state_output_variants_same_bits():
  args, _, _ = fused_case([70, 0, 64, 5], 64, 64, HV=2)
  args = args[:7] + (jnp.zeros_like(args[7]),) + args[8:]
  f = lambda **kw: jax.block_until_ready(jax.jit(functools.partial(
      state_output.apply, scale=0.125, chunk_size=64, interpret=True, **kw))(*args))
  (o, ht), (o_e, ht_e) = f(), f(zero_h0=True, store_final=False)
  _same(o_e, o, "o")
  assert not np.asarray(ht_e).any() and np.asarray(ht).any()


def test_walk_variants_same_bits():
  args, _, _ = dh_case(LENS, 64, 64)
  args = args[:9] + (jnp.zeros_like(args[9]),) + args[10:]
  f = lambda **kw: jax.block_until_ready(jax.jit(functools.partial(
      mgd.apply, scale=0.125, chunk_size=64, interpret=True, **kw))(*args))
  plain, elided = f(), f(dht_zero=True, need_dh0=False)
  for name in ("du", "dqg", "dkg", "dw", "dgc_last"):
    _same(getattr(elided, name), getattr(plain, name), name)
  assert not np.asarray(elided.dh0).any() and np.asarray(plain.dh0).any()
