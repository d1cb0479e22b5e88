"""gate stage: the reference against a float64 numpy loop, the Pallas kernel against the reference
(interpret mode, every activation form), and the kernel's Triton lowering for an H200."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.stages import gate
from tests import cases
from tests.lowering import lower_h200

# Reference (float32) vs float64 over K = 8 channels and 16-token chunks: measured ~2e-7 relative;
# 1e-5 leaves headroom without hiding a wrong formula.
REF_TOL = dict(atol=1e-5, rtol=1e-5)
# Kernel vs reference, by output. g: the same float32 formula (exp, log1p and sigmoid may differ by
# a few ulp on a GPU). gc: a cumsum of <= 64 terms of size <= ~10 in another order (GPU scan):
# rounding grows with |gc| <= ~320. Measured 0 on CPU for both (same ops in the same order).
TOL = {"g": dict(atol=1e-6, rtol=1e-6), "gc_int": dict(atol=1e-30, rtol=0), "gc_frac": dict(atol=1e-5, rtol=2e-5)}

# activation forms: (use_gate_in_kernel, lower_bound, with A_log, with dt_bias)
FORMS = {
    "softplus": (True, None, True, True),
    "softplus-nobias": (True, None, True, False),
    "sigmoid": (True, -5.0, True, True),
    "sigmoid-noA": (True, -2.0, False, True),
    "identity": (False, None, False, False),
}

POOL_T, POOL_HV, POOL_D = 256, 2, 128


@functools.lru_cache(maxsize=None)
def _pool(gate_kind):
  """One make_inputs draw at the largest test shape per gate kind, sliced by every case: jax.random
  compiles per shape, which would cost more than the kernels under test."""
  f = functools.partial(cases.make_inputs, 11, T=POOL_T, H=POOL_HV, K=POOL_D, V=POOL_D, gate=gate_kind,
                        initial_state=False)
  return jax.jit(f)()


@functools.partial(jax.jit, static_argnames=("lens", "T", "HV", "K", "V", "BT", "dtype", "gate_kind",
                                             "gate_scale"))
def _slice_and_align(pool, *, lens, T, HV, K, V, BT, dtype, gate_kind, gate_scale):
  n = sum(lens) if lens is not None else T
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)   # unit-norm again over K channels
  q, k = (unit(x[:, :n, :HV, :K]) for x in (pool.q, pool.k))
  v, g, beta = pool.v[:, :n, :HV, :V], pool.g[:, :n, :HV, :K] * gate_scale, pool.beta[:, :n, :HV]
  A_log = dt_bias = None
  if gate_kind == "raw":
    A_log, dt_bias = pool.A_log[:HV], pool.dt_bias.reshape(POOL_HV, POOL_D)[:HV, :K].reshape(-1)
  q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
  if lens is None:
    valid = jnp.ones((1, T), bool)
  else:
    layout = padding.layout_from_cu_seqlens(cases.cu_from_lens(lens), n, BT)
    q, k, v, g, beta = (padding.align_with(layout, x) for x in (q, k, v, g, beta))
    valid = padding.valid_mask(layout)[None]
  return q, k, v, g, beta, valid, A_log, dt_bias


def pooled_inputs(*, lens=None, T=None, HV=2, K=32, V=32, BT=32, dtype=jnp.float32, gate_kind="plain",
                  gate_scale=1.0):
  """Random stage inputs drawn like tests/cases.make_inputs, in the aligned layout of kda.padding.

  lens: varlen sequence lengths (zeros at padding positions); else T tokens with no padding.
  Returns q, k [1, Ta, HV, K], v [1, Ta, HV, V], g [1, Ta, HV, K] (raw for gate_kind "raw"),
  beta [1, Ta, HV], valid [1, Ta] bool, A_log [HV], dt_bias [HV*K] (None unless "raw").
  """
  n = sum(lens) if lens is not None else T
  assert n <= POOL_T and HV <= POOL_HV and max(K, V) <= POOL_D
  return _slice_and_align(_pool(gate_kind), lens=None if lens is None else tuple(lens), T=T, HV=HV, K=K,
                          V=V, BT=BT, dtype=jnp.dtype(dtype), gate_kind=gate_kind, gate_scale=gate_scale)


def form_args(form, g, valid, A_log, dt_bias):
  use, lower_bound, with_a, with_bias = FORMS[form]
  kw = dict(use_gate_in_kernel=use, lower_bound=lower_bound)
  return (g, valid, A_log if with_a else None, dt_bias if with_bias else None), kw


def numpy_gate(g, valid, A_log, dt_bias, *, use_gate_in_kernel, lower_bound, BT):
  """The module docstring's formulas in float64, the cumsum as a running sum per chunk."""
  g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
  _, Ta, HV, K = g.shape
  x = g.copy()
  if use_gate_in_kernel:
    if dt_bias is not None:
      x = x + np.asarray(dt_bias, np.float64).reshape(HV, K)
    a = np.ones((HV, 1)) if A_log is None else np.exp(np.asarray(A_log, np.float64))[:, None]
    if lower_bound is None:
      x = -a * np.logaddexp(0.0, x)
    else:
      x = lower_bound / (1.0 + np.exp(-a * x))
  act = np.where(np.asarray(valid)[:, :, None, None], np.maximum(x, gate.GATE_FLOOR), 0.0)
  gc = np.zeros_like(act)
  for c in range(Ta // BT):
    run = np.zeros((HV, K))
    for t in range(c * BT, (c + 1) * BT):
      run = run + act[0, t]
      gc[0, t] = run
  return act, gc


@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_reference_matches_numpy_loops(form):
  BT = 16
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[20, 7], HV=2, K=8, BT=BT, gate_kind="raw")
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  got = jax.jit(functools.partial(gate.reference.apply, chunk_size=BT, **kw))(*args)
  want = numpy_gate(*args, BT=BT, **kw)
  cases.report_close("g", got.g, want[0], **REF_TOL)
  cases.report_close("gc", got.gc_int + got.gc_frac, want[1], **REF_TOL)
  check_parts(got)


