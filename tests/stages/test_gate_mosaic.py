"""The Mosaic GPU gate kernel against the gate reference: simulator runs on CPU and CUDA lowering.

Every activation form (no activation; softplus with A_log; lower_bound sigmoid with or without
A_log; dt_bias or not), bf16 and float32 gates, K = 64 and 128, HV * K = 128 and 256, padding rows
poisoned with NaN, and extreme gates (-inf, -1e30 ... -200, around the floor, a huge exp(A_log)).

What may differ from the reference (measured with -s, printed per case): g by a few ulp (the
kernel's own softplus: log1p from log and a series), gc_int not at all (integers), gc_frac by the
order of the float32 additions: the kernel sums the rows in sequence, XLA's cumsum in a tree. The
kernel's gc parts equal a float32 numpy sequential sum of split(its own g) bit for bit
(`check_scan_exact`), so nothing but that order hides inside the tolerance.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import gate
from kda.stages.gate import mosaic_gpu as mgg
from tests.stages.test_gate import check_padding, check_parts, extreme_gates, pooled_inputs

BT = 64
# g: the reference's formula in other ops (softplus: a few ulp; measured <= 4.8e-7 relative);
# gc_frac: sequential vs tree summation of <= 64 terms in (-1, 0] (measured <= 6e-7 relative).
TOL = {"g": dict(atol=1e-30, rtol=1e-6), "gc_int": dict(atol=0, rtol=0),
       "gc_frac": dict(atol=1e-6, rtol=2e-6)}

# form -> (use_gate_in_kernel, lower_bound, with A_log, with dt_bias)
FORMS = {
    "identity": (False, None, False, False),
    "softplus": (True, None, True, True),
    "softplus-nobias": (True, None, True, False),
    "sigmoid": (True, -5.0, True, True),
    "sigmoid-nobias": (True, -5.0, True, False),
    "sigmoid-noA": (True, -5.0, False, True),
    "sigmoid-noA-nobias": (True, -5.0, False, False),
}


def form_args(form, g, valid, A_log, dt_bias):
  use, lower_bound, with_a, with_bias = FORMS[form]
  return ((g, valid, A_log if with_a else None, dt_bias if with_bias else None),
          dict(chunk_size=BT, use_gate_in_kernel=use, lower_bound=lower_bound))


def run_kernel(args, kw, config=None):
  f = jax.jit(functools.partial(mgg.apply, interpret=True, config=config, **kw))
  t0 = time.time()
  out = jax.block_until_ready(f(*args))
  return out, time.time() - t0


def compare(got, want, label, secs=None):
  """Field by field at TOL; prints the worst relative error of each (NaN where both are NaN ok)."""
  errs = {}
  for name in gate.Out._fields:
    a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
    assert a.shape == b.shape and a.dtype == np.float32, (name, a.shape, a.dtype)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), f"{name}: NaN pattern")
    ok = ~np.isnan(b)
    d = np.abs(a[ok].astype(np.float64) - b[ok])
    errs[name] = float(np.max(d / np.maximum(np.abs(b[ok]), 1e-30), initial=0.0))
    np.testing.assert_allclose(a, b, err_msg=name, **TOL[name])
  print(f"\n  {label}" + (f" ({secs:.2f}s)" if secs is not None else "") + ": "
        + ", ".join(f"{k} rel {e:.1e}" for k, e in errs.items()))
  return errs


def check_scan_exact(got):
  """gc_int, gc_frac == float32 sequential chunk sums of ceil(g), g - ceil(g), bit for bit."""
  g = np.asarray(got.g[0])
  whole = np.ceil(g)
  frac = (g - whole).astype(np.float32)
  gi, gf = np.zeros_like(g), np.zeros_like(g)
  for c in range(g.shape[0] // BT):
    ri = rf = np.zeros(g.shape[1:], np.float32)
    for t in range(c * BT, (c + 1) * BT):
      ri, rf = ri + whole[t], rf + frac[t]
      gi[t], gf[t] = ri, rf
  np.testing.assert_array_equal(np.asarray(got.gc_int[0]), gi)
  np.testing.assert_array_equal(np.asarray(got.gc_frac[0]), gf)


CASES = [
    # id, lens, HV, K, dtype, form (HV * K = 128 but for two: the simulator's time grows with programs)
    ("identity-f32-HV2-K64", [100, 20], 2, 64, jnp.float32, "identity"),
    ("identity-bf16-HV1-K128", [17, 0, 40], 1, 128, jnp.bfloat16, "identity"),
    ("softplus-f32-HV2-K128", [70], 2, 128, jnp.float32, "softplus"),
    ("softplus-bf16-HV2-K64", [1, 63], 2, 64, jnp.bfloat16, "softplus"),
    ("softplus-nobias-f32-HV1-K128", [130], 1, 128, jnp.float32, "softplus-nobias"),
    ("sigmoid-bf16-HV2-K128", [50], 2, 128, jnp.bfloat16, "sigmoid"),
    ("sigmoid-nobias-f32-HV2-K64", [40, 40], 2, 64, jnp.float32, "sigmoid-nobias"),
    ("sigmoid-noA-f32-HV2-K64", [64, 64], 2, 64, jnp.float32, "sigmoid-noA"),
    ("sigmoid-noA-nobias-bf16-HV1-K128", [90], 1, 128, jnp.bfloat16, "sigmoid-noA-nobias"),
]


@pytest.mark.parametrize("lens,HV,K,dtype,form", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_reference(lens, HV, K, dtype, form):
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(
      lens=lens, HV=HV, K=K, BT=BT, dtype=dtype, gate_kind="plain" if form == "identity" else "raw")
  g = jnp.where(valid[:, :, None, None], g, jnp.nan)          # padding values must never be read
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  got, secs = run_kernel(args, kw)
  want = gate.reference.apply(*args, **kw)
  compare(got, want, f"lens={lens} HV={HV} K={K} {jnp.dtype(dtype).name} {form}", secs)
  check_padding(got, valid, BT)
  check_parts(got)
  check_scan_exact(got)


@pytest.mark.parametrize("config", [mgg.Config(stage_stores=True), mgg.Config(lane_semantics=True),
                                    mgg.Config(unroll=1)], ids=["tma-stores", "lane", "no-unroll"])
def test_kernel_configs(config):
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[50], HV=2, K=64, BT=BT, gate_kind="raw")
  g = jnp.where(valid[:, :, None, None], g, jnp.nan)
  args, kw = form_args("softplus", g, valid, A_log, dt_bias)
  got, secs = run_kernel(args, kw, config)
  compare(got, gate.reference.apply(*args, **kw), f"{config}", secs)
  check_padding(got, valid, BT)


def test_extreme_gates_identity():
  """Log-space gates with 15% of the entries extreme (-inf, -1e30, -1e5, -1e4, -1e3, -200, around the
  floor): g equals the floored gates exactly, and both parts equal the reference's, gc_int exactly."""
  _, _, _, g, _, valid, _, _ = pooled_inputs(lens=[100, 20], HV=2, K=64, BT=BT)
  g = extreme_gates(g, 5)
  assert np.any(np.isneginf(np.asarray(g)))
  args, kw = form_args("identity", g, valid, None, None)
  got, secs = run_kernel(args, kw)
  want = gate.reference.apply(*args, **kw)
  np.testing.assert_array_equal(np.asarray(got.g), np.asarray(want.g))
  compare(got, want, "extreme identity", secs)
  assert np.all(np.isfinite(np.asarray(got.gc_int))) and np.all(np.isfinite(np.asarray(got.gc_frac)))
  check_parts(got)
  check_scan_exact(got)


