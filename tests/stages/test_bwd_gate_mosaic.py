"""The Mosaic GPU bwd_gate kernel against the bwd_gate reference: simulator runs on CPU, CUDA
lowering, SMEM as lowered, the stage's predicate.

Inputs: test_gate.pooled_inputs' aligned layouts (raw gates for the activated forms, log-space ones
for use_gate_in_kernel=False) with padding rows after every sequence and a whole padding chunk
appended, the gate NaN at every padding row (its gradient must be exactly 0, never NaN); dgc and
dg_state random normal (bwd_setup.randn). Every activation form of test_gate_mosaic.FORMS, bf16 and
float32 gates, K = 64 and 128, HV * K = 128 and 256, and extreme gates (-inf, -1e30, around the
floor; raw +-inf, +-1e30, 40 with exp(A_log) up to 5e8, so that most softplus gates are floored).

What may differ from the reference: the reverse cumsum's order of float32 additions (the kernel adds
the rows in sequence, XLA's cumsum in a tree), the kernel's softplus (a few ulp) and the order of
the dA_log / ddt_bias sums. With use_gate_in_kernel=False the kernel's dg equals a float32 numpy
sequential reverse sum bit for bit (`check_scan_exact`), so nothing but that order hides inside the
tolerance; a forward cumsum, a missing dg_state or a missing live mask fail it by orders of
magnitude (test_tolerances_catch_wrong_formulas).
"""
from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import plan as planning
from kda.stages import bwd_gate, gate
from kda.stages.bwd_gate import mosaic_gpu as mgb
from tests.stages import bwd_setup
from tests.stages.test_gate import extreme_gates, pooled_inputs
from tests.stages.test_gate_mosaic import FORMS, form_args
from tests.stages.test_intra_mosaic import SMEM_TWO_CTAS
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
F32, BF16 = jnp.float32, jnp.bfloat16

# Kernel vs reference. dg: (the worst (chunk, head) block's max|d| / max|ref|, ||d|| / ||ref||);
# dA_log, ddt_bias: max|d| / max|ref|. Measured maxima over every case below (default and large) in
# the comments; the bounds keep 5x or more.
TOL = {
    "dg": (2e-6, 1e-6),      # measured 3.6e-7, 1.4e-7
    "dA_log": 3e-6,          # measured 5.3e-7
    "ddt_bias": 2e-6,        # measured 2.9e-7
}


def make_case(lens, HV, K, dtype, form, *, seed=60, pad_chunk=True, nan_padding=True):
  """(the stage's args, kw): pooled_inputs' aligned layout of `lens` plus (pad_chunk) a whole
  padding chunk, the gate NaN at padding rows (nan_padding), random dgc and dg_state."""
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(
      lens=lens, HV=HV, K=K, BT=BT, dtype=dtype, gate_kind="plain" if form == "identity" else "raw")
  if pad_chunk:
    g = jnp.concatenate([g, jnp.zeros((1, BT, HV, K), g.dtype)], axis=1)
    valid = jnp.concatenate([valid, jnp.zeros((1, BT), bool)], axis=1)
  if nan_padding:
    g = jnp.where(valid[:, :, None, None], g, jnp.asarray(jnp.nan, g.dtype))
  dgc, dg_state = bwd_setup.randn(seed, g.shape, g.shape)
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  return args + (dgc, dg_state), kw


@functools.lru_cache(maxsize=None)
def _kernel(kw_items, config=None):
  return jax.jit(functools.partial(mgb.apply, interpret=True, config=config, **dict(kw_items)))


def run_kernel(args, kw, config=None):
  t0 = time.time()
  out = jax.block_until_ready(_kernel(tuple(sorted(kw.items())), config)(*args))
  return out, time.time() - t0


def reference(args, kw):
  return jax.jit(functools.partial(bwd_gate.reference.apply, **kw))(*args)


