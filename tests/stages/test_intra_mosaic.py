"""The Mosaic GPU intra kernels (scores + gating; solve + WY) against the intra reference: simulator
runs on CPU and CUDA lowering.

q, k, v are bf16 and the reference gets the same bf16 values (upcast), so what is left is the
kernel's own rounding: bf16 level operands (k or q times a decay factor, 2^-9 relative), Akk's
hi + lo split (~2^-16), X's split in the solve, bf16 right-hand sides of w and u, and the bf16
store of every output (up to 2^-8 of each value). The store alone, bf16(reference) against the
reference, measures 2.2e-3 .. 3.4e-3 of the largest value per field on these cases; the kernel adds
at most about as much again (measured with -s, printed per case; TOL's comments give the maxima).
qg and kg are the reference's float32 values rounded once: bit for bit on the simulator.

Inputs (make_case): bf16 q, k (l2-normalised, or |q|, |k| in [1, 3]), padding rows (q = k = v =
beta = 0, gc flat) after every sequence and whole padding chunks, and gates from ordinary (all in
(-1, 0): gc_int == 0, so the launcher runs the gc_frac-only scores kernel and every chunk is
bounded) to strong (gc_int != 0: the two-part kernel; chunks with gates down to -1e30 and -inf,
floored at -128 by the gate stage, take the exact six-level path, the others the bounded one).
"""
from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding, pipeline
from kda import plan as planning
from kda.stages import gate, intra
from kda.stages.intra import mosaic_gpu as mgi
from tests.stages.test_gate import EXTREMES
from tests.stages.test_intra import check_padding
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
F32, BF16 = jnp.float32, jnp.bfloat16
SMEM_TWO_CTAS = 233472 // 2 - 1024   # 228 KiB per H100/H200 SM, 1 KiB reserved per CTA: 115712
SMEM_ONE_CTA = 232448                # the opt-in maximum of one CTA (227 KiB)
SMEM_THREE_CTAS = 233472 // 3 - 1024  # 76800

# Kernel vs reference, per field: (the worst (chunk, head) block's max|d| / max|ref|, ||d|| / ||ref||
# over the whole array), about 1.6x the maxima measured over every case below (both configs, all
# four head-dim pairs, large ones included). A wrong scale by 1% or one token's decay missing fails
# them (test_tolerances_catch_wrong_formulas).
TOL = {
    "Akk": (8e-3, 5e-3),      # measured 4.95e-3, 2.95e-3 (the store alone: 3.4e-3, 1.7e-3)
    "Aqk": (8e-3, 5e-3),      # measured 5.16e-3, 2.92e-3
    "Ainv": (1.2e-3, 3.5e-4),  # unit-norm k (|Akk| < 1, entries of Ainv ~<= 1): 6.9e-4, 1.84e-4
    "w": (7e-3, 4e-3),        # measured 4.44e-3, 2.39e-3
    "u": (9e-3, 4e-3),        # measured 5.61e-3, 2.46e-3
}
# |k| up to 3: Akk's entries up to 9 beta, so Ainv's grow and carry Akk's rounding further:
# measured 3.74e-3, 7.63e-4
TOL_NONUNIT = {"Ainv": (6e-3, 1.5e-3)}
EXACT = ("qg", "kg")          # bf16(reference) bit for bit: the same float32 exp and product

POOL_T, POOL_HV, POOL_D = 192, 2, 128


@functools.lru_cache(maxsize=None)
def _pool():
  """One draw at the largest shape, sliced by every case (jax.random compiles per shape)."""
  ks = jax.random.split(jax.random.key(5), 9)
  S = (1, POOL_T, POOL_HV, POOL_D)
  draw = dict(
      q=jax.random.normal(ks[0], S), k=jax.random.normal(ks[1], S), v=jax.random.normal(ks[2], S),
      beta=jax.nn.sigmoid(jax.random.normal(ks[3], S[:3])),
      z=jax.random.normal(ks[4], S),                                   # ordinary gates
      strong=jax.random.uniform(ks[5], S, minval=-5.0, maxval=-1.0),
      hit=jax.random.uniform(ks[6], S),
      pick=jax.random.randint(ks[7], S, 0, len(EXTREMES)),
      norm=jax.random.uniform(ks[8], S[:3] + (2,), minval=1.0, maxval=3.0),
  )
  return {n: np.asarray(x) for n, x in draw.items()}