@pytest.mark.parametrize("form", ["softplus", "sigmoid", "sigmoid-noA"])
def test_extreme_raw_gates_and_huge_A(form):
  """Raw gates -inf, +inf, -1e30, -1e4 (align's neutralised padding value), -200, 40 and a NaN at one
  real token; A_log up to 20 (exp(A_log) ~ 5e8: most gates hit the floor). The NaN propagates down
  its chunk as in the reference, nothing else is NaN."""
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[100], HV=2, K=64, BT=BT, gate_kind="raw")
  r = np.random.RandomState(7)
  g = np.array(g)
  hit = r.rand(*g.shape) < 0.2
  g[hit] = r.choice([-np.inf, np.inf, -1e30, -1e4, -200.0, 40.0], size=int(hit.sum()))
  g[0, 10, 1, 3] = np.nan
  A_log = jnp.asarray([20.0, -3.0], jnp.float32)
  args, kw = form_args(form, jnp.asarray(g), valid, A_log, dt_bias)
  got, secs = run_kernel(args, kw)
  want = gate.reference.apply(*args, **kw)
  compare(got, want, f"extreme raw {form}", secs)
  nan = np.isnan(np.asarray(got.gc_frac[0]))
  assert nan[10:BT, 1, 3].all() and nan.sum() == BT - 10
  check_padding(got, valid, BT)