def errors(got, want):
  """Per field TOL's metrics; a None field must be None in both."""
  out = {"dg": bwd_setup.block_errors(got, want, ("dg",))["dg"]}
  for name in ("dA_log", "ddt_bias"):
    a, b = getattr(got, name), getattr(want, name)
    assert (a is None) == (b is None), name
    if b is not None:
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      out[name] = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
  return out


def failures(errs):
  bad = []
  for name, e in errs.items():
    bound = TOL[name]
    e, bound = np.atleast_1d(e), np.atleast_1d(bound)
    if not np.all(e <= bound):       # NaN fails too
      bad.append(name)
  return bad


def fmt(errs):
  return ", ".join(f"{n} " + ("/".join(f"{x:.1e}" for x in np.atleast_1d(e))) for n, e in errs.items())


def compare(got, want, label, secs=None):
  for name in bwd_gate.Out._fields:
    x = getattr(got, name)
    if x is not None:
      assert x.dtype == F32 and x.shape == getattr(want, name).shape, (name, x.dtype, x.shape)
  errs = errors(got, want)
  print(f"\n  {label}" + (f" ({secs:.2f}s)" if secs is not None else "") + f": {fmt(errs)}")
  bad = failures(errs)
  assert not bad, f"{label}: {bad} beyond TOL: {fmt(errs)}"
  return errs


def check_zeros(got, args, kw):
  """dg is exactly 0 (not NaN) at padding rows and wherever the gate is not live (floored, NaN)."""
  g, valid, A_log, dt_bias = args[:4]
  act = gate.activate(g, A_log, dt_bias, use_gate_in_kernel=kw["use_gate_in_kernel"], lower_bound=kw["lower_bound"])
  live = np.asarray(valid[:, :, None, None] & gate.passes_floor(act))
  dg = np.asarray(got.dg)
  pad = ~np.asarray(valid[0])
  assert pad.any() and np.all(dg[0, pad] == 0), "dg is not exactly 0 at padding rows"
  assert np.all(dg[~live] == 0), "dg is not exactly 0 where the gate is not live"
  assert np.all(np.isfinite(dg)), "dg is not finite"