@jax.jit
def _gc(g, valid):
  out = gate.reference.apply(g, valid, None, None, chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
  return out.gc_int, out.gc_frac


def make_case(lens, Ta, HV, K, V, gates="ordinary", unit=True):
  """Aligned intra inputs (q, k, v bf16; beta, gc_int, gc_frac float32) and the [Ta] real-token mask.

  lens: sequence n starts at the chunk boundary after sequence n-1 (align's layout), zeros elsewhere
  up to Ta (chunks past the last sequence are all padding). gates "ordinary": every gate in
  (-1, 0); "strong": on top of that, one chunk per head (chunk 1 of head 0, chunk 0 of head 1)
  gets 8% of its entries from test_gate.EXTREMES (-inf, -1e30, -1e4 ... -30) and one token at -30
  in every channel (not bounded), the other of chunks 0, 1 gets 10% in [-5, -1] (bounded: no 16
  tokens of a channel exceed 80), chunk 2 stays ordinary. The gate stage's reference (no activation)
  turns them into gc: floored at -128, flat over padding.
  unit: l2-normalised q, k (as use_qk_l2norm); else |q|, |k| in [1, 3].
  """
  p = _pool()
  valid = np.zeros(Ta, bool)
  start = 0
  for L in lens:
    valid[start:start + L] = True
    start += -(-L // BT) * BT
  assert start <= Ta
  sl = lambda x, d: x[:, :Ta, :HV, :d]
  q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (sl(p["q"], K), sl(p["k"], K)))
  if not unit:
    q, k = q * p["norm"][:, :Ta, :HV, :1], k * p["norm"][:, :Ta, :HV, 1:]
  g = -0.99 / (1.0 + np.exp(1.0 - sl(p["z"], K)))
  if gates == "strong":
    chunk = (np.arange(Ta) // BT)[None, :, None, None]
    head = np.arange(HV)[None, None, :, None]
    hit = sl(p["hit"], K)
    g = np.where((chunk == np.where(head == 0, 0, 1)) & (hit < 0.1), sl(p["strong"], K), g)
    g = np.where((chunk == np.where(head == 0, 1, 0)) & (hit < 0.08),
                 np.asarray(EXTREMES, np.float32)[sl(p["pick"], K)], g)
    g[:, BT + 20, 0] = -30.0
    if HV > 1:
      g[:, 20, 1] = -30.0
  elif gates != "ordinary":
    raise ValueError(gates)
  m = valid[None, :, None, None]
  q, k, v = (jnp.asarray(np.where(m, x, 0.0), BF16) for x in (q, k, sl(p["v"], V)))
  beta = jnp.asarray(np.where(valid[None, :, None], p["beta"][:, :Ta, :HV], 0.0), F32)
  gi, gf = _gc(jnp.asarray(g, F32), jnp.asarray(valid)[None])
  return (q, k, v, beta, gi, gf), valid


@functools.lru_cache(maxsize=None)
def _kernel(scale, config):
  return jax.jit(functools.partial(mgi.apply, scale=scale, chunk_size=BT, interpret=True, config=config))


@functools.lru_cache(maxsize=None)
def _reference(scale):
  return jax.jit(functools.partial(intra.reference.apply, scale=scale, chunk_size=BT))


def errors(got, want):
  """Per field (TOL's metrics): the worst (chunk, head) block's max|d| / max|ref| (a block whose
  reference is all 0 must be exactly 0: ratio 0 or inf), and ||d|| / ||ref||; for EXACT fields
  the number of elements that differ from bf16(reference)."""
  out = {}
  for name in intra.Out._fields:
    a = np.asarray(jnp.asarray(getattr(got, name), F32), np.float64)
    b = getattr(want, name)
    if name in EXACT:
      out[name] = int(np.sum(a != np.asarray(jnp.asarray(b, BF16).astype(F32), np.float64)))
      continue
    b = np.asarray(b, np.float64)
    d = np.abs(a - b)
    blocks = lambda x: x[0].reshape(-1, BT, *x.shape[2:]).swapaxes(1, 2).reshape(x.shape[1] // BT, x.shape[2], -1)
    dm, bm = blocks(d).max(-1), blocks(np.abs(b)).max(-1)
    ratio = np.where(bm > 0, dm / np.where(bm > 0, bm, 1.0), np.where(dm > 0, np.inf, 0.0))
    out[name] = (float(ratio.max()), float(np.linalg.norm(d) / max(np.linalg.norm(b), 1e-30)))
  return out


def failures(errs, unit=True):
  """The fields whose errors exceed TOL (EXACT fields: any element off)."""
  tol = dict(TOL, **({} if unit else TOL_NONUNIT))
  return [n for n, e in errs.items()
          if (e != 0 if n in EXACT else not (e[0] <= tol[n][0] and e[1] <= tol[n][1]))]   # NaN fails


def worst(got, want, name):
  """Where field `name` is furthest off: token, head, column, both values."""
  a = np.asarray(jnp.asarray(getattr(got, name), F32), np.float64)[0]
  b = np.asarray(jnp.asarray(getattr(want, name), F32), np.float64)[0]
  t, h, j = np.unravel_index(np.argmax(np.abs(a - b)), a.shape)
  return (f"{name} worst at token {t} (chunk {t // BT}, row {t % BT}), head {h}, column {j}: "
          f"got {a[t, h, j]:.7g}, want {b[t, h, j]:.7g}")


def fmt(errs):
  return ", ".join(f"{n} {e} off" if n in EXACT else f"{n} {e[0]:.2e}/{e[1]:.2e}" for n, e in errs.items())


SHAPES = {
    # id: lens, Ta, HV, K, V; Ta = 3 chunks, padding rows in each, a whole padding chunk in two
    "K64-V64-HV2-100_20": ([100, 20], 192, 2, 64, 64),
    "K128-V128-HV1-64_50": ([64, 50], 192, 1, 128, 128),
    "K64-V128-HV2-130": ([130], 192, 2, 64, 128),
    "K128-V64-HV1-40_64": ([40, 64], 192, 1, 128, 64),
    "K64-V64-HV1-50": ([50], 64, 1, 64, 64),      # one chunk: the cheapest simulator run
}


def run_case(shape, gates, unit, bounded="auto", approx_math=True):
  """(args, valid, kernel Out, reference Out, kernel seconds); run once per case, compiled once per
  shape and config."""
  return _run_case(shape, gates, unit, bounded, approx_math)


@functools.lru_cache(maxsize=None)
def _run_case(shape, gates, unit, bounded, approx_math):
  lens, Ta, HV, K, V = SHAPES[shape]
  args, valid = make_case(lens, Ta, HV, K, V, gates, unit)
  scale = K ** -0.5
  f = _kernel(scale, mgi.Config(bounded=bounded, approx_math=approx_math))
  t0 = time.time()
  got = jax.block_until_ready(f(*args))
  secs = time.time() - t0
  return args, valid, got, _reference(scale)(*args), secs


# (shape, gates, unit, bounded). The default run compiles 6 (shape, config) pairs: every scores
# kernel variant (gc_frac-only or two-part, bounded="auto" or exact-only "never"; K = 64 and 128)
# and every solve (K, V) runs at least once; the rest of the matrix is marked large.
DEFAULT = {
    ("K64-V64-HV2-100_20", "ordinary", True, "auto"), ("K64-V64-HV2-100_20", "strong", True, "auto"),
    ("K64-V64-HV2-100_20", "ordinary", True, "never"), ("K64-V64-HV2-100_20", "strong", True, "never"),
    ("K128-V128-HV1-64_50", "ordinary", False, "auto"), ("K128-V128-HV1-64_50", "strong", True, "auto"),
    ("K128-V128-HV1-64_50", "ordinary", True, "never"), ("K128-V128-HV1-64_50", "strong", True, "never"),
    ("K64-V128-HV2-130", "strong", True, "auto"),
    ("K128-V64-HV1-40_64", "ordinary", True, "auto"), ("K128-V64-HV1-40_64", "strong", False, "auto"),
}
MATRIX = [(s, g, u, b) for s in list(SHAPES)[:4] for g in ("ordinary", "strong") for u in (True, False)
          for b in ("auto", "never")]


@pytest.mark.parametrize(
    "shape,gates,unit,bounded",
    [pytest.param(*c, marks=() if c in DEFAULT else pytest.mark.large) for c in MATRIX],
    ids=[f"{s}-{g}-{'unit' if u else 'nonunit'}-{b}" for s, g, u, b in MATRIX])
def test_kernel_matches_reference(shape, gates, unit, bounded):
  args, valid, got, want, secs = run_case(shape, gates, unit, bounded)
  gi = np.asarray(args[4])
  flags = np.asarray(mgi.bounded_chunks(args[4], args[5]))
  errs = errors(got, want)
  print(f"\n  {shape} {gates} unit={unit} bounded={bounded} ({secs:.2f}s) flags={flags.tolist()}\n    {fmt(errs)}")
  # the inputs exercise what their names say
  assert np.any(gi != 0) == (gates == "strong")
  assert flags.all() if gates == "ordinary" else (0 < flags.sum() < flags.size)
  for name in intra.Out._fields:
    x, w = getattr(got, name), getattr(want, name)
    assert x.dtype == BF16 and x.shape == w.shape, (name, x.dtype, x.shape)
    assert bool(jnp.all(jnp.isfinite(x))), f"{name}: not finite"
  bad = failures(errs, unit)
  assert not bad, f"{bad} beyond TOL: {fmt(errs)}; " + "; ".join(worst(got, want, n) for n in bad)
  check_padding(got, valid, BT)


def test_whole_padding_chunks_are_exact():
  """A chunk no sequence reaches: Akk, Aqk, w, u, qg, kg exactly 0, Ainv exactly the identity."""
  for shape, unit in (("K128-V128-HV1-64_50", False), ("K128-V64-HV1-40_64", True)):
    _, valid, got, _, _ = run_case(shape, "ordinary", unit)
    assert not valid[2 * BT:].any()
    for name in intra.Out._fields:
      x = np.asarray(getattr(got, name)[0, 2 * BT:], np.float32)
      want = np.eye(BT)[:, None, :] if name == "Ainv" else 0.0
      np.testing.assert_array_equal(x, np.broadcast_to(want, x.shape), name)


def test_chunks_past_aligned_cu_are_only_zero_filled():
  """aligned_cu: chunks at or past aligned_cu[-1] (the tail of a static-bound layout) are written as
  zeros and an identity Ainv without reading their inputs (NaN here); every other chunk keeps the
  bits of the call without aligned_cu."""
  (q, k, v, beta, gi, gf), valid, plain, _, _ = run_case("K128-V128-HV1-64_50", "strong", True)
  tail = jnp.arange(q.shape[1]) >= 2 * BT
  assert not valid[2 * BT:].any()
  poison = lambda x: jnp.where(tail.reshape((1, -1) + (1,) * (x.ndim - 2)), jnp.nan, x).astype(x.dtype)
  aligned_cu = jnp.asarray([0, BT, 2 * BT], jnp.int32)
  f = _kernel(128 ** -0.5, mgi.Config())
  got = jax.block_until_ready(f(*map(poison, (q, k, v, beta, gi, gf)), aligned_cu))
  for name in intra.Out._fields:
    x, y = (np.asarray(getattr(o, name)[0], np.float32) for o in (got, plain))
    np.testing.assert_array_equal(x[:2 * BT], y[:2 * BT], name)
    want = np.eye(BT)[:, None, :] if name == "Ainv" else 0.0
    np.testing.assert_array_equal(x[2 * BT:], np.broadcast_to(want, x[2 * BT:].shape), name)


def test_bounded_path_runs_where_flagged():
  """Per (head, chunk): with bounded="auto" a flagged chunk takes the two-level path (Akk, Aqk differ
  from the exact path's bits), an unflagged one the exact path (the same bits as bounded="never").
  HV = 2 with different flags per head: the kernel reads the flags in bounded_chunks' order."""
  args, _, auto, _, _ = run_case("K64-V64-HV2-100_20", "strong", True, "auto")
  _, _, never, _, _ = run_case("K64-V64-HV2-100_20", "strong", True, "never")
  flags = np.asarray(mgi.bounded_chunks(args[4], args[5])).reshape(2, -1)     # [HV, NTa]
  assert flags.tolist() == [[1, 0, 1], [0, 1, 1]]
  for name in ("Akk", "Aqk"):
    a, b = (np.asarray(getattr(o, name)[0], np.float32).reshape(-1, BT, 2, BT) for o in (auto, never))
    for h in range(2):
      for c in range(flags.shape[1]):
        same = np.array_equal(a[c, :, h], b[c, :, h])
        assert same == (flags[h, c] == 0), (name, h, c, flags[h, c])


@pytest.mark.large
def test_gc_frac_kernel_computes_the_same_bits():
  """Ordinary gates (gc_int == 0): the scores kernel on gc_frac alone (what the launcher's cond takes
  there) equals the two-part one bit for bit, as the module docstring says."""
  (q, k, v, beta, gi, gf), _ = make_case([100, 20], 192, 2, 64, 64)
  assert not np.any(np.asarray(gi))
  flag = mgi.bounded_chunks(gi, gf)
  run = jax.jit(lambda *gis: mgi.scores.launch(jnp.array([0, 192], jnp.int32), None, q[0], k[0],
                                               beta[0].T, gis, flag, scale=0.125, bounded=True,
                                               approx_math=True, interpret=True))
  for a, b in zip(run(gf[0]), run(gi[0], gf[0])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_tolerances_catch_wrong_formulas():
  """TOL is tight enough: the kernel's outputs fail against the reference of a subtly wrong
  formula (a 1% scale, one token's decay missing or 10% off, one token's beta missing)."""
  (q, k, v, beta, gi, gf), _, got, want, _ = run_case("K64-V64-HV2-100_20", "ordinary", True)
  assert not failures(errors(got, want))
  scale = 64 ** -0.5

  def ref(scale=scale, **changed):
    args = dict(dict(q=q, k=k, v=v, beta=beta, gi=gi, gf=gf), **changed)
    return _reference(scale)(*args.values())

  t = 10                                        # a token of chunk 0: its gate is gc[t] - gc[t - 1]
  g_t = gf[:, t] - gf[:, t - 1]
  after = (jnp.arange(gf.shape[1]) >= t) & (jnp.arange(gf.shape[1]) < BT)
  shifted = lambda x: gf - jnp.where(after[None, :, None, None], x[:, None], 0.0)
  wrong = {
      "scale x 1.01": (ref(scale=scale * 1.01), {"Aqk"}),
      "decay of one token missing": (ref(gf=shifted(g_t)), {"Akk", "Aqk", "w", "qg", "kg"}),
      "one token's gate 10% off": (ref(gf=shifted(0.1 * g_t)), {"Akk", "Aqk", "qg", "kg"}),
      "beta of one token missing": (ref(beta=beta.at[0, 30, 0].set(1.0)), {"Akk", "u"}),
  }
  for label, (bad, must_fail) in wrong.items():
    errs = errors(got, bad)
    print(f"\n  vs {label}: {fmt(errs)}")
    assert must_fail <= set(failures(errs)), (label, failures(errs))


def test_bounded_chunks_flags_crafted_spans():
  """1 where every 16-token half of both 32-token blocks spans <= 80 of gc in every channel.

  [HV = 2, NTa = 4] chunks, one gate pattern each. The halves of tokens 0 ... 31 span gc_0 - gc_16
  (gates 1 ... 16) and gc_16 - gc_31 (gates 17 ... 31), likewise from token 32, so the gate of a
  32-token block's first token is in no span."""
  HV, NTa, K = 2, 4, 64
  g = np.full((1, NTa * BT, HV, K), -0.01, np.float32)
  at = lambda h, c, rows, ch, val: g.__setitem__((0, c * BT + np.asarray(rows), h, ch), val)
  at(0, 1, np.arange(33, 49), 3, -81 / 16)      # a 16-token span of 81 in the second block  -> 0
  at(0, 2, np.arange(33, 49), 3, -79 / 16)      # 79                                           -> 1
  g[0, 3 * BT:4 * BT, 0, :] = -5.0              # safe_gate's worst case everywhere: spans of 80 -> 1
  at(1, 0, [0, 32], 5, -81.0)                   # -81 at both blocks' first tokens (gc_int -81, -162) -> 1
  at(1, 1, [16], 5, -81.0)                      # -81 at the first half's last gate (gc_15 - gc_16)   -> 0
  at(1, 2, [20], 0, np.nan)                     # a NaN gate                                   -> 0
  at(1, 3, np.arange(9, 25), 7, -81 / 16)       # 81 over 16 tokens split by the middle: 40.5 each -> 1
  gi, gf = _gc(jnp.asarray(g), jnp.ones((1, NTa * BT), bool))
  assert float(jnp.min(gi)) <= -162
  flags = np.asarray(mgi.bounded_chunks(gi, gf))
  assert flags.dtype == np.int32 and flags.shape == (HV * NTa,)
  assert flags.reshape(HV, NTa).tolist() == [[1, 0, 1, 1], [1, 0, 0, 1]]


def _abstract(Ta, HV, K, V, dtype=BF16):
  S = jax.ShapeDtypeStruct
  return (S((1, Ta, HV, K), dtype), S((1, Ta, HV, K), dtype), S((1, Ta, HV, V), dtype), S((1, Ta, HV), F32),
          S((1, Ta, HV, K), F32), S((1, Ta, HV, K), F32))


def test_supports():
  kw = dict(scale=0.125, chunk_size=BT)
  good = [jnp.zeros(s.shape, s.dtype) for s in _abstract(128, 2, 64, 128)]
  q, k, v, beta, gi, gf = good
  assert mgi.supports(*good, **kw) is None and mgi.supports(*good, config=mgi.Config(bounded="never"), **kw) is None
  assert intra.STAGE.mosaic_gpu is mgi
  f32 = [x.astype(F32) for x in (q, k, v)]
  why = mgi.supports(*f32, beta, gi, gf, **kw)
  assert "bfloat16" in why and all(f"{n} float32" in why for n in ("q", "k", "v")), why
  why = mgi.supports(q, f32[1], v, beta, gi, gf, **kw)
  assert "k float32" in why and "q " not in why and "v " not in why, why
  assert "v float16" in mgi.supports(q, k, v.astype(jnp.float16), beta, gi, gf, **kw)
  zeros = lambda *shape: [jnp.zeros(s.shape, s.dtype) for s in _abstract(*shape)]
  refused = {
      "chunk_size must be 64, got 32": (good, dict(kw, chunk_size=32)),
      "K must be one of (64, 128), got 96": (zeros(128, 2, 96, 64), kw),
      "K must be one of (64, 128), got 256": (zeros(64, 1, 256, 64), kw),
      "v must be [1, Ta, HV, V] with V in": ([q, k, v[..., :96], beta, gi, gf], kw),
      "Ta must be a multiple of 64, got 100": ([x[:, :100] for x in good], kw),
      "k must be [1, Ta, HV, K]": ([jnp.concatenate([x, x]) for x in good], kw),
      "q must have shape": ([q[:, :64], k, v, beta, gi, gf], kw),
      "gc_frac must have shape": ([q, k, v, beta, gi, gf[..., :1, :]], kw),
      "beta must have shape": ([q, k, v, beta[..., :1], gi, gf], kw),
  }
  for reason, (args, kwargs) in refused.items():
    assert reason in (mgi.supports(*args, **kwargs) or ""), (reason, mgi.supports(*args, **kwargs))
    with pytest.raises(ValueError, match=re.escape(f"mosaic_gpu intra kernel: {reason}")):
      mgi.apply(*args, interpret=True, **kwargs)
  # the pipeline: an impl dict naming intra raises the predicate's reason, impl=None falls back
  strict = planning.make_plan(scale=0.125, chunk_size=BT, impl={"intra": "mosaic_gpu"})
  with pytest.raises(ValueError, match=r"impl\['intra'\] = 'mosaic_gpu': mosaic_gpu intra takes bfloat16"):
    planning.choose(strict, "intra", *f32, beta, gi, gf, **kw)
  assert planning.choose(strict, "intra", *good, **kw) == "mosaic_gpu"
  auto = pipeline.Plan(0.125, BT, False, False, None, (("intra", "mosaic_gpu"),), True, chained=("intra",),
                       platform="gpu", generation="sm90")
  assert planning.choose(auto, "intra", *f32, beta, gi, gf, **kw) == "pallas"


def test_config_rejects_bad_values():
  for field, value in (("bounded", "always"),):
    with pytest.raises(ValueError, match=field):
      mgi.Config(**{field: value})


def test_smem_reason_names_the_figures():
  """A kernel asking for more SMEM than one block may have is refused with both figures."""
  from kda import _mosaic_gpu
  assert _mosaic_gpu.smem_reason(_mosaic_gpu.SMEM_LIMIT) is None
  assert _mosaic_gpu.smem_reason(344064) == "needs 344064 bytes of shared memory, the limit is 232448"


LOWER = [(K, V, bounded, approx) for K in (64, 128) for V in (64, 128)
         for bounded, approx in (("auto", True), ("never", True), ("auto", False))]
# ~2 s per scores kernel lowered: all large (the default run lowers every kernel for its SMEM:
# test_scores_kernel_smem, test_solve_kernel_smem; the packed apply: test_packed_kernels_lower_for_cuda)


@pytest.mark.large
@pytest.mark.parametrize("K,V,bounded,approx", LOWER,
                         ids=[f"K{K}-V{V}-bounded_{b}{'' if a else '-exact_exp'}" for K, V, b, a in LOWER])
def test_kernels_lower_for_cuda(K, V, bounded, approx):
  """Both kernels lower for CUDA from the CPU: the gc_frac-only and the two-part scores kernels (the
  launcher's cond) and the solve; 70000 chunks (grid x takes the chunks, y the heads) and
  aligned_cu, as the pipeline calls it."""
  config = mgi.Config(bounded=bounded, approx_math=approx)
  f = functools.partial(mgi.apply, scale=K ** -0.5, chunk_size=BT, config=config)
  args = _abstract(70000 * BT, 2, K, V) + (jax.ShapeDtypeStruct((5,), jnp.int32),)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [l for l in txt.splitlines() if "stablehlo.custom_call @mosaic_gpu" in l]
  assert len(calls) == 3, len(calls)


@functools.lru_cache(maxsize=None)
def _scores_text(config):
  """The one-part scores kernel at K = 64, lowered for CUDA with `config`'s fields."""
  S, Ta, HV, K = jax.ShapeDtypeStruct, 1024, 2, 64
  f = lambda cu, q, k, beta_t, flag, gf: mgi.scores.launch(
      cu, None, q, k, beta_t, (gf,), flag, scale=0.125, bounded=config.bounded == "auto",
      approx_math=config.approx_math, interpret=False)
  args = (S_CU, S((Ta, HV, K), BF16), S((Ta, HV, K), BF16), S((HV, Ta), F32), S((HV * Ta // BT,), jnp.int32),
          S((Ta, HV, K), F32))
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("field,value", [("bounded", "never"), ("approx_math", False)])
def test_config_field_changes_the_program(field, value):
  """Each Config field gives another lowered program and still the reference's results (the
  simulator, on one chunk; bounded="never" also runs in test_kernel_matches_reference's matrix)."""
  flipped = mgi.Config(**{field: value})
  assert _scores_text(flipped) != _scores_text(mgi.Config())
  _, _, got, want, _ = run_case("K64-V64-HV1-50", "ordinary", True, **{field: value})   # one chunk: cheap
  errs = errors(got, want)
  assert not failures(errs), fmt(errs)


S_TA, S_HV = 4096, 16
S_CU = jax.ShapeDtypeStruct((3,), jnp.int32)   # aligned_cu, the kernels' first operand


def _scores_smem(K, parts, bounded=True):
  S, Ta, HV = jax.ShapeDtypeStruct, S_TA, S_HV
  f = lambda cu, q, k, beta_t, flag, *gis: mgi.scores.launch(cu, None, q, k, beta_t, gis, flag, scale=K ** -0.5,
                                                             bounded=bounded, approx_math=True, interpret=False)
  return lowered_smem_bytes(f, S_CU, S((Ta, HV, K), BF16), S((Ta, HV, K), BF16), S((HV, Ta), F32),
                            S((HV * Ta // BT,), jnp.int32), *[S((Ta, HV, K), F32)] * parts)


@pytest.mark.parametrize("K", [64, 128])
def test_scores_kernel_smem(K):
  """The gc_frac-only scores kernel fits two CTAs per SM up to K = 128 (114696 bytes there as
  lowered); the two-part one (a second float32 gc tile, strong gates) fits one CTA at K = 128
  (147464 bytes). scores.smem_bytes (the predicate's figure) is what the lowering asks for."""
  one, two = _scores_smem(K, 1), _scores_smem(K, 2)
  print(f"\n  scores K={K}: SMEM {one} bytes (gc_frac only), {two} bytes (two parts)")
  assert one == mgi.scores.smem_bytes(K, two_part=False) and two == mgi.scores.smem_bytes(K, two_part=True)
  assert one <= SMEM_TWO_CTAS and _scores_smem(K, 1, bounded=False) == one
  assert two <= SMEM_ONE_CTA


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (64, 128), (128, 64)])
def test_solve_kernel_smem(K, V):
  """The solve keeps Akk's split and X in SMEM: two CTAs per SM up to K = V = 128 (82952 bytes
  there); solve.smem_bytes (the predicate's figure) is what the lowering asks for."""
  S, Ta, HV = jax.ShapeDtypeStruct, S_TA, S_HV
  f = lambda cu, *a: mgi.solve.launch(cu, None, *a, approx_math=True, interpret=False)
  args = (S_CU, S((Ta, HV, BT), BF16), S((Ta, HV, BT), BF16), S((Ta, HV, K), BF16), S((Ta, HV, V), BF16),
          S((HV, Ta), F32))
  smem = lowered_smem_bytes(f, *args)
  print(f"\n  solve K={K} V={V}: SMEM {smem} bytes")
  assert smem == mgi.solve.smem_bytes(K, V) <= SMEM_TWO_CTAS
  assert mgi.smem_bytes(K, V) == max(smem, mgi.scores.smem_bytes(K, two_part=True))


# -- packed inputs: the align folded into the kernels' loads (mgi.packed) ---------------------------

def _packed_case(lens, T, HV, K, V, seed, gates):
  """Packed bf16 q, k, v and beta with NaN at the tokens after the last sequence (no sequence owns
  them: nothing may read them into a result), the layout, and gc of the aligned gates."""
  ks = jax.random.split(jax.random.key(seed), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(jax.random.normal(ks[0], (1, T, HV, K))), unit(jax.random.normal(ks[1], (1, T, HV, K)))
  v = jax.random.normal(ks[2], (1, T, HV, V))
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (1, T, HV)))
  g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (1, T, HV, K))) * (40.0 if gates == "strong" else 0.25)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  none = (jnp.arange(T) >= cu[-1])[None, :, None]
  q, k, v = (jnp.where(none[..., None], jnp.nan, x).astype(BF16) for x in (q, k, v))
  beta = jnp.where(none, jnp.nan, beta)
  layout = padding.layout_from_cu_seqlens(jnp.asarray(cu), T, BT)
  gi, gf = _gc(padding.align_with(layout, g), padding.valid_mask(layout)[None])
  return (q, k, v, beta), layout, (gi, gf)


PACKED = {
    # lens, T, HV, K, V, gates: boundaries 1/63/64/65, an empty sequence, NaN tokens after the last
    # one, T not a multiple of 8, loads running past T (the last chunk of the last sequence)
    "K64-V64-HV2": ([37, 0, 64, 65, 1], 200, 2, 64, 64, "ordinary"),
    "K128-V128-HV1-strong": ([100, 63], 163, 1, 128, 128, "strong"),
}


@functools.lru_cache(maxsize=None)
def _packed_run(name, defer=False):
  """mgi.packed on PACKED[name]'s case (seed 3): the simulator runs each once per worker."""
  lens, T, HV, K, V, gates = PACKED[name]
  (q, k, v, beta), layout, (gi, gf) = _packed_case(lens, T, HV, K, V, 3, gates)
  return jax.jit(functools.partial(mgi.packed, scale=K ** -0.5, chunk_size=BT, interpret=True, defer=defer))(
      q, k, v, beta, gi, gf, layout.aligned_cu, padding.chunk_rows(layout))


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_equals_aligned(name):
  """mgi.packed on packed inputs gives what mgi.apply gives on the aligned ones (align_with), up to
  float32 rounding of differently compiled code; rows of padding exact zeros (Ainv: identity)."""
  lens, T, HV, K, V, gates = PACKED[name]
  (q, k, v, beta), layout, (gi, gf) = _packed_case(lens, T, HV, K, V, 3, gates)
  al = lambda x: padding.align_with(layout, x)
  scale = K ** -0.5
  want = jax.jit(functools.partial(mgi.apply, scale=scale, chunk_size=BT, interpret=True))(
      al(q), al(k), al(v), al(beta), gi, gf, layout.aligned_cu)
  got = _packed_run(name)
  for f in intra.Out._fields:
    a, b = (np.asarray(jnp.asarray(getattr(x, f), F32)) for x in (got, want))
    assert a.shape == b.shape and np.isfinite(a).all(), f
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), (f, np.abs(a - b).max())


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_packed_kernels_lower_for_cuda(K, V):
  """The packed kernels lower: TMA at any packed row into plain SMEM (q, k in a RefUnion with the
  level operands), beta read from GMEM."""
  S, T, HV = jax.ShapeDtypeStruct, 4000, 2
  Ta = 8192
  NTa = Ta // BT
  f = functools.partial(mgi.packed, scale=K ** -0.5, chunk_size=BT)
  rows = padding.ChunkRows(S((NTa,), jnp.int32), S((NTa,), jnp.int32))
  args = (S((1, T, HV, K), BF16), S((1, T, HV, K), BF16), S((1, T, HV, V), BF16), S((1, T, HV), F32),
          S((1, Ta, HV, K), F32), S((1, Ta, HV, K), F32), S((5,), jnp.int32), rows)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 3


def test_packed_kernels_smem():
  """The landing zone of q, k costs the scores kernel no SMEM (it shares the operands' bytes);
  the solve's plain v tile shares X's split: two CTAs per SM. The figures are smem_bytes'."""
  S, Ta, HV, K, V, T = jax.ShapeDtypeStruct, S_TA, S_HV, 128, 128, 3000
  NTa = Ta // BT
  rows = (S((NTa,), jnp.int32), S((NTa,), jnp.int32))
  sc = lambda cu, r0, r1, q, k, beta_t, flag, gf: mgi.scores.launch(cu, (r0, r1), q, k, beta_t, (gf,), flag,
                                                                   scale=K ** -0.5, bounded=True, approx_math=True,
                                                                   interpret=False)
  scores = lowered_smem_bytes(sc, S_CU, *rows, S((T, HV, K), BF16), S((T, HV, K), BF16), S((HV, T + BT), F32),
                              S((HV * NTa,), jnp.int32), S((Ta, HV, K), F32))
  assert scores == _scores_smem(K, 1) == mgi.scores.smem_bytes(K, two_part=False, packed=True)
  so = lambda cu, r0, r1, *a: mgi.solve.launch(cu, (r0, r1), *a, approx_math=True, interpret=False)
  solve = lowered_smem_bytes(so, S_CU, *rows, S((Ta, HV, BT), BF16), S((Ta, HV, BT), BF16),
                             S((Ta, HV, K), BF16), S((T, HV, V), BF16), S((HV, T + BT), F32))
  print(f"\n  packed: scores {scores} bytes, solve {solve} bytes")
  assert solve == mgi.solve.smem_bytes(K, V, packed=True) <= SMEM_TWO_CTAS


def test_packed_defer_solve():
  """defer (the state + output kernel's inverse mode): the same Akk, Aqk, Ainv, qg, kg bits as the
  plain solve; Ainv's low part and kd give w, beta v gives u (to bf16 rounding of w, u); Ainv + its
  low part inverts I + Akk; beta v is bf16(beta v), 0 at padding rows. Its SMEM: three CTAs per SM
  at K = V = 128."""
  lens, T, HV, K, V, gates = PACKED["K64-V64-HV2"]
  (q, k, v, beta), layout, (gi, gf) = _packed_case(lens, T, HV, K, V, 3, gates)
  want, (got, dfr) = _packed_run("K64-V64-HV2"), _packed_run("K64-V64-HV2", defer=True)
  assert got.w is None and got.u is None
  f32 = lambda x: np.asarray(jnp.asarray(x, F32))
  for f in ("Akk", "Aqk", "Ainv", "qg", "kg"):
    np.testing.assert_array_equal(f32(getattr(got, f)), f32(getattr(want, f)), err_msg=f)
  NTa = layout.Ta // BT
  ch = lambda x: f32(x)[0].reshape(NTa, BT, HV, -1).transpose(0, 2, 1, 3)     # [NTa, HV, BT, d]
  X = ch(got.Ainv) + ch(dfr.ainv_lo)
  live = slice(0, int(layout.aligned_cu[-1]) // BT)
  eye = np.eye(BT)
  lo, hi = ch(dfr.ainv_lo), ch(got.Ainv)
  assert np.all(np.abs(lo) <= 2 ** -8 * np.abs(hi)) and np.abs(lo)[live].max() > 0    # a rounding remainder
  assert np.abs(X @ (eye + ch(got.Akk)) - eye)[live].max() <= 2e-3       # Out.Akk: the high part alone
  for name, rhs, out in (("w", dfr.kd, want.w), ("u", dfr.bv, want.u)):
    ref = ch(out)                # bf16 of the same float32 sum up to its order: within a bf16 rounding
    assert np.all((np.abs(X @ ch(rhs) - ref) <= 2 ** -8 * np.abs(ref) + 1e-6 * np.abs(ref).max())[live]), name
  bv = np.asarray(jnp.asarray(padding.align_with(layout, beta)[..., None] * padding.align_with(layout, v).astype(F32),
                              BF16).astype(F32))
  valid = np.asarray(padding.valid_mask(layout))[None, :, None, None]
  np.testing.assert_array_equal(f32(dfr.bv)[:, :int(layout.aligned_cu[-1])],
                                np.where(valid, bv, 0.0)[:, :int(layout.aligned_cu[-1])])
  S, Ta = jax.ShapeDtypeStruct, S_TA
  rows = (S((Ta // BT,), jnp.int32),) * 2
  so = lambda cu, r0, r1, *a: mgi.solve.launch(cu, (r0, r1), *a[:2], None, *a[2:], approx_math=True,
                                               interpret=False, defer=True)
  smem = lowered_smem_bytes(so, S_CU, *rows, S((Ta, S_HV, BT), BF16), S((Ta, S_HV, BT), BF16),
                            S((3000, S_HV, 128), BF16), S((S_HV, 3000 + BT), F32))
  print(f"\n  deferred solve (packed, V = 128): SMEM {smem} bytes")
  assert smem == mgi.solve.smem_bytes(128, 128, packed=True, defer=True) <= SMEM_THREE_CTAS


def test_packed_unwritten_tail():
  """tail_zeros=False (simulator, whose unwritten memory is NaN), on the static-bound layout of a
  traced cu_seqlens (tail chunks): every owned chunk is bit for bit tail_zeros=True's, and at the
  tail the residuals are still written (Aqk 0, Ainv I); the rest is left unwritten there."""
  lens, T, HV, K, V, gates = PACKED["K64-V64-HV2"]
  (q, k, v, beta), _, _ = _packed_case(lens, T, HV, K, V, 3, gates)
  q, k, v, beta = (x[:, :, :1] for x in (q, k, v, beta))      # one head (CI budget)
  g = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(7), (1, T, 1, K))) * 0.25
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)

  def run(cu, tail_zeros):
    layout = padding.layout_from_cu_seqlens(cu, T, BT)        # traced: the static bound
    gi, gf = _gc(padding.align_with(layout, g), padding.valid_mask(layout)[None])
    return mgi.packed(q, k, v, beta, gi, gf, layout.aligned_cu, padding.chunk_rows(layout), scale=K ** -0.5,
                      chunk_size=BT, interpret=True, tail_zeros=tail_zeros)
  full, skip = (jax.jit(functools.partial(run, tail_zeros=tz))(cu) for tz in (True, False))
  owned = sum(-(-n // BT) for n in lens) * BT
  assert owned < full.Aqk.shape[1]
  for f in intra.Out._fields:
    a, b = (np.asarray(jnp.asarray(getattr(x, f), F32)) for x in (skip, full))
    np.testing.assert_array_equal(a[:, :owned], b[:, :owned], f)
  assert np.isnan(np.asarray(jnp.asarray(skip.qg, F32))[:, owned:]).all()   # the tail's work skipped
  for f in ("Aqk", "Ainv"):
    np.testing.assert_array_equal(np.asarray(jnp.asarray(getattr(skip, f), F32))[:, owned:],
                                  np.asarray(jnp.asarray(getattr(full, f), F32))[:, owned:], f)