def check_parts(got):
  """gc_int holds integers, gc_frac what is left: at most 1 per token below 0."""
  gi, gf = np.asarray(got.gc_int), np.asarray(got.gc_frac)
  np.testing.assert_array_equal(gi, np.round(gi), "gc_int is not integer-valued")
  BT = 1 + np.arange(gi.shape[1]) % 64
  assert np.all(gf <= 0) and np.all(gf > -BT[None, :, None, None]), "gc_frac outside (-(t+1), 0]"


def check_padding(got, valid, BT):
  """g = 0 exactly at padding tokens and gc is flat there (equal to the token before, in-chunk)."""
  pad = ~np.asarray(valid[0])
  g, gc = np.asarray(got.g[0]), np.asarray(got.gc_int[0] + got.gc_frac[0])
  assert not np.any(g[pad]), "g is not exactly 0 at padding tokens"
  t = np.flatnonzero(pad & (np.arange(len(pad)) % BT != 0))
  np.testing.assert_array_equal(gc[t], gc[t - 1], "gc is not flat over padding tokens")


KERNEL_CASES = [
    # id, lens or T, K, BT, dtype, form
    ("30_50-K32-BT16-f32-softplus", [30, 50], 32, 16, jnp.float32, "softplus"),
    ("45_80_20-K64-BT32-bf16-softplus", [45, 80, 20], 64, 32, jnp.bfloat16, "softplus"),
    ("100-K96-BT64-f32-softplus-nobias", [100], 96, 64, jnp.float32, "softplus-nobias"),
    ("with_empty-K128-BT64-bf16-sigmoid", [17, 0, 40], 128, 64, jnp.bfloat16, "sigmoid"),
    ("30_50-K96-BT32-f32-sigmoid-noA", [30, 50], 96, 32, jnp.float32, "sigmoid-noA"),
    ("T128-K128-BT64-f32-identity", 128, 128, 64, jnp.float32, "identity"),
    ("100_50-K32-BT16-bf16-identity", [100, 50], 32, 16, jnp.bfloat16, "identity"),
]


@pytest.mark.parametrize("lens,K,BT,dtype,form", [c[1:] for c in KERNEL_CASES], ids=[c[0] for c in KERNEL_CASES])
def test_kernel_matches_reference(lens, K, BT, dtype, form):
  varlen = isinstance(lens, list)
  gate_kind = "plain" if form == "identity" else "raw"
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(
      lens=lens if varlen else None, T=None if varlen else lens, HV=2, K=K, BT=BT, dtype=dtype,
      gate_kind=gate_kind)
  g = jnp.where(valid[:, :, None, None], g, jnp.nan)          # padding values must never be read
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  want = jax.jit(functools.partial(gate.reference.apply, chunk_size=BT, **kw))(*args)
  got = jax.jit(functools.partial(gate.pallas.apply, chunk_size=BT, interpret=True, **kw))(*args)
  for name in gate.Out._fields:
    chex.assert_shape(getattr(got, name), getattr(want, name).shape)
    assert getattr(got, name).dtype == jnp.float32
    cases.report_close(name, getattr(got, name), getattr(want, name), **TOL[name])
  check_padding(got, valid, BT)


def test_kernel_strong_gates_stay_finite():
  """-5 per token over whole 64-token chunks: gc reaches -320, exactly as the reference."""
  BT = 64
  _, _, _, g, _, valid, _, _ = pooled_inputs(T=128, HV=2, K=64, BT=BT, gate_kind="strong")
  kw = dict(use_gate_in_kernel=False, lower_bound=None)
  want = jax.jit(functools.partial(gate.reference.apply, chunk_size=BT, **kw))(g, valid, None, None)
  got = jax.jit(functools.partial(gate.pallas.apply, chunk_size=BT, interpret=True, **kw))(
      g, valid, None, None)
  assert float(jnp.min(got.gc_int + got.gc_frac)) < -300 and bool(jnp.all(jnp.isfinite(got.gc_frac)))
  for name in gate.Out._fields:
    cases.report_close(name, getattr(got, name), getattr(want, name), **TOL[name])


