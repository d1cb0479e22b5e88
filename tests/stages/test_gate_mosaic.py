"""The Mosaic GPU gate kernel against the gate reference: simulator runs on CPU and CUDA lowering.

Every activation form (no activation; softplus with A_log; lower_bound sigmoid with or without
A_log; dt_bias or not), bf16 and float32 gates, K = 64 and 128, HV * K = 128 and 256, padding rows
poisoned with NaN, and extreme gates (-inf, -1e30 ... -200, around the floor, a huge exp(A_log)).

What may differ from the reference (measured with -s, printed per case): g by a few ulp (the
kernel's own softplus: log1p from log and a series), gc_int not at all (integers), gc_frac by the
order of the float32 additions: the kernel sums the rows in sequence, XLA's cumsum in a tree. The
kernel's gc parts equal a float32 numpy sequential sum of split(its own g) bit for bit
(`check_scan_exact`), so nothing but that order hides inside the tolerance.

Packed mode (`mgg.packed`, test_packed_*): against `apply` on the aligned gates, bit for bit, with
tokens of no sequence (gaps, the tail after the last sequence) NaN; bounded against intra's
bounded_chunks of that result exactly, two_part against two_parts_needed(gc_int). The last chunk of a
sequence that ends within 64 rows of T reads past T (the boundaries case, T = 198; T = 3 < 64): the
simulator zero-fills such TMA loads at dynamic starts as the hardware does (a clamped start would
shift the real rows and fail the comparison).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.stages import gate
from kda.stages.gate import mosaic_gpu as mgg
from kda.stages.gate.mosaic_gpu import bounded_chunks, two_parts_needed
from tests.cases import aligned_layout
from tests.stages.test_gate import EXTREMES, check_padding, check_parts, extreme_gates, pooled_inputs
from tests.stages.test_output_mosaic import lowered_smem_bytes

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


@pytest.mark.parametrize("config", [mgg.Config(stage_stores=True), mgg.Config(unroll=1)],
                         ids=["tma-stores", "no-unroll"])
def test_kernel_configs(config):
  """Each Config field changes the lowered program and keeps the reference's results."""
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[50], HV=2, K=64, BT=BT, gate_kind="raw")
  g = jnp.where(valid[:, :, None, None], g, jnp.nan)
  args, kw = form_args("softplus", g, valid, A_log, dt_bias)
  assert _lower("softplus", jnp.float32, 2, 64, config) != _lower("softplus", jnp.float32, 2, 64, mgg.Config())
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
  """HV * K = 96: one thread per column takes whole groups of 128 columns; the predicate refuses
  (the pallas kernel takes these widths) and apply raises its reason."""
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[30], HV=2, K=48, BT=BT, gate_kind="raw")
  args, kw = form_args("sigmoid", g, valid, A_log, dt_bias)
  assert "multiple of 128" in mgg.supports(*args, **kw)
  with pytest.raises(ValueError, match="multiple of 128"):
    mgg.apply(*args, interpret=True, **kw)


def test_supports_reasons():
  g = jnp.zeros((1, 128, 2, 64), jnp.float32)
  valid = jnp.ones((1, 128), bool)
  kw = dict(use_gate_in_kernel=True, lower_bound=None)
  A = jnp.zeros((2,))
  assert mgg.supports(g, valid, A, None, chunk_size=BT, **kw) is None
  assert mgg.supports(g, valid, A, None, chunk_size=BT, config=mgg.Config(stage_stores=True), **kw) is None
  assert "chunk_size" in mgg.supports(g, valid, A, None, chunk_size=32, **kw)
  assert "multiple of chunk_size" in mgg.supports(g[:, :100], valid[:, :100], A, None, chunk_size=BT, **kw)
  assert "float16" in mgg.supports(g.astype(jnp.float16), valid, A, None, chunk_size=BT, **kw)
  assert "A_log" in mgg.supports(g, valid, None, None, chunk_size=BT, **kw)
  assert "valid" in mgg.supports(g, valid[:, :64], A, None, chunk_size=BT, **kw)
  assert gate.STAGE.mosaic_gpu is mgg
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