def test_columns_not_a_multiple_of_128():
  """HV * K = 96: `apply` pads the columns, the stage's predicate refuses (the padding costs copies)."""
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[30], HV=2, K=48, BT=BT, gate_kind="raw")
  args, kw = form_args("sigmoid", g, valid, A_log, dt_bias)
  got, _ = run_kernel(args, kw)
  compare(got, gate.reference.apply(*args, **kw), "HV2 K48")
  assert mgg.supports(*args, **kw) is None
  assert "multiple of 128" in mgg.takes(*args, **kw)


def test_supports_reasons():
  g = jnp.zeros((1, 128, 2, 64), jnp.float32)
  valid = jnp.ones((1, 128), bool)
  kw = dict(use_gate_in_kernel=True, lower_bound=None)
  A = jnp.zeros((2,))
  assert mgg.takes(g, valid, A, None, chunk_size=BT, **kw) is None
  assert "chunk_size" in mgg.takes(g, valid, A, None, chunk_size=32, **kw)
  assert "multiple of chunk_size" in mgg.supports(g[:, :100], valid[:, :100], A, None, chunk_size=BT, **kw)
  assert "float16" in mgg.supports(g.astype(jnp.float16), valid, A, None, chunk_size=BT, **kw)
  assert "A_log" in mgg.supports(g, valid, None, None, chunk_size=BT, **kw)
  assert "valid" in mgg.supports(g, valid[:, :64], A, None, chunk_size=BT, **kw)
  assert gate.STAGE.supports["mosaic_gpu"] is mgg.takes and gate.STAGE.mosaic_gpu is mgg.apply
  with pytest.raises(ValueError, match="A_log"):
    mgg.apply(g, valid, None, None, chunk_size=BT, interpret=True, **kw)
  with pytest.raises(ValueError, match="unroll"):
    mgg.Config(unroll=3)


LOWER = [(form, dtype, HV, K) for form in FORMS for dtype, HV, K in
         ((jnp.bfloat16, 16, 128), (jnp.float32, 2, 64))]


@pytest.mark.parametrize("form,dtype,HV,K", LOWER,
                         ids=[f"{f}-{jnp.dtype(d).name}-HV{hv}-K{k}" for f, d, hv, k in LOWER])
def test_kernel_lowers_for_cuda(form, dtype, HV, K):
  _lower(form, dtype, HV, K, None)


@pytest.mark.parametrize("config", [mgg.Config(stage_stores=True), mgg.Config(lane_semantics=True),
                                    mgg.Config(stage_stores=True, lane_semantics=True), mgg.Config(unroll=8)],
                         ids=["tma-stores", "lane", "tma-stores-lane", "unroll8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernel_configs_lower_for_cuda(config, dtype):
  _lower("softplus", dtype, 16, 128, config)


def _lower(form, dtype, HV, K, config):
  S = jax.ShapeDtypeStruct
  Ta = 32768 + 489 * BT
  args, kw = form_args(form, S((1, Ta, HV, K), dtype), S((1, Ta), jnp.bool_), S((HV,), jnp.float32),
                       S((HV * K,), jnp.float32))
  f = functools.partial(mgg.apply, config=config, **kw)
  lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