def check_scan_exact(got, args):
  """use_gate_in_kernel=False: dg == where(live, float32 sequential reverse chunk sum of dgc +
  dg_state, 0), bit for bit."""
  g, dgc, dgs = (np.asarray(args[i], np.float32) for i in (0, 4, 5))
  live = np.asarray(args[1])[0][:, None, None] & (g[0] >= gate.GATE_FLOOR)
  want = np.zeros_like(dgc[0])
  for c in range(g.shape[1] // BT):
    acc = np.zeros(g.shape[2:], np.float32)
    for t in reversed(range(c * BT, (c + 1) * BT)):
      acc = acc + dgc[0, t]
      want[t] = np.where(live[t], acc + dgs[0, t], np.float32(0))
  np.testing.assert_array_equal(np.asarray(got.dg[0]), want)


CASES = [
    # id, lens, HV, K, dtype, form; every case gets a whole padding chunk appended
    ("identity-f32-HV2-K64", [100, 20], 2, 64, F32, "identity"),
    ("identity-bf16-HV1-K128", [17, 0, 40], 1, 128, BF16, "identity"),
    ("softplus-f32-HV2-K128", [70], 2, 128, F32, "softplus"),
    ("softplus-bf16-HV2-K64", [1, 63], 2, 64, BF16, "softplus"),
    ("softplus-nobias-f32-HV1-K128", [130], 1, 128, F32, "softplus-nobias"),
    ("sigmoid-bf16-HV2-K128", [50], 2, 128, BF16, "sigmoid"),
    ("sigmoid-nobias-f32-HV2-K64", [40, 40], 2, 64, F32, "sigmoid-nobias"),
    ("sigmoid-noA-f32-HV2-K64", [64, 64], 2, 64, F32, "sigmoid-noA"),
    ("sigmoid-noA-nobias-bf16-HV1-K128", [90], 1, 128, BF16, "sigmoid-noA-nobias"),
]
LARGE = ("identity-bf16-HV1-K128", "softplus-nobias-f32-HV1-K128", "sigmoid-nobias-f32-HV2-K64",
         "softplus-bf16-HV2-K64", "sigmoid-noA-f32-HV2-K64")   # CI budget


@pytest.mark.parametrize("lens,HV,K,dtype,form",
                         [pytest.param(*c[1:], marks=pytest.mark.large) if c[0] in LARGE else c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_kernel_matches_reference(lens, HV, K, dtype, form):
  args, kw = make_case(lens, HV, K, dtype, form)
  got, secs = run_kernel(args, kw)
  compare(got, reference(args, kw), f"lens={lens} HV={HV} K={K} {jnp.dtype(dtype).name} {form}", secs)
  check_zeros(got, args, kw)
  if form == "identity":
    check_scan_exact(got, args)


@pytest.mark.parametrize("config", [mgb.Config(unroll=8), pytest.param(mgb.Config(unroll=1), marks=pytest.mark.large)],
                         ids=["unroll8", "no-unroll"])
def test_kernel_configs(config):
  """Config.unroll off its default: the outputs still match the reference (simulator)."""
  args, kw = make_case([50], 2, 64, F32, "softplus")
  got, secs = run_kernel(args, kw, config)
  compare(got, reference(args, kw), f"{config}", secs)
  check_zeros(got, args, kw)


def test_extreme_gates_identity():
  """Log-space gates with 15% of the entries extreme (-inf, -1e30, ..., -128, -127.5, -30): dg is
  exactly 0 below the floor (-inf included; -128 itself passes it), the exact sequential sum
  elsewhere."""
  args, kw = make_case([100, 20], 2, 64, F32, "identity")
  g = extreme_gates(args[0], 5)
  g = jnp.where(args[1][:, :, None, None], g, jnp.nan)
  args = (g,) + args[1:]
  assert np.any(np.isneginf(np.asarray(g))) and np.any(np.asarray(g) == gate.GATE_FLOOR)
  got, secs = run_kernel(args, kw)
  compare(got, reference(args, kw), "extreme identity", secs)
  check_zeros(got, args, kw)
  check_scan_exact(got, args)
  floored = np.asarray(args[1])[0][:, None, None] & (np.asarray(g)[0] < gate.GATE_FLOOR)
  assert floored.any() and not np.asarray(got.dg)[0][floored].any()


def extreme_raw(args, values, seed=7):
  """Raw gates with 20% of the real tokens' entries from `values` and a NaN at one real token;
  A_log [20, -3] (exp(20) ~ 5e8: most of head 0's softplus gates hit the floor)."""
  g, valid = np.array(args[0], np.float32), np.asarray(args[1])
  r = np.random.RandomState(seed)
  hit = (r.rand(*g.shape) < 0.2) & valid[:, :, None, None]
  g[hit] = r.choice(values, size=int(hit.sum()))
  g[0, 10, 1, 3] = np.nan
  A_log = None if args[2] is None else jnp.asarray([20.0, -3.0], F32)
  return (jnp.asarray(g).astype(args[0].dtype), args[1], A_log) + args[3:]


@pytest.mark.parametrize("form", ["softplus", "sigmoid", "sigmoid-noA"])
def test_extreme_raw_gates_and_huge_A(form):
  """Raw gates -inf, +inf, -1e30, 1e30, -1e4 (align's neutralised padding value), -200, 40 and a NaN
  at one real token: dg is finite, exactly 0 at the NaN token and wherever the gate is floored
  (softplus(x) = inf there: 0, not inf * 0). dA_log and ddt_bias finite, as the reference's: in the
  sigmoid form z = a * x = +-inf has dz = 0 and adds the limit 0 of z * s (1 - s), not inf * 0."""
  args, kw = make_case([100], 2, 64, F32, form)
  args = extreme_raw(args, [-np.inf, np.inf, -1e30, 1e30, -1e4, -200.0, 40.0])
  got, secs = run_kernel(args, kw)
  want = reference(args, kw)
  check_zeros(got, args, kw)
  assert np.asarray(got.dg)[0, 10, 1, 3] == 0
  for name in ("dA_log", "ddt_bias"):
    for out in (got, want):
      x = getattr(out, name)
      assert x is None or np.all(np.isfinite(np.asarray(x))), name
  compare(got, want, f"extreme raw {form}", secs)
  if form == "softplus":
    act = np.asarray(gate.activate(args[0], args[2], args[3], use_gate_in_kernel=True, lower_bound=None))
    assert (act[0, :100, 0] < gate.GATE_FLOOR).mean() > 0.5          # head 0 mostly floored


def test_columns_not_a_multiple_of_128():
  """HV * K = 96: `apply` pads the columns; the stage's predicate refuses (the padding costs copies)."""
  args, kw = make_case([30], 2, 48, F32, "sigmoid")
  got, secs = run_kernel(args, kw)
  compare(got, reference(args, kw), "HV2 K48", secs)
  check_zeros(got, args, kw)
  assert "multiple of 128" in mgb.supports(*args, **kw)


def test_tolerances_catch_wrong_formulas(monkeypatch):
  """TOL is tight enough: the kernel's outputs fail against references of subtly wrong formulas (a
  forward cumsum, no dg_state, no valid mask, no floor mask); the right formula passes. Softplus
  with A_log [20, -3] (head 0 mostly floored) and finite padding gates (else no mask gives NaN)."""
  args, kw = make_case([100, 20], 2, 64, F32, "softplus", nan_padding=False)
  args = extreme_raw(args, [-200.0, 40.0])
  args = (jnp.where(jnp.isnan(args[0]), 0.0, args[0]),) + args[1:]   # no NaN: every variant finite
  got, _ = run_kernel(args, kw)
  ref = functools.partial(bwd_gate.reference.apply, **kw)        # eager: the patches take effect
  assert not failures(errors(got, ref(*args)))
  g, valid, A_log, dt_bias, dgc, dgs = args
  variants = {
      "forward cumsum": lambda: (monkeypatch.setattr(bwd_gate.reference, "reverse_chunk_cumsum", gate.chunk_cumsum),
                                 ref(*args)),
      "no dg_state": lambda: (None, ref(g, valid, A_log, dt_bias, dgc, jnp.zeros_like(dgs))),
      "no valid mask": lambda: (None, ref(g, jnp.ones_like(valid), A_log, dt_bias, dgc, dgs)),
      "no floor mask": lambda: (monkeypatch.setattr(gate, "passes_floor", lambda x: jnp.ones(x.shape, bool)),
                                ref(*args)),
  }
  for label, variant in variants.items():
    want = variant()[1]
    monkeypatch.undo()
    errs = errors(got, want)
    print(f"\n  vs {label}: {fmt(errs)}")
    assert set(failures(errs)) == {"dg", "dA_log", "ddt_bias"}, (label, failures(errs))


def _abstract(Ta, HV, K, dtype=BF16, dgc=F32):
  S = jax.ShapeDtypeStruct
  return (S((1, Ta, HV, K), dtype), S((1, Ta), jnp.bool_), S((HV,), F32), S((HV * K,), F32),
          S((1, Ta, HV, K), dgc), S((1, Ta, HV, K), F32))


def test_supports():
  """`supports`, the stage's predicate: what the kernel can run, and HV * K a multiple of 128
  (`apply` itself pads other widths); float32 gates and any K (the kernel sees columns) are taken."""
  good = [jnp.zeros(s.shape, s.dtype) for s in _abstract(128, 2, 64)]
  kw = dict(chunk_size=BT, use_gate_in_kernel=True, lower_bound=None)
  assert mgb.supports(*good, **kw) is None and mgb.supports(*good, config=mgb.Config(), **kw) is None
  assert mgb.supports(good[0].astype(F32), *good[1:], **kw) is None     # float32 gates too (module docstring)
  assert mgb.supports(*_abstract(128, 1, 256), **kw) is None            # K = 256: two column groups per head
  assert bwd_gate.STAGE.mosaic_gpu is mgb
  with_ = lambda i, x: good[:i] + [x] + good[i + 1:]
  refused = {
      "chunk_size must be 64, got 32": (good, dict(kw, chunk_size=32)),
      "Ta must be a multiple of chunk_size 64, got 100": ([x[:, :100] if x.ndim > 1 else x for x in good], kw),
      "g must be bfloat16 or float32, got float16": (with_(0, good[0].astype(jnp.float16)), kw),
      "gate activation without lower_bound requires A_log [HV], got None": (with_(2, None), kw),
      "A_log must have shape (2,), got (1,)": (with_(2, good[2][:1]), kw),
      "dt_bias must have 128 elements, got shape (64,)": (with_(3, good[3][:64]), kw),
      "valid must have shape (1, 128), got (1, 64)": (with_(1, good[1][:, :64]), kw),
      "dgc must be float32[1, 128, 2, 64] (g's shape), got bfloat16": (with_(4, good[4].astype(BF16)), kw),
      "dg_state must be float32[1, 128, 2, 64] (g's shape), got float32[1, 128, 2, 32]": (
          with_(5, good[5][..., :32]), kw),
      "g must be [1, Ta, HV, K], got shape (2, 128, 2, 64)": ([jnp.concatenate([good[0], good[0]])] + good[1:], kw),
  }
  for reason, (args, kwargs) in refused.items():
    assert reason in (mgb.supports(*args, **kwargs) or ""), (reason, mgb.supports(*args, **kwargs))
    with pytest.raises(ValueError, match=re.escape(f"mosaic_gpu bwd_gate kernel: {reason}")):
      mgb.apply(*args, interpret=True, **kwargs)
  # without the activation A_log and dt_bias are not looked at; sigmoid needs no A_log
  assert mgb.supports(*with_(2, None), chunk_size=BT, use_gate_in_kernel=False, lower_bound=None) is None
  assert mgb.supports(*with_(2, None), chunk_size=BT, use_gate_in_kernel=True, lower_bound=-5.0) is None
  narrow = [jnp.zeros(s.shape, s.dtype) for s in _abstract(128, 2, 48)]
  assert "mosaic_gpu bwd_gate takes HV * K a multiple of 128" in mgb.supports(*narrow, **kw)
  with pytest.raises(ValueError, match="unroll"):
    mgb.Config(unroll=3)
  # the pipeline: an impl dict naming bwd_gate runs the kernel or raises the predicate's reason;
  # impl=None takes it on Hopper
  strict = planning.make_plan(scale=0.125, chunk_size=BT, use_gate_in_kernel=True, impl={"bwd_gate": "mosaic_gpu"})
  bkw = strict.stage_kwargs("bwd_gate")
  assert planning.choose(strict, "bwd_gate", *good, **bkw) == "mosaic_gpu"
  with pytest.raises(ValueError, match=r"impl\['bwd_gate'\] = 'mosaic_gpu': mosaic_gpu bwd_gate takes HV \* K"):
    planning.choose(strict, "bwd_gate", *narrow, **bkw)
  loose = planning.make_plan(scale=0.125, chunk_size=BT, use_gate_in_kernel=True, impl="mosaic_gpu")
  assert planning.choose(loose, "bwd_gate", *good, **bkw) == "mosaic_gpu"
  assert planning.choose(loose, "bwd_gate", *narrow, **bkw) == "reference"
  assert planning.default_impls(("bwd_gate",), "gpu", "sm90")["bwd_gate"] == "mosaic_gpu"


# -- CUDA lowering and SMEM --------------------------------------------------------------------------

LOWER = [(form, dtype, HV, K) for form in FORMS for dtype, HV, K in ((BF16, 16, 128), (F32, 2, 64))]


@pytest.mark.parametrize("form,dtype,HV,K",
                         [pytest.param(*c, marks=pytest.mark.large) if c[1] == F32 else c for c in LOWER],
                         ids=[f"{f}-{jnp.dtype(d).name}-HV{hv}-K{k}" for f, d, hv, k in LOWER])
def test_kernel_lowers_for_cuda(form, dtype, HV, K):
  _lower(form, dtype, HV, K, None)


def test_unroll_changes_the_program():
  """Config.unroll off its default gives another lowered program (CUDA); test_kernel_configs runs it."""
  assert _lower("softplus", BF16, 16, 128, mgb.Config(unroll=8)) != _lower("softplus", BF16, 16, 128, None)


def _lower(form, dtype, HV, K, config):
  """One Mosaic GPU kernel, lowered for CUDA from the CPU with 70000 chunks (on grid x) -> its text."""
  g, valid, A_log, dt_bias, dgc, dgs = _abstract(70000 * BT, HV, K, dtype)
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  f = functools.partial(mgb.apply, config=config, **kw)
  txt = jax.jit(f).trace(*args, dgc, dgs).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  return txt


@pytest.mark.parametrize("dtype,want", [(BF16, 82952), (F32, 99336)], ids=["bf16", "f32"])
def test_kernel_smem(dtype, want):
  """Two CTAs per SM: the g tile (bf16 16 KiB, f32 32 KiB), dgc and dg_state (2 x 32 KiB), the flags
  and a barrier, as lowered for CUDA and as `smem_bytes` computes it from the launcher's scratch;
  the same for every form and K."""
  kw = dict(chunk_size=BT, use_gate_in_kernel=True, lower_bound=None)
  smem = lowered_smem_bytes(functools.partial(mgb.apply, **kw), *_abstract(4096, 16, 128, dtype))
  print(f"\n  bwd_gate {jnp.dtype(dtype).name} g: SMEM {smem} bytes as lowered")
  assert smem <= SMEM_TWO_CTAS
  assert smem == want == mgb.smem_bytes(dtype)                  # the predicate's figure


@pytest.mark.large
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "sigmoid"])
def test_chunk_kda_grad_with_the_kernel(lower_bound):
  """kda.chunk_kda's gradient with impl={"bwd_gate": "mosaic_gpu"} (simulator) against the all-
  reference one, raw gates with A_log and dt_bias: the pipeline's wiring (the prepared gate, dgc,
  dg_state, the dA_log / ddt_bias reductions)."""
  import kda
  from tests import cases
  inp = cases.make_inputs(3, lens=[45, 80, 0, 20], H=2, HV=2, K=64, V=64, gate="raw")
  wo = jax.random.normal(jax.random.PRNGKey(9), inp.v.shape)

  def grads(impl):
    def loss(g, A_log, dt_bias):
      o, _ = kda.chunk_kda(inp.q, inp.k, inp.v, g, inp.beta, initial_state=inp.initial_state,
                           cu_seqlens=inp.cu_seqlens, chunk_size=BT, impl=impl, use_gate_in_kernel=True,
                           lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)
      return jnp.sum(o * wo)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(inp.g, inp.A_log, inp.dt_bias)

  got, want = grads({"bwd_gate": "mosaic_gpu"}), grads("reference")
  for name, a, b in zip(("dg", "dA_log", "ddt_bias"), got, want):
    bwd_setup.close(name, a, b, tol=1e-5)


# -- packed mode: g read packed, dg stored packed (the align and unalign in the kernel) -------------

PACKED = [
    # lens, gaps (free tokens before each sequence), tokens after the last, tail chunks, HV, K, g dtype, form
    ([1, 63, 64, 65], None, 5, 0, 2, 64, F32, "identity"),
    ([17, 0, 40], [3, 2, 140], 6, 2, 1, 128, BF16, "softplus"),
    ([70, 30], [0, 11], 3, 1, 2, 64, F32, "sigmoid"),
]


@pytest.mark.parametrize("lens,gaps,extra_T,tail,HV,K,dtype,form", PACKED,
                         ids=["boundaries-f32-identity", "gaps-empty-bf16-softplus", "sigmoid-f32"])
def test_packed_equals_aligned_unaligned(lens, gaps, extra_T, tail, HV, K, dtype, form):
  """`packed` on packed g (NaN at tokens of no sequence, including a 140-token gap: three pieces)
  equals `apply` on the aligned, neutralised g with dg unaligned and rounded to g's dtype, bit for
  bit; dg is exactly 0 at tokens of no sequence (never NaN), whatever the output buffer held."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_gates, packed_layout
  layout, _ = packed_layout(lens, gaps, extra_T, tail)
  g, A_log, dt_bias = packed_gates(len(lens) + 7 * HV, layout.T, HV, K, dtype, "plain" if form == "identity" else "raw")
  owned = np.asarray(padding.packed_owned_mask(layout))
  g = jnp.where(owned[None, :, None, None], g, jnp.asarray(jnp.nan, g.dtype))
  (g, _, A_log, dt_bias), kw = form_args(form, g, None, A_log, dt_bias)
  valid = padding.valid_mask(layout)[None]
  ga = padding.align_with(layout, g)
  if kw["use_gate_in_kernel"]:
    ga = padding.neutralize_gate(ga, valid)
  dgc, dgs = bwd_setup.randn(len(lens), ga.shape, ga.shape)
  rows = padding.chunk_rows(layout)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, BT)
  assert mgb.packed_supports(g, rows, pieces, A_log, dt_bias, dgc, dgs, **kw) is None
  got = jax.jit(functools.partial(mgb.packed, interpret=True, **kw))(g, rows, pieces, A_log, dt_bias, dgc, dgs)
  want = jax.jit(functools.partial(mgb.apply, interpret=True, **kw))(ga, valid, A_log, dt_bias, dgc, dgs)
  dg = np.asarray(got.dg.astype(F32))
  assert got.dg.dtype == g.dtype and got.dg.shape == g.shape
  np.testing.assert_array_equal(dg, np.asarray(padding.unalign_with(layout, want.dg).astype(g.dtype).astype(F32)))
  assert np.all(dg[:, ~owned] == 0) and (~owned).any()
  for name in ("dA_log", "ddt_bias"):
    a, b = getattr(got, name), getattr(want, name)
    assert (a is None) == (b is None)
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)


def test_packed_refuses():
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  layout, _ = packed_layout([30], extra_T=2)
  rows = padding.chunk_rows(layout)
  g = jnp.zeros((1, layout.T, 2, 64), F32)
  d = jnp.zeros((1, layout.Ta, 2, 64), F32)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, BT)
  kw = dict(chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
  assert mgb.packed_supports(g, rows, pieces, None, None, d, d, **kw) is None
  assert "dgc must be float32" in mgb.packed_supports(g, rows, pieces, None, None, d[:, :32], d, **kw)
  assert "pieces must be" in mgb.packed_supports(g, rows, pieces[0], None, None, d, d, **kw)
  with pytest.raises(ValueError, match="dg_state must be float32"):
    mgb.packed(g, rows, pieces, None, None, d, d.astype(BF16), **kw)


def test_packed_lowers_for_cuda():
  from kda import padding
  T, HV, K = 4096 * BT, 16, 128
  S = jax.ShapeDtypeStruct
  NTa = T // BT + 8
  rows = padding.ChunkRows(S((NTa,), jnp.int32), S((NTa,), jnp.int32))
  args = (S((1, T, HV, K), F32), rows, S((2, T // BT + 9), jnp.int32), S((HV,), F32), S((HV * K,), F32),
          S((1, NTa * BT, HV, K), F32), S((1, NTa * BT, HV, K), F32))
  f = functools.partial(mgb.packed, chunk_size=BT, use_gate_in_kernel=True, lower_bound=-5.0)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  assert lowered_smem_bytes(f, *args) == mgb.smem_bytes(F32, packed=True) == 98312   # no flags tile