EXTREMES = (-np.inf, -1e30, -1e5, -1e4, -1e3, -200.0, -128.0, -127.5, -90.0, -30.0)


def extreme_gates(g, seed, frac=0.15):
  """g with a random `frac` of its entries replaced by EXTREMES (huge, -inf, around the floor)."""
  r = np.random.RandomState(seed)
  g = np.array(g, np.float32)
  hit = r.rand(*g.shape) < frac
  g[hit] = r.choice(EXTREMES, size=int(hit.sum()))
  return jnp.asarray(g)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_extreme_gates_keep_every_decay_exact(impl):
  """Any gate <= 0: every in-chunk decay exponent gc_i - gc_j formed from the two parts matches the
  float64 one to float32 accuracy of the ordinary gates (a single float32 gc loses ulp(1e4) ~ 1e-3
  after one -1e4 gate); gates at or below the floor, -inf included, give exactly GATE_FLOOR."""
  BT = 32
  _, _, _, g, _, valid, _, _ = pooled_inputs(lens=[40, 50], HV=2, K=16, BT=BT)
  g = extreme_gates(g, 3)
  kw = dict(chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
  fn = gate.reference.apply if impl == "reference" else functools.partial(gate.pallas.apply, interpret=True)
  got = jax.jit(functools.partial(fn, **kw))(g, valid, None, None)
  act, _ = numpy_gate(g, valid, None, None, use_gate_in_kernel=False, lower_bound=None, BT=BT)
  np.testing.assert_array_equal(np.asarray(got.g), act.astype(np.float32))
  assert np.any(np.isneginf(np.asarray(g))) and bool(jnp.all(jnp.isfinite(got.gc_int)))
  check_parts(got)
  gi, gf = (np.asarray(x[0], np.float64).reshape(-1, BT, 2, 16) for x in (got.gc_int, got.gc_frac))
  want = np.cumsum(act[0].reshape(-1, BT, 2, 16), axis=1)
  d_got = (gi[:, :, None] - gi[:, None, :]) + (gf[:, :, None] - gf[:, None, :])
  d_want = want[:, :, None] - want[:, None, :]
  live = np.tril(np.ones((BT, BT), bool))[None, :, :, None, None] & (d_want > -100)
  assert live.sum() > 1000
  err = np.max(np.abs(d_got - d_want)[live])
  assert err < 2e-5, f"decay exponent error {err:.2e} (float32 gc over these gates: ~1e-3)"


def test_kernel_rejects_missing_A_log():
  x = jnp.zeros((1, 16, 1, 16))
  with pytest.raises(ValueError, match="A_log"):
    gate.pallas.apply(x, jnp.ones((1, 16), bool), None, None, chunk_size=16, use_gate_in_kernel=True,
                      lower_bound=None, interpret=True)
  with pytest.raises(ValueError, match="num_warps"):
    gate.pallas.Config(num_warps=3)


LOWER_CASES = [(128, 64, jnp.bfloat16, f) for f in ("softplus", "sigmoid", "sigmoid-noA", "identity")] + [
    (96, 64, jnp.float32, "softplus"), (128, 16, jnp.float32, "sigmoid"), (64, 32, jnp.bfloat16, "softplus")]


@pytest.mark.parametrize("K,BT,dtype,form", LOWER_CASES,
                         ids=[f"K{K}-BT{BT}-{jnp.dtype(d).name}-{f}" for K, BT, d, f in LOWER_CASES])
def test_kernel_lowers_for_h200(K, BT, dtype, form):
  Ta, HV = 4 * BT, 2
  g = jnp.zeros((1, Ta, HV, K), dtype)
  args, kw = form_args(form, g, jnp.ones((1, Ta), bool), jnp.zeros((HV,)), jnp.zeros((HV * K,)))
  txt = lower_h200(functools.partial(gate.pallas.apply, chunk_size=BT, **kw), *args)
  assert "kda_gate" in txt


@pytest.mark.parametrize("field,value", [("num_warps", 8), ("num_stages", 3)])
def test_config_field_changes_the_program(field, value):
  """Each Config field changes the lowered program (launch parameters: the interpreted program, and
  so test_kernel_matches_reference's, is the same)."""
  g = jnp.zeros((1, 128, 2, 64), jnp.float32)
  args, kw = form_args("softplus", g, jnp.ones((1, 128), bool), jnp.zeros((2,)), jnp.zeros((128,)))
  lower = lambda config: lower_h200(functools.partial(gate.pallas.apply, chunk_size=64, config=config, **kw), *args)
  assert lower(gate.pallas.Config(**{field: value})) != lower(gate.pallas.Config())
