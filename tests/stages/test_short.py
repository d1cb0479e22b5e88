"""The short stage: the Pallas kernels (interpret mode on a CPU, compiled on a GPU) against the
reference, forward and backward, a NaN kept in its sequence, the Triton lowering for an H200, and the
kernel in a whole call."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda.reference import recurrent_kda
from kda.stages import short
from tests.lowering import lower_h200, lower_tpu

INTERPRET = {"pallas": jax.default_backend() != "gpu", "mosaic_tpu": jax.default_backend() != "tpu",
             "reference": False}


def _inputs(N, S, HV, K, V, seed=0, lens=None):
  """Step inputs [N, S, ...] float32 (random past a sequence's lens too: they must not be read)."""
  r = np.random.default_rng(seed)
  f = lambda *s: r.standard_normal(s).astype(np.float32)
  k = f(N, S, HV, K)
  xs = [f(N, S, HV, K) * 0.5, k / np.linalg.norm(k, axis=-1, keepdims=True), f(N, S, HV, V),
        -np.abs(f(N, S, HV, K)) * 0.3, 1 / (1 + np.exp(-f(N, S, HV)))]
  return [jnp.asarray(x) for x in xs] + [jnp.asarray(f(N, HV, K, V) * 0.3)]


def _run(impl, xs, lens=None, config=None, scale=0.7):
  fn = lambda *a: tuple(short.STAGE(impl, *a, lens, skip=lens is not None, interpret=INTERPRET[impl], config=config,
                                    scale=scale))
  out, vjp = jax.vjp(fn, *xs)
  r = np.random.default_rng(9)
  cts = tuple(jnp.asarray(r.standard_normal(x.shape), jnp.float32) for x in out)
  return out, vjp(cts)


# pallas: block_v 16 splits V = 48 into tiles; mosaic_tpu: N = 5 and 3 pad to 8 sequences per
# program, N = 6 with 3 steps takes them 8 at a time (48 rows)
CASES = {
    "1_step": dict(N=5, S=1, HV=2, K=32, V=16),
    "3_steps_ragged": dict(N=8, S=3, HV=1, K=16, V=32, lens=[3, 1, 0, 2, 3, 1, 2, 0]),
    "odd_dims_v_tiles": dict(N=3, S=2, HV=2, K=24, V=48, lens=[2, 1, 2]),
}
CONFIGS = {"pallas": short.pallas.Config(block_v=16), "mosaic_tpu": short.mosaic_tpu.Config(heads=4)}


@pytest.mark.parametrize("impl", ["pallas", "mosaic_tpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_forward_and_backward(case, impl):
  kw = dict(CASES[case])
  xs = _inputs(**kw)
  lens = None if "lens" not in kw else jnp.asarray(kw["lens"], jnp.int32)
  config = CONFIGS[impl] if case == "odd_dims_v_tiles" else None
  (o, s), grads = _run(impl, xs, lens, config)
  (o_r, s_r), grads_r = _run("reference", xs, lens)
  np.testing.assert_allclose(o, o_r, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s, s_r, rtol=1e-5, atol=1e-5)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_r):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max()), err_msg=name)
  if lens is not None:          # steps not taken: o and the gradients of their inputs are 0
    off = np.arange(kw["S"])[None, :] >= np.asarray(lens)[:, None]
    assert off.any()
    for x in (o, *grads[:5]):
      assert not np.asarray(x)[off].any()


@pytest.mark.parametrize("impl", ["pallas", "mosaic_tpu"])
def test_a_nan_stays_in_its_sequence(impl):
  """A NaN in sequence 1's initial state and another in sequence 3's v: every other sequence's
  outputs and gradients are those of the clean call, bit for bit."""
  xs = _inputs(N=5, S=2, HV=1, K=16, V=16, seed=2)
  bad = list(xs)
  bad[5] = bad[5].at[1, 0, 3, 4].set(jnp.nan)
  bad[2] = bad[2].at[3, 1, 0, 2].set(jnp.nan)
  (o, s), g = _run(impl, bad)
  (o_ok, s_ok), g_ok = _run(impl, xs)
  keep = np.array([True, False, True, False, True])
  for a, b in zip((o, s) + tuple(g), (o_ok, s_ok) + tuple(g_ok)):
    np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(b)[keep])
  assert np.isnan(np.asarray(s)[1]).any() and np.isnan(np.asarray(s)[3]).any()