@pytest.mark.parametrize("config", [mgg.Config(stage_stores=True), mgg.Config(unroll=8)], ids=["tma-stores", "unroll8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernel_configs_lower_for_cuda(config, dtype):
  """The lowered kernel asks for the SMEM smem_bytes (the predicate's figure) gives."""
  _lower("softplus", dtype, 16, 128, config)
  S = jax.ShapeDtypeStruct
  args, kw = form_args("softplus", S((1, 4096, 16, 128), dtype), S((1, 4096), jnp.bool_), S((16,), jnp.float32),
                       S((16 * 128,), jnp.float32))
  smem = lowered_smem_bytes(functools.partial(mgg.apply, config=config, **kw), *args)
  assert smem == mgg.smem_bytes(dtype, config), smem


def _lower(form, dtype, HV, K, config):
  S = jax.ShapeDtypeStruct
  Ta = 32768 + 489 * BT
  args, kw = form_args(form, S((1, Ta, HV, K), dtype), S((1, Ta), jnp.bool_), S((HV,), jnp.float32),
                       S((HV * K,), jnp.float32))
  f = functools.partial(mgg.apply, config=config, **kw)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in txt
  return txt


# --- packed mode: the align folded into the kernel's load ----------------------------------------

def packed_layout(lens, gaps=None, extra_T=0, tail_chunks=0):
  """A padding.Layout of `lens` packed with gaps[n] free tokens before sequence n and extra_T after
  the last; the aligned side as tests/cases.aligned_layout builds it, plus `tail_chunks` chunks that
  nobody owns. -> (layout, valid [Ta] bool)."""
  gaps = gaps or [0] * len(lens)
  starts = np.cumsum(np.asarray(gaps) + np.concatenate([[0], lens[:-1]])).astype(np.int32)
  T = int(starts[-1] + lens[-1]) + extra_T
  acu, Ta, valid, _ = aligned_layout(lens, BT, tail_chunks)
  Ta = max(Ta, BT)
  layout = padding.Layout(jnp.asarray(starts), jnp.asarray(lens, jnp.int32), jnp.asarray(acu), T, Ta, BT)
  return layout, np.pad(valid, (0, Ta - len(valid)))


def packed_gates(seed, T, HV, K, dtype, kind):
  """Packed gates drawn like tests/cases.make_inputs: "plain" log-space gates (a few strong), "raw"
  pre-activation ones with A_log [HV] and dt_bias [HV*K], "small" gates in (-1, 0) (gc_int == 0)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  z = jax.random.normal(keys[0], (1, T, HV, K))
  A_log = jax.random.uniform(keys[1], (HV,), minval=-1.0, maxval=1.0)
  dt_bias = 0.5 * jax.random.normal(keys[2], (HV * K,))
  if kind == "plain":
    g = jax.nn.log_sigmoid(2.0 * z) / 2.0
    g = jnp.where(jax.random.uniform(keys[1], (1, T, HV, 1)) < 0.05, g * 8.0 - 1.0, g)
  elif kind == "small":
    g = -0.9 * jax.nn.sigmoid(z)
  else:
    g = 2.0 * z
  return g.astype(dtype), A_log, dt_bias


def aligned_want(layout, g, A_log, dt_bias, kw):
  """What `packed` must equal: `apply` on the aligned (and, raw, neutralised) gates, bounded_chunks."""
  valid = padding.valid_mask(layout)[None]
  ga = padding.align_with(layout, g)
  if kw["use_gate_in_kernel"]:
    ga = padding.neutralize_gate(ga, valid)
  want = jax.jit(functools.partial(mgg.apply, interpret=True, **kw))(ga, valid, A_log, dt_bias)
  return want, valid


def check_packed(layout, g, A_log, dt_bias, kw, label, config=None):
  owned = np.asarray(padding.packed_owned_mask(layout))
  assert not owned.all() or layout.T == int(np.sum(np.asarray(layout.lens)))
  g = jnp.where(owned[None, :, None, None], g, jnp.asarray(jnp.nan, g.dtype))   # tokens of no sequence
  rows = padding.chunk_rows(layout)
  f = jax.jit(functools.partial(mgg.packed, interpret=True, config=config, **kw))
  t0 = time.time()
  got = jax.block_until_ready(f(g, rows, A_log, dt_bias))
  secs = time.time() - t0
  want, valid = aligned_want(layout, g, A_log, dt_bias, kw)
  assert isinstance(got, mgg.PackedOut) and got.gc_int.shape == want.gc_int.shape
  for name in ("gc_int", "gc_frac"):
    a = np.asarray(getattr(got, name))
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, np.asarray(getattr(want, name)), name)
  bounded = np.asarray(bounded_chunks(want.gc_int, want.gc_frac))
  assert got.bounded.dtype == jnp.int32 and got.bounded.shape == bounded.shape
  np.testing.assert_array_equal(np.asarray(got.bounded), bounded, "bounded")
  assert got.two_part.dtype == jnp.int32 and got.two_part.shape == bounded.shape
  np.testing.assert_array_equal(np.asarray(got.two_part), np.asarray(two_parts_needed(want.gc_int)), "two_part")
  print(f"\n  packed {label} ({secs:.2f}s): T={layout.T} NTa={layout.NTa} bounded {bounded.sum()}/{bounded.size}"
        f" two_part {np.asarray(got.two_part).sum()}")
  return got, want


PACKED_CASES = [
    # id, lens, gaps, extra_T, tail_chunks, HV, K, dtype, form, kind
    # the last sequence's last chunk reads 64 rows from 59 before T (198, not a multiple of 8)
    ("boundaries-tail-plain-f32-HV2-K64", [1, 63, 64, 65], None, 5, 0, 2, 64, jnp.float32, "identity", "plain"),
    ("gaps-empty-softplus-bf16-HV1-K128", [17, 0, 40], [3, 2, 9], 6, 2, 1, 128, jnp.bfloat16, "softplus", "raw"),
    ("sigmoid-f32-HV2-K128", [70, 30], [0, 11], 3, 1, 2, 128, jnp.float32, "sigmoid", "raw"),
    ("sigmoid-noA-nobias-bf16-HV4-K64", [5, 64], None, 0, 0, 4, 64, jnp.bfloat16, "sigmoid-noA-nobias", "raw"),
    ("softplus-nobias-f32-HV2-K64-T3", [2], None, 1, 0, 2, 64, jnp.float32, "softplus-nobias", "raw"),
    ("small-f32-HV2-K64", [100, 20], [0, 4], 7, 0, 2, 64, jnp.float32, "identity", "small"),
]


PACKED_LARGE = ("sigmoid-f32-HV2-K128", "sigmoid-noA-nobias-bf16-HV4-K64")   # CI budget: on the device


@pytest.mark.parametrize("lens,gaps,extra_T,tail_chunks,HV,K,dtype,form,kind",
                         [pytest.param(*c[1:], marks=pytest.mark.large) if c[0] in PACKED_LARGE else c[1:]
                          for c in PACKED_CASES], ids=[c[0] for c in PACKED_CASES])
def test_packed_matches_aligned(lens, gaps, extra_T, tail_chunks, HV, K, dtype, form, kind):
  layout, _ = packed_layout(lens, gaps, extra_T, tail_chunks)
  g, A_log, dt_bias = packed_gates(len(lens) + HV, layout.T, HV, K, dtype, kind)
  (g, _, A_log, dt_bias), kw = form_args(form, g, None, A_log, dt_bias)
  kw = kw
  assert mgg.packed_supports(g, padding.chunk_rows(layout), A_log, dt_bias, **kw) is None
  got, _ = check_packed(layout, g, A_log, dt_bias, kw, f"lens={lens} {form}")
  assert bool(got.two_part.any()) == (kind != "small")
  if kind == "small":
    assert not np.any(np.asarray(got.gc_int)) and np.all(np.asarray(got.bounded) == 1)


def test_packed_empty_layout():
  """One empty sequence and three tokens of nobody (NaN, T < 64): zeros, bounded, one part."""
  layout, _ = packed_layout([0], extra_T=3)
  g, _, _ = packed_gates(0, layout.T, 2, 64, jnp.float32, "plain")
  got, _ = check_packed(layout, g, None, None, dict(chunk_size=BT, use_gate_in_kernel=False, lower_bound=None),
                        "empty")
  assert not np.any(np.asarray(got.gc_frac)) and not got.two_part.any() and np.all(np.asarray(got.bounded) == 1)


@pytest.mark.parametrize("form", ["identity", "softplus"])
def test_packed_extreme_gates(form):
  """Extreme gates (-inf, -1e30 ... -30, and +-inf, -1e4, a NaN for the raw form) in the second
  sequence's head 0 only: bounded holds 0 there, 1 elsewhere; two_part is True."""
  layout, _ = packed_layout([40, 100], [0, 5], extra_T=9)
  g, A_log, dt_bias = packed_gates(3, layout.T, 2, 64, jnp.float32, "plain" if form == "identity" else "raw")
  r = np.random.RandomState(11)
  g = np.array(g)
  hit = np.zeros(g.shape, bool)
  hit[0, 45:145, 0] = r.rand(100, 64) < 0.2
  values = EXTREMES if form == "identity" else (-np.inf, np.inf, -1e30, -1e4, -200.0, 40.0)
  g[hit] = r.choice(values, size=int(hit.sum()))
  if form == "softplus":
    g[0, 120, 0, 7] = np.nan    # a real token: its chunk (head 0) is not bounded
  (g, _, A_log, dt_bias), kw = form_args(form, jnp.asarray(g), None, A_log, dt_bias)
  got, _ = check_packed(layout, g, A_log, dt_bias, kw, f"extreme {form}")
  b = np.asarray(got.bounded).reshape(2, layout.NTa)
  assert b[1].all() and b[0, 0] == 1 and not b[0, 1:3].any(), b
  t = np.asarray(got.two_part).reshape(2, layout.NTa)
  assert t[0, 1:3].all(), t          # the extreme chunks need both parts (all of it: check_packed)


@pytest.mark.parametrize("config", [mgg.Config(stage_stores=True, unroll=8), mgg.Config(unroll=1)],
                         ids=["tma-stores-unroll8", "no-unroll"])
def test_packed_configs(config):
  layout, _ = packed_layout([30, 65], [2, 0], extra_T=4)
  g, A_log, dt_bias = packed_gates(5, layout.T, 2, 64, jnp.bfloat16, "raw")
  (g, _, A_log, dt_bias), kw = form_args("softplus", g, None, A_log, dt_bias)
  check_packed(layout, g, A_log, dt_bias, kw, f"{config}", config)


def test_packed_supports_reasons():
  g = jnp.zeros((1, 100, 2, 64), jnp.float32)
  rows = padding.ChunkRows(jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32))
  kw = dict(chunk_size=BT, use_gate_in_kernel=True, lower_bound=None)
  A = jnp.zeros((2,))
  assert mgg.packed_supports(g, rows, A, None, **kw) is None
  assert "chunk_size" in mgg.packed_supports(g, rows, A, None, **dict(kw, chunk_size=32))
  assert "float16" in mgg.packed_supports(g.astype(jnp.float16), rows, A, None, **kw)
  assert "A_log" in mgg.packed_supports(g, rows, None, None, **kw)
  assert "rows.src" in mgg.packed_supports(g, rows._replace(src=rows.src.astype(jnp.int16)), A, None, **kw)
  assert "rows.count" in mgg.packed_supports(g, rows._replace(count=rows.count[:2]), A, None, **kw)
  assert "T = 0" in mgg.packed_supports(g[:, :0], rows, A, None, **kw)
  assert "multiple of 128" in mgg.packed_supports(g[..., :48], rows, A, None, **kw)
  with pytest.raises(ValueError, match="A_log"):
    mgg.packed(g, rows, None, None, interpret=True, **kw)


# the packed kernel's loop is split at the six rows bounded_chunks reads (more code, slower to lower):
# the forms' variety over the two shapes, and the configs once each
LOWER_PACKED = [("identity", jnp.float32, 2, 64, None), ("softplus", jnp.bfloat16, 16, 128, None),
                ("sigmoid", jnp.bfloat16, 16, 128, None), ("sigmoid-noA-nobias", jnp.float32, 2, 64, None),
                ("softplus", jnp.bfloat16, 16, 128, mgg.Config(stage_stores=True)),
                ("sigmoid-nobias", jnp.float32, 2, 64, mgg.Config(unroll=1))]


@pytest.mark.parametrize("form,dtype,HV,K,config", LOWER_PACKED,
                         ids=[f"{f}-{jnp.dtype(d).name}-HV{hv}-K{k}" + ("" if c is None else "-cfg")
                              for f, d, hv, k, c in LOWER_PACKED])
def test_packed_lowers_for_cuda(form, dtype, HV, K, config):
  _lower_packed(form, dtype, HV, K, config)


def _lower_packed(form, dtype, HV, K, config):
  S = jax.ShapeDtypeStruct
  T, NTa = 32768 + 4093, 514 + 489          # T not a multiple of 8
  args, kw = form_args(form, S((1, T, HV, K), dtype), None, S((HV,), jnp.float32), S((HV * K,), jnp.float32))
  g, _, A_log, dt_bias = args
  rows = padding.ChunkRows(S((NTa,), jnp.int32), S((NTa,), jnp.int32))
  f = functools.partial(mgg.packed, config=config, **kw)
  lowered = jax.jit(f).trace(g, rows, A_log, dt_bias).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  if config is not None:      # the predicate's SMEM figure is the lowered kernel's
    assert lowered_smem_bytes(f, g, rows, A_log, dt_bias) == mgg.smem_bytes(dtype, config, packed=True)


def test_packed_unwritten_tail():
  """tail_zeros=False (simulator, whose unwritten memory is NaN): the rows of owned chunks are bit for
  bit tail_zeros=True's, the stats (bounded, two_part) the same; only the tail chunks' gc is left
  unwritten."""
  layout, _ = packed_layout([37, 64, 1], extra_T=2, tail_chunks=2)
  g, A_log, dt_bias = packed_gates(5, layout.T, 2, 64, jnp.float32, "plain")
  kw = dict(chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
  rows = padding.chunk_rows(layout)
  run = lambda tz: jax.jit(functools.partial(mgg.packed, interpret=True, tail_zeros=tz, **kw))(g, rows, None, None)
  full, skip = run(True), run(False)
  owned = int(layout.aligned_cu[-1])
  assert owned < layout.Ta                                      # the layout has tail chunks
  for name in ("gc_int", "gc_frac"):
    a, b = np.asarray(getattr(skip, name)), np.asarray(getattr(full, name))
    np.testing.assert_array_equal(a[:, :owned], b[:, :owned], name)
  assert np.isnan(np.asarray(skip.gc_frac)[:, owned:]).all()                # the tail's work skipped
  for name in ("bounded", "two_part"):
    np.testing.assert_array_equal(np.asarray(getattr(skip, name)), np.asarray(getattr(full, name)), name)