def test_supports_counts_the_registers():
  xs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
        [(4, 1, 1, 512)] * 2 + [(4, 1, 1, 256), (4, 1, 1, 512), (4, 1, 1), (4, 1, 512, 256)]]
  assert short.STAGE.supports("pallas", *xs, scale=1.0) is None            # BV = 8 by default
  why = short.STAGE.supports("pallas", *xs, scale=1.0, config=short.pallas.Config(block_v=64))
  assert "[512, 64]" in why and "1024 registers" in why


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (256, 256)])
def test_kernels_lower_for_h200(K, V):
  xs = _inputs(N=4, S=3, HV=2, K=K, V=V) + [jnp.asarray([3, 0, 1, 2], jnp.int32)]
  run = functools.partial(short.pallas.apply, scale=0.1)
  loss = lambda *a: sum(jnp.sum(x * x) for x in run(*a))
  txt = lower_h200(jax.grad(loss, argnums=tuple(range(6))), *xs)
  assert txt.count("__gpu$xla.gpu.triton") == 2                       # the forward and the backward


@pytest.mark.parametrize("K,V,N,S", [(64, 64, 200000, 1), (128, 128, 64, 4), (256, 256, 13, 3)])
def test_tpu_kernels_lower_for_every_generation(K, V, N, S):
  """The forward and the backward: Mosaic's lowering for v5e, v6e and v7x."""
  sd = jax.ShapeDtypeStruct
  xs = [sd((N, S, 2, K), jnp.float32)] * 2 + [sd((N, S, 2, V), jnp.float32), sd((N, S, 2, K), jnp.float32),
                                              sd((N, S, 2), jnp.float32), sd((N, 2, K, V), jnp.float32),
                                              sd((N,), jnp.int32)]
  run = functools.partial(short.mosaic_tpu.apply, scale=0.1)
  loss = lambda *a: sum(jnp.sum(x * x) for x in run(*a))
  for gen in ("v5e", "v6e", "v7x"):
    assert lower_tpu(jax.grad(loss, argnums=tuple(range(6))), *xs, gen=gen) == 2, gen


@pytest.mark.parametrize("impl", ["pallas", "mosaic_tpu"])
def test_the_kernel_in_a_call_with_states(impl):
  """impl={"short": impl}: short sequences (1-4 tokens, traced cu_seqlens) beside long ones,
  o, the final states and every gradient the recurrence's."""
  lens = [1, 3, 70, 0, 2, 4, 1]
  r = np.random.default_rng(4)
  T, H, K, V = sum(lens), 2, 32, 16
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  k = f(1, T, H, K)
  xs = (f(1, T, H, K), k / jnp.linalg.norm(k, axis=-1, keepdims=True), f(1, T, H, V),
        -jnp.abs(f(1, T, H, K)) * 0.2, jax.nn.sigmoid(f(1, T, H)), f(len(lens), H, K, V))
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  w_o, w_s = f(1, T, H, V), f(len(lens), H, K, V)

  def loss(call):
    return lambda *a: (lambda o, s: jnp.sum(o * w_o) + jnp.sum(s * w_s))(*call(*a))
  got = lambda *a: kda.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=a[6],
                                 impl={"short": impl})
  ref = lambda *a: recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu)
  args = (*xs, jnp.asarray(cu))
  for a, b in zip(jax.jit(got)(*args), ref(*xs)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  g = jax.jit(jax.grad(loss(got), argnums=tuple(range(6))))(*args)
  g_r = jax.grad(loss(ref), argnums=tuple(range(6)))(*xs)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g, g_r):
    np.testing.assert_allclose(a, b, atol=5e-5 * float(np.abs(b).max()), err_msg=name)
