"""The Mosaic GPU bwd_intra kernel against the bwd_intra reference: simulator runs on CPU, CUDA
lowering, SMEM as lowered, the stage's predicate.

Inputs: test_intra_mosaic.make_case's aligned layouts (bf16 q, k, l2-normalised or |q|, |k| in
[1, 3]; padding rows after every sequence and a whole padding chunk; ordinary gates, gc_int == 0,
or strong ones: per head one chunk with -inf / -1e30 / ... / -30 gates, floored at -128 by the gate
stage, gc down to about -8000) and random dAqk, dAkk, causal as S1 and S3 hand them over
(bwd_setup.randn, mask_rows, as test_bwd_intra.py builds them). The reference gets the same bf16
q, k (upcast), so what is left is the kernel's own rounding: hi + lo bf16 splits of the wgmma
operands (~2^-16 relative) and float32 order of summation.
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
from kda.stages import bwd_intra, intra
from kda.stages.bwd_intra import mosaic_gpu as mgb
from kda.stages.intra import from_chunks, pair_decay, to_chunks
from tests.stages import bwd_setup
from tests.stages.test_intra_mosaic import SMEM_TWO_CTAS, make_case
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
F32, BF16 = jnp.float32, jnp.bfloat16
FIELDS = bwd_intra.Out._fields

# Kernel vs reference, per field: (the worst (chunk, head) block's max|d| / max|ref|, ||d|| / ||ref||
# over the whole array). Measured maxima over every case below (default and large) in the comments;
# the bounds keep 5x or more. A missing level, a wrong sign of a dgc term, a missing diagonal or a
# 1% scale fail them by orders of magnitude (test_tolerances_catch_wrong_formulas).
TOL = {
    "dq": (1e-4, 3e-5),       # measured 8.2e-6, 3.6e-6
    "dk": (1e-4, 3e-5),       # measured 1.5e-5, 4.6e-6
    "dbeta": (1e-4, 3e-5),    # measured 1.5e-5, 5.5e-6
    "dgc": (1e-4, 3e-5),      # measured 1.2e-5, 4.5e-6
}

CASES = {
    # id: lens, Ta, HV, K; 3 chunks: padding rows in a partial chunk, the last chunk all padding
    "K64-HV2-40_64": ([40, 64], 192, 2, 64),
    "K128-HV2-100": ([100], 192, 2, 128),
    "K128-HV2-64_50": ([64, 50], 192, 2, 128),
    "K64-HV2-130": ([130], 192, 2, 64),
}


def make_inputs(case, gates, unit=True, seed=50, accumulate=False):
  """The stage's arguments (q, k bf16; the rest float32) and the [Ta] real-token mask; the
  accumulators dq, dk, dbeta, dgc are zeros, or random with `accumulate`."""
  lens, Ta, HV, K = CASES[case]
  (q, k, _, beta, gi, gf), valid = make_case(lens, Ta, HV, K, 64, gates, unit)
  A = (1, Ta, HV, BT)
  dAqk, dAkk, aq, ak, ag = bwd_setup.randn(seed, A, A, q.shape, k.shape, q.shape)
  (ab,) = bwd_setup.randn(seed + 1, beta.shape)
  dAqk = bwd_setup.mask_rows(dAqk, BT, strict=False)            # what S1 and S3 hand over
  dAkk = bwd_setup.mask_rows(dAkk, BT, strict=True)
  accs = (aq, ak, ab, ag) if accumulate else tuple(jnp.zeros_like(x) for x in (aq, ak, ab, ag))
  return (q, k, beta, gi, gf, dAqk, dAkk) + accs, valid


@functools.lru_cache(maxsize=None)
def _kernel(scale, config=None):
  return jax.jit(functools.partial(mgb.apply, scale=scale, chunk_size=BT, interpret=True, config=config))


@functools.lru_cache(maxsize=None)
def _reference(scale):
  return jax.jit(functools.partial(bwd_intra.reference.apply, scale=scale, chunk_size=BT))


@functools.lru_cache(maxsize=None)
def run_case(case, gates, unit=True, accumulate=False, bounded="auto"):
  """(args, valid, kernel Out, reference Out, kernel seconds)."""
  args, valid = make_inputs(case, gates, unit, accumulate=accumulate)
  scale = CASES[case][3] ** -0.5
  t0 = time.time()
  got = jax.block_until_ready(_kernel(scale, mgb.Config(bounded=bounded))(*args))
  secs = time.time() - t0
  return args, valid, got, _reference(scale)(*args), secs


def errors(got, want, fields=FIELDS):
  return bwd_setup.block_errors(got, want, fields)


def failures(errs):
  return [n for n, e in errs.items() if not (e[0] <= TOL[n][0] and e[1] <= TOL[n][1])]   # NaN fails


fmt = bwd_setup.fmt


# the default run: both K, both gate kinds, unit and non-unit q, k, both paths (bounded="auto": the
# two-level path where flagged; "never": six levels everywhere)
DEFAULT = {("K64-HV2-40_64", "ordinary", True, "auto"), ("K64-HV2-40_64", "strong", True, "auto"),
           ("K64-HV2-40_64", "strong", True, "never"), ("K128-HV2-100", "strong", False, "auto")}
MATRIX = [(c, g, u, b) for c in CASES for g in ("ordinary", "strong") for u in (True, False)
          for b in ("auto", "never")]


@pytest.mark.parametrize(
    "case,gates,unit,bounded",
    [pytest.param(*m, marks=() if m in DEFAULT else pytest.mark.large) for m in MATRIX],
    ids=[f"{c}-{g}-{'unit' if u else 'nonunit'}-{b}" for c, g, u, b in MATRIX])
def test_kernel_matches_reference(case, gates, unit, bounded):
  args, valid, got, want, secs = run_case(case, gates, unit, bounded=bounded)
  errs = errors(got, want)
  gi = np.asarray(args[3])
  flags = np.asarray(mgb.bounded_levels(args[3], args[4]))
  print(f"\n  {case} {gates} unit={unit} bounded={bounded} ({secs:.2f}s) min gc_int {gi.min():.0f} "
        f"flags {flags.tolist()}\n    {fmt(errs)}")
  assert np.any(gi != 0) == (gates == "strong")
  assert (flags == 6).all() if gates == "ordinary" else ((flags == 0).any() and (flags >= 5).any())
  if gates == "strong":
    assert gi.min() < -1000                       # floored -inf gates: gc far below exp's range
  for name in FIELDS:
    x, w = getattr(got, name), getattr(want, name)
    assert x.dtype == F32 and x.shape == w.shape, (name, x.dtype, x.shape)
    assert bool(jnp.all(jnp.isfinite(x))), f"{name}: not finite"
  bad = failures(errs)
  assert not bad, f"{bad} beyond TOL: {fmt(errs)}"


@functools.lru_cache(maxsize=None)
def _steady_case(bounded):
  """K64-HV2-40_64 with steady gates per (head, chunk), one of each bounded level: -3.5 per token
  (16 tokens span 56 > 40, 8 span 28: lb 4), -2 (32 span 64, 16 span 32: lb 5), -1 (32 span 32:
  lb 6), -6 (8 tokens span 48: lb 0); chunk 2 is padding (gc flat: lb 6)."""
  from tests.stages.test_intra_mosaic import _gc
  args, valid = make_inputs("K64-HV2-40_64", "ordinary")
  per = np.array([[-3.5, -6.0, -2.0], [-2.0, -1.0, -2.0]], np.float32)       # [HV, NTa]
  g = np.broadcast_to(np.repeat(per.T, BT, axis=0)[None, :, :, None], args[3].shape)
  gi, gf = _gc(jnp.asarray(g), jnp.asarray(valid)[None])
  args = args[:3] + (gi, gf) + args[5:]
  # wait for the simulator: its callbacks run jax ops, and eager ops dispatched meanwhile deadlock
  got = jax.block_until_ready(_kernel(64 ** -0.5, mgb.Config(bounded=bounded))(*args))
  return args, got, _reference(64 ** -0.5)(*args)


def test_bounded_levels_run_where_flagged():
  """Per (head, chunk) the bounded level lb: 4, 5 or 6 take 3, 2 or 1 levels (other bits than the six
  levels of bounded="never"), 0 the six (the same bits); both paths match the reference. HV = 2 with
  different levels per head: the kernel reads them in bounded_levels' order."""
  args, auto, want = _steady_case("auto")
  _, never, _ = _steady_case("never")
  lb = np.asarray(mgb.bounded_levels(args[3], args[4])).reshape(2, -1)        # [HV, NTa]
  assert lb.tolist() == [[4, 0, 6], [5, 6, 6]]
  for out in (auto, never):
    assert not failures(errors(out, want)), fmt(errors(out, want))
  for name in ("dq", "dk", "dgc"):
    a, b = (bwd_setup.blocks(np.asarray(getattr(o, name))) for o in (auto, never))      # [NTa, HV, ...]
    for h in range(2):
      for c in range(2):                                  # chunk 2 is all padding: zeros either way
        assert np.array_equal(a[c, h], b[c, h]) == (lb[h, c] == 0), (name, h, c, lb[h, c])


@pytest.mark.parametrize("case,gates", [("K64-HV2-40_64", "strong"),
                                        pytest.param("K128-HV2-64_50", "ordinary", marks=pytest.mark.large)])
def test_accumulates_and_keeps_padding_rows(case, gates):
  """With random accumulators: the result is the accumulators plus the terms of the zero-accumulator
  run (to float32 rounding); at padding tokens dk, dbeta, dgc are the accumulators bit for bit (no
  pair there carries a real token's q or k), and so is dq at a whole padding chunk: what the
  reference gives there too."""
  args, valid, got, want, _ = run_case(case, gates, accumulate=True)
  _, _, terms, _, _ = run_case(case, gates)
  accs = dict(zip(FIELDS, args[7:]))
  assert not failures(errors(got, want)), fmt(errors(got, want))
  pad = ~valid
  whole = np.zeros_like(valid)
  for c in range(len(valid) // BT):
    whole[c * BT:(c + 1) * BT] = not valid[c * BT:(c + 1) * BT].any()
  assert pad.any() and whole.any() and (pad & ~whole).any()
  for name in FIELDS:
    a, x, t, w = (np.asarray(v, np.float32)[0] for v in (accs[name], getattr(got, name), getattr(terms, name),
                                                       getattr(want, name)))
    np.testing.assert_allclose(x, a + t, rtol=1e-6, atol=1e-6 * np.abs(a + t).max(), err_msg=name)
    rows = whole if name == "dq" else pad
    np.testing.assert_array_equal(x[rows], a[rows], f"{name}: padding rows are not the accumulator")
    np.testing.assert_array_equal(w[rows], a[rows], f"{name}: (reference) padding rows")


@pytest.mark.large
def test_float32_q_k_are_rounded_to_bf16():
  """float32 q, k (here bf16-exact values) are cast in the launcher: the same bits as bf16 ones."""
  args, _, got, _, _ = run_case("K64-HV2-40_64", "ordinary")
  f32 = jax.block_until_ready(_kernel(64 ** -0.5)(args[0].astype(F32), args[1].astype(F32), *args[2:]))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(f32, name)), np.asarray(getattr(got, name)), name)


def _variant(q, k, beta, gi, gf, dAqk, dAkk, *, scale, drop_level=None, signs=(1, -1, 1, -1), diag=True):
  """The reference's terms (zero accumulators) with one thing wrong: the pairs of level `drop_level`
  left out, the dgc terms (q dqAs, k dkAs, k dkK1, k dkK2) with `signs`, or no diagonal."""
  ein = lambda s, *a: jnp.einsum(s, *a, precision=jax.lax.Precision.HIGHEST)
  q, k, beta, gi, gf, dAqk, dAkk = (to_chunks(x.astype(F32), BT) for x in (q, k, beta, gi, gf, dAqk, dAkk))
  Es = pair_decay(gi, gf, True)
  if drop_level is not None:
    i, j = np.arange(BT)[:, None], np.arange(BT)[None, :]
    hb = np.where(i > j, 2 ** np.floor(np.log2(np.maximum(i ^ j, 1))), 0)     # half the pair's level
    Es = jnp.where(jnp.asarray(2 * hb == drop_level)[None, :, :, None, None], 0.0, Es)
  b = beta[..., None]
  dqAs = scale * ein("cihj,cjhk,cijhk->cihk", dAqk, k, Es)
  dkAs = scale * ein("cihj,cihk,cijhk->cjhk", dAqk, q, Es)
  d = scale * jnp.moveaxis(jnp.diagonal(dAqk, axis1=1, axis2=3), 1, 2)[..., None] * (1.0 if diag else 0.0)
  G = ein("cihj,cjhk,cijhk->cihk", dAkk, k, Es)
  dkK2 = ein("cihj,cihk,cijhk->cjhk", dAkk * beta[..., None], k, Es)
  s1, s2, s3, s4 = signs
  return bwd_intra.Out(from_chunks(dqAs + d * k), from_chunks(dkAs + d * q + b * G + dkK2),
                       from_chunks(jnp.sum(k * G, -1)),
                       from_chunks(s1 * q * dqAs + s2 * k * dkAs + s3 * k * b * G + s4 * k * dkK2))


@pytest.mark.parametrize("case,gates,unit", [("K64-HV2-40_64", "ordinary", True),
                                             pytest.param("K128-HV2-100", "strong", False, marks=pytest.mark.large)])
def test_tolerances_catch_wrong_formulas(case, gates, unit):
  """TOL is tight enough: the kernel's outputs fail against references of subtly wrong formulas;
  the right formula (this _variant unchanged) passes."""
  args, _, got, _, _ = run_case(case, gates, unit)
  scale = CASES[case][3] ** -0.5
  ref = functools.partial(_variant, scale=scale)               # eager: no compile per variant
  assert not failures(errors(got, ref(*args[:7]))), case
  wrong = {f"level {s} missing": (dict(drop_level=s), set(FIELDS)) for s in (64, 32, 16, 8, 4, 2)}
  for t in range(4):
    signs = tuple(-x if n == t else x for n, x in enumerate((1, -1, 1, -1)))
    wrong[f"dgc term {t} sign"] = (dict(signs=signs), {"dgc"})
  wrong["diagonal missing"] = (dict(diag=False), {"dq", "dk"})
  wrong["scale x 1.01"] = (dict(scale=scale * 1.01), {"dq", "dk", "dgc"})
  for label, (kw, must_fail) in wrong.items():
    errs = errors(got, functools.partial(ref, **kw)(*args[:7]))
    print(f"\n  {case} {gates} vs {label}: {fmt(errs)}")
    assert must_fail <= set(failures(errs)), (case, label, failures(errs))


@pytest.mark.large
def test_matches_vjp_of_intra_reference():
  """Against jax.vjp of the forward intra reference through Akk and Aqk (an independent derivation),
  on the forward records of a padded varlen case (bwd_setup: an empty sequence, partial chunks, a
  tail past cu_seqlens[-1]); q, k rounded to bf16 for both."""
  s = bwd_setup.forward_records(chunk_size=BT, K=64, V=64, gate="strong", lens=(30, 150, 0, 17), HV=2)
  BTp, scale = s.plan.chunk_size, s.plan.scale
  q, k, v, beta, gi, gc = s.rec["inputs"]["intra"][:6]
  q, k = (x.astype(BF16).astype(F32) for x in (q, k))
  Akk, Aqk = s.rec["intra"].Akk, s.rec["intra"].Aqk
  dAqk, dAkk = bwd_setup.randn(52, Aqk.shape, Akk.shape)
  dAqk = bwd_setup.mask_rows(dAqk, BTp, strict=False)
  dAkk = bwd_setup.mask_rows(dAkk, BTp, strict=True)
  fwd = lambda q, k, beta, gc: intra.reference.apply(q, k, v, beta, gi, gc, scale=scale, chunk_size=BTp)[:2]
  want = jax.vjp(fwd, q, k, beta, gc)[1]((dAkk, dAqk))
  zeros = [jnp.zeros_like(x) for x in (q, k, beta, gc)]
  got = jax.block_until_ready(_kernel(scale)(q.astype(BF16), k.astype(BF16), beta, gi, gc, dAqk, dAkk, *zeros[:2], zeros[2], zeros[3]))
  for name, w in zip(FIELDS, want):
    bwd_setup.close(name, getattr(got, name), w, tol=1e-4)


# -- the predicate -----------------------------------------------------------------------------------

def _abstract(Ta, HV, K, qk=BF16):
  S = jax.ShapeDtypeStruct
  x, b, A = S((1, Ta, HV, K), F32), S((1, Ta, HV), F32), S((1, Ta, HV, BT), F32)
  return (S((1, Ta, HV, K), qk), S((1, Ta, HV, K), qk), b, x, x, A, A, x, x, b, x)


def test_bounded_levels_crafted_spans():
  """lb = 6 where both 32-token halves of the chunk span <= 40 of gc in every channel, else 5 where
  every 16-token half of both 32-token blocks does, else 4 where every 8-token half of the 16-token
  blocks does, else 0; NaN -> 0."""
  from tests.stages.test_intra_mosaic import _gc
  HV, NTa, K = 2, 3, 64
  g = np.full((1, NTa * BT, HV, K), -0.01, np.float32)
  g[0, 33:49, 0, 3] = -41 / 16          # a 16-token span of 41 in one channel, 8-token ones of 20.5 -> 4
  g[0, BT + 17:BT + 25, 0, 3] = -41 / 8   # an 8-token span of 41 -> 0
  g[0, 2 * BT + 33:2 * BT + 49, 0, 3] = -39 / 16   # 39 (and 0.15 more in its 32-token half) -> 6
  g[0, 20, 1, 0] = np.nan               # -> 0
  g[0, BT + 16, 1, 5] = -41.0           # in a 16-token span of 32-blocks, not of 16-blocks -> 4
  g[0, 2 * BT + 32, 1, 5] = -41.0       # a 32-token block's first gate: in the chunk's first half's span
                                        # (to row 32), in no 16-token span -> 5
  gi, gf = _gc(jnp.asarray(g), jnp.ones((1, NTa * BT), bool))
  lb = np.asarray(mgb.bounded_levels(gi, gf))
  assert lb.dtype == np.int32 and lb.shape == (HV * NTa,)
  assert lb.reshape(HV, NTa).tolist() == [[4, 0, 6], [0, 4, 5]]


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="bounded"):
    mgb.Config(bounded="always")


def test_supports():
  """`supports`, the stage's predicate: what the kernel can run, and bf16 q, k (`apply` itself
  rounds float32 ones); the pipeline's choice follows it."""
  kw = dict(scale=0.125, chunk_size=BT)
  good = [jnp.zeros(s.shape, s.dtype) for s in _abstract(128, 2, 64)]
  assert mgb.supports(*good, **kw) is None and mgb.supports(*good, config=mgb.Config(), **kw) is None
  assert bwd_intra.STAGE.mosaic_gpu is mgb
  f32 = [good[0].astype(F32), good[1].astype(F32)] + good[2:]
  assert "takes bfloat16 q, k" in mgb.supports(*f32, **kw)        # float32 keeps the reference
  zeros = lambda *a, **k: [jnp.zeros(s.shape, s.dtype) for s in _abstract(*a, **k)]
  with_ = lambda i, x: good[:i] + [x] + good[i + 1:]
  refused = {
      "chunk_size must be 64, got 32": (good, dict(kw, chunk_size=32)),
      "K must be one of (64, 128), got 256": (zeros(128, 2, 256), kw),    # the stage's jnp reference runs
      "K must be one of (64, 128), got 96": (zeros(128, 2, 96), kw),
      "K must be one of (64, 128), got 32": (zeros(64, 1, 32), kw),
      "Ta must be a multiple of 64, got 100": ([x[:, :100] for x in good], kw),
      "k must be [1, Ta, HV, K]": ([jnp.concatenate([x, x]) for x in good], kw),
      "q must have shape": (with_(0, good[0][:, :64]), kw),
      "beta must have shape": (with_(2, good[2][..., :1]), kw),
      "gc_frac must have shape": (with_(4, good[4][..., :1, :]), kw),
      "dAqk must have shape (1, 128, 2, 64)": (with_(5, good[5][..., :32]), kw),
      "dAkk must have shape": (with_(6, good[6][:, :64]), kw),
      "dgc must have shape": (with_(10, good[10][..., :32]), kw),
      "dbeta must have shape": (with_(9, good[9][:, :64]), kw),
  }
  for reason, (args, kwargs) in refused.items():
    assert reason in (mgb.supports(*args, **kwargs) or ""), (reason, mgb.supports(*args, **kwargs))
    with pytest.raises(ValueError, match=re.escape(f"mosaic_gpu bwd_intra kernel: {reason}")):
      mgb.apply(*args, interpret=True, **kwargs)
  assert "bfloat16 or float32 q, got float16" in mgb.supports(*with_(0, good[0].astype(jnp.float16)), **kw)
  assert "floating dAkk, got int32" in mgb.supports(*with_(6, good[6].astype(jnp.int32)), **kw)
  # the pipeline: an impl dict naming bwd_intra runs the kernel or raises the predicate's reason;
  # impl=None takes it on Hopper (checked on an H200 by tools.gpu_check_bwd)
  strict = planning.make_plan(scale=0.125, chunk_size=BT, impl={"bwd_intra": "mosaic_gpu"})
  assert planning.choose(strict, "bwd_intra", *good, **kw) == "mosaic_gpu"
  with pytest.raises(ValueError, match=r"impl\['bwd_intra'\] = 'mosaic_gpu': K must be one of"):
    planning.choose(strict, "bwd_intra", *zeros(128, 2, 96), **kw)
  assert planning.default_impls(("bwd_intra",), "gpu", "sm90")["bwd_intra"] == "mosaic_gpu"


# -- CUDA lowering and SMEM --------------------------------------------------------------------------

def _lowered(config, K=128):
  return _lowered_text(config, K)


@functools.lru_cache(maxsize=None)              # one lowering per (config, K), however called
def _lowered_text(config, K):
  """The kernel lowered for CUDA with 70000 chunks (on grid x), float32 q, k (the launcher's cast)
  and aligned_cu -> its text."""
  f = functools.partial(mgb.apply, scale=K ** -0.5, chunk_size=BT, config=config)
  args = _abstract(70000 * BT, 2, K, qk=F32) + (jax.ShapeDtypeStruct((9,), jnp.int32),)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  return txt


@pytest.mark.parametrize("K,bounded", [(128, "auto"), pytest.param(64, "auto", marks=pytest.mark.large),
                                       pytest.param(64, "never", marks=pytest.mark.large)])
def test_kernel_lowers_for_cuda(K, bounded):
  """One Mosaic GPU kernel, lowered for CUDA from the CPU with 70000 chunks (on grid x), float32
  q, k (the launcher's cast) and aligned_cu; dgc's result aliases its accumulator (in place)."""
  txt = _lowered(mgb.Config(bounded=bounded), K)
  call = [line for line in txt.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  assert len(re.findall(r"output_operand_alias<", call[0])) == 1, call[0][:400]


@pytest.mark.parametrize("K", [64, 128])
def test_kernel_smem(K):
  """Two CTAs per SM: 8 swizzled [64, 64] bf16 tiles and gc's two float32 parts, the reduction
  scratch and a barrier, the same at any K (one 64-column slab per program): 100360 bytes as
  lowered for CUDA and as `smem_bytes` computes it from the launcher's scratch."""
  smem = lowered_smem_bytes(functools.partial(mgb.apply, scale=K ** -0.5, chunk_size=BT), *_abstract(4096, 16, K))
  print(f"\n  bwd_intra K={K}: SMEM {smem} bytes as lowered")
  assert smem <= SMEM_TWO_CTAS
  assert smem == 100360 == mgb.smem_bytes()                     # the predicate's figure


@pytest.mark.large
def test_chunk_kda_grad_with_the_kernel():
  """kda.chunk_kda's gradient with impl={"bwd_intra": "mosaic_gpu"} (simulator) against the all-
  reference one: the pipeline's wiring (argument order, the accumulators, dbeta); bf16 q, k, v (the
  predicate takes bf16 q, k only), so the two differ by the kernel's rounding and the bf16
  gradients' roundings it flips now and then."""
  import kda
  from tests import cases
  inp = cases.make_inputs(3, lens=[45, 80, 0, 20], H=2, HV=2, K=64, V=64, gate="plain")
  q, k, v = (x.astype(BF16) for x in (inp.q, inp.k, inp.v))
  wo = jax.random.normal(jax.random.PRNGKey(9), inp.v.shape)

  def grads(impl):
    def loss(q, k, v, g, beta):
      o, _ = kda.chunk_kda(q, k, v, g, beta, initial_state=inp.initial_state, cu_seqlens=inp.cu_seqlens,
                           chunk_size=BT, impl=impl)
      return jnp.sum(o.astype(F32) * wo)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, inp.g, inp.beta)

  got, want = grads({"bwd_intra": "mosaic_gpu"}), grads("reference")
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
    bwd_setup.close(name, a.astype(F32), b.astype(F32), tol=4e-3)


def test_skip_tail_reads_nothing_there():
  """Config(skip_tail=True) with aligned_cu: the chunk past aligned_cu[-1] (the case's last, all
  padding) gets its accumulators back, nothing else of it read (NaN there changes nothing); with
  dAqk, dAkk 0 there, as S1 and S3 hand them over, every output is bit for bit the one without."""
  args, _ = make_inputs("K64-HV2-40_64", "ordinary", accumulate=True)
  tail = jnp.arange(192) >= 128
  at_tail = lambda x: tail.reshape((1, 192) + (1,) * (x.ndim - 2))
  args = args[:5] + tuple(jnp.where(at_tail(x), 0.0, x) for x in args[5:7]) + args[7:]
  scale = 64 ** -0.5
  plain = jax.block_until_ready(_kernel(scale)(*args))
  bad = tuple(jnp.where(at_tail(x), jnp.nan, x).astype(x.dtype) if i < 7 else x for i, x in enumerate(args))
  acu = jnp.asarray([0, 64, 128], jnp.int32)
  out = jax.block_until_ready(_kernel(scale, mgb.Config(skip_tail=True))(*bad, acu))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(plain, name)), name)
  ref = bwd_intra.reference.apply(*args, acu, scale=scale, chunk_size=BT)
  assert not failures(errors(out, ref))


FLIPPED = {"approx_math": False, "skip_tail": False, "bounded": "never"}    # every Config field off its default


@pytest.mark.parametrize("field", sorted(FLIPPED))
def test_config_fields_change_the_program(field):
  """Each Config field flipped from its default gives another lowered program (CUDA, with aligned_cu)."""
  assert _lowered(mgb.Config(**{field: FLIPPED[field]})) != _lowered(mgb.Config())


def test_flipped_config_matches_the_reference():
  """Every Config field off its default (exp without ex2.approx, the tail chunk computed from its
  zero dA, six exact levels everywhere): the outputs still match the reference (simulator)."""
  args, _ = make_inputs("K64-HV2-40_64", "strong", accumulate=True)
  acu = jnp.asarray([0, 64, 128], jnp.int32)
  at_tail = lambda x: (jnp.arange(192) >= 128).reshape((1, 192) + (1,) * (x.ndim - 2))
  args = args[:5] + tuple(jnp.where(at_tail(x), 0.0, x) for x in args[5:7]) + args[7:]   # as S1, S3 hand dA over
  got = jax.block_until_ready(_kernel(64 ** -0.5, mgb.Config(**FLIPPED))(*args, acu))
  want = bwd_intra.reference.apply(*args, acu, scale=64 ** -0.5, chunk_size=BT)
  assert not failures(errors(got, want)), fmt(errors(got, want))


def test_grad_dtype_rounds_dq_dk_alone():
  """grad_dtype=bfloat16 (what the pipeline passes for bf16 q, k): dq, dk are the float32 ones
  rounded once, dbeta and dgc the same bits; the reference does the same."""
  args, _ = make_inputs("K64-HV2-40_64", "ordinary", accumulate=True)
  scale = 64 ** -0.5
  plain = jax.block_until_ready(_kernel(scale)(*args))
  out = jax.block_until_ready(jax.jit(functools.partial(mgb.apply, scale=scale, chunk_size=BT, interpret=True,
                                                        grad_dtype=BF16))(*args))
  for name in FIELDS:
    a, b = getattr(out, name), getattr(plain, name)
    if name in ("dq", "dk"):
      assert a.dtype == BF16, name
      b = b.astype(BF16)
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)), name)
  ref = bwd_intra.reference.apply(*args, scale=scale, chunk_size=BT, grad_dtype=BF16)
  want = bwd_intra.reference.apply(*args, scale=scale, chunk_size=BT)
  assert ref.dq.dtype == ref.dk.dtype == BF16 and ref.dgc.dtype == F32
  np.testing.assert_array_equal(np.asarray(ref.dk.astype(F32)), np.asarray(want.dk.astype(BF16).astype(F32)))
  txt = jax.jit(functools.partial(mgb.apply, scale=0.125, chunk_size=BT, grad_dtype=BF16)).trace(
      *_abstract(4096, 2, 128)).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1


def test_packed_dq_dk_equal_aligned_unaligned():
  """rows / pieces / T given: dq, dk stored packed (bf16, as the pipeline asks) equal the aligned
  kernel's unaligned, bit for bit, exactly 0 at tokens of no sequence (a 70-token gap, 3 after the
  last); dbeta and dgc bit for bit the aligned kernel's."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  case = "K128-HV2-64_50"
  lens, Ta, HV, K = CASES[case]
  args, valid = make_inputs(case, "strong", accumulate=True)
  layout, pvalid = packed_layout(lens, [70, 0], extra_T=3, tail_chunks=1)
  assert layout.Ta == Ta and np.array_equal(pvalid, np.asarray(valid))
  rows = padding.chunk_rows(layout)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, BT)
  f = lambda *a, **kw: mgb.apply(*a, layout.aligned_cu, scale=K ** -0.5, chunk_size=BT, grad_dtype=BF16,
                                 interpret=True, **kw)
  got = jax.jit(lambda *a: f(*a, rows=rows, pieces=pieces, T=layout.T))(*args)
  want = jax.jit(f)(*args)
  owned = np.asarray(padding.packed_owned_mask(layout))
  assert (~owned).sum() == 73
  for name in ("dq", "dk"):
    x = np.asarray(getattr(got, name).astype(F32))
    assert x.shape == (1, layout.T, HV, K) and getattr(got, name).dtype == BF16
    np.testing.assert_array_equal(x, np.asarray(padding.unalign_with(layout, getattr(want, name)).astype(F32)), name)
    assert np.all(x[:, ~owned] == 0), name
  for name in ("dbeta", "dgc"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  with pytest.raises(ValueError, match="packed dq, dk"):
    mgb.apply(*args, scale=1.0, chunk_size=BT, rows=rows, pieces=pieces, T=layout.T)


def test_packed_qk_equals_aligned():
  """qk_packed: q, k read from the packed arrays (NaN at tokens of no sequence: a 70-token gap and
  3 after the last) give every output bit for bit the call on their aligned copies (packed dq, dk);
  with clean, non-finite values at real tokens read as 0; it lowers for CUDA."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  case = "K128-HV2-64_50"
  lens, Ta, HV, K = CASES[case]
  args, _ = make_inputs(case, "strong", accumulate=True)
  layout, _ = packed_layout(lens, [70, 0], extra_T=3, tail_chunks=1)
  rows = padding.chunk_rows(layout)
  kw = dict(rows=rows, pieces=padding.gap_pieces(rows, layout.aligned_cu, layout.T, BT), T=layout.T,
            scale=K ** -0.5, chunk_size=BT, grad_dtype=BF16)
  packed, aligned = bwd_setup.packed_and_aligned(layout, args[:2])
  f = lambda *a, **k: mgb.apply(*a, layout.aligned_cu, interpret=True, **kw, **k)
  want = jax.jit(f)(*aligned, *args[2:])
  got = jax.jit(lambda *a: f(*a, qk_packed=True))(*packed, *args[2:])
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name).astype(F32)),
                                  np.asarray(getattr(want, name).astype(F32)), name)
  assert float(np.abs(np.asarray(got.dgc)).max()) > 0
  # clean (traced): a NaN in q and an inf in k at real tokens read as 0, the same bits as 0 there;
  # clean False leaves them (they reach the outputs)
  t = int(layout.starts[1]) + 3
  bad = [packed[0].at[0, t, 1, 2].set(jnp.nan), packed[1].at[0, t + 30, 0, 5].set(jnp.inf)]
  zeroed = [jnp.where(jnp.isfinite(b) | ~jnp.isfinite(p), b, 0).astype(b.dtype) for b, p in zip(bad, packed)]
  g = jax.jit(lambda clean, *a: f(*a, qk_packed=True, clean=clean))
  want, got = g(False, *zeroed, *args[2:]), g(True, *bad, *args[2:])
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name).astype(F32)),
                                  np.asarray(getattr(want, name).astype(F32)), name)
  assert not all(np.isfinite(np.asarray(x.astype(F32))).all() for x in g(False, *bad, *args[2:]))
  low = jax.jit(lambda *a: mgb.apply(*a, layout.aligned_cu, qk_packed=True, **kw)).trace(
      *packed, *args[2:]).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in line for line in low.splitlines()) == 1


def test_packed_dq_dk_lower_for_cuda_in_two_ctas():
  from kda import padding
  S = jax.ShapeDtypeStruct
  Ta, T = 4096, 4000
  NTa = Ta // BT
  f = lambda *a: mgb.apply(*a[:12], scale=0.1, chunk_size=BT, grad_dtype=BF16, rows=padding.ChunkRows(*a[12:14]),
                           pieces=a[14], T=T)
  i32 = lambda *shape: S(shape, jnp.int32)
  smem = lowered_smem_bytes(f, *_abstract(Ta, 16, 128), i32(5), i32(NTa), i32(NTa), i32(2, T // BT + 6))
  print(f"\n  bwd_intra packed dq, dk: SMEM {smem} bytes as lowered")
  assert smem <= SMEM_TWO_CTAS and smem == mgb.smem_bytes(BF16)


def test_one_term_dA_stays_within_bf16_rounding():
  """Config(dA_terms=1): dAqk, dAkk enter their products as one bf16 term (rounded once, 2^-9):
  another lowered program, and every output within a few bf16 roundings of the reference, outside
  the two-term bounds (the mode ran)."""
  cfg = mgb.Config(dA_terms=1)
  assert _lowered(cfg) != _lowered(mgb.Config())
  args, _ = make_inputs("K128-HV2-100", "ordinary")
  scale = 128 ** -0.5
  got = jax.block_until_ready(_kernel(scale, cfg)(*args))
  errs = errors(got, bwd_intra.reference.apply(*args, scale=scale, chunk_size=BT))
  assert all(e[0] <= 1e-2 and e[1] <= 5e-3 for e in errs.values()), fmt(errs)
  assert errs["dq"][0] > 10 * TOL["dq"][0], fmt(errs)


@pytest.mark.parametrize("packed,layout", [(False, True), (True, True), (True, "slabs")],
                         ids=["aligned", "packed", "packed-slabs"])
def test_pairs_give_the_same_bits(packed, layout):
  """pairs=True: S3's dq, dk given as their pairs give every output bit for bit the call on float32
  dq, dk = hi + lo (simulator; aligned with the tail's copies, and packed dq, dk and q, k); so do
  pairs="slabs" (bwd_wy's terms kernel's slab pairs); it lowers for CUDA."""
  from kda import padding
  from kda._mosaic_gpu import from_pairs, to_pairs
  from tests.stages.test_gate_mosaic import packed_layout
  case = "K128-HV2-64_50"
  lens, Ta, HV, K = CASES[case]
  args, _ = make_inputs(case, "strong", accumulate=True)
  lay, _ = packed_layout(lens, [70, 0], extra_T=3, tail_chunks=1)
  kw = dict(scale=K ** -0.5, chunk_size=BT, grad_dtype=BF16)
  if packed:
    rows = padding.chunk_rows(lay)
    kw.update(rows=rows, pieces=padding.gap_pieces(rows, lay.aligned_cu, lay.T, BT), T=lay.T, qk_packed=True)
    args = tuple(bwd_setup.packed_and_aligned(lay, args[:2])[0]) + tuple(args[2:])
  args = list(args)
  slabs = layout == "slabs"
  pairs = [to_pairs(x, slabs=slabs) for x in args[7:9]]
  args[7:9] = [from_pairs(p, slabs=slabs) for p in pairs]
  f = lambda *a, **k: mgb.apply(*a, lay.aligned_cu, interpret=True, **kw, **k)
  want = jax.jit(f)(*args)
  got = jax.jit(lambda *a: f(*a, pairs=layout))(*args[:7], *pairs, *args[9:])
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name).astype(F32)),
                                  np.asarray(getattr(want, name).astype(F32)), name)
  assert float(np.abs(np.asarray(got.dq.astype(F32))).max()) > 0
  S = jax.ShapeDtypeStruct
  low = list(_abstract(4096, 16, 128))
  low[7:9] = [S((1, 4096 // BT, 16, 2 * BT, 128), BF16)] * 2
  txt = jax.jit(lambda *a: mgb.apply(*a, scale=0.1, chunk_size=BT, pairs=True)).trace(
      *low, S((9,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1
  assert mgb.supports(*low, scale=0.1, chunk_size=BT, pairs=True) is None
  assert "pairs are bfloat16, got dq float32" in mgb.supports(*low[:7], S(low[7].shape, F32), *low[8:], scale=0.1,
                                                              chunk_size=BT, pairs=True)
  assert "dq must have shape (1, 64, 16, 128, 128)" in mgb.supports(*_abstract(4096, 16, 128), scale=0.1,
                                                                    chunk_size=BT, pairs=True)


def defer_qg_errors(args, scale, **kw):
  """The kernel with defer_qg on args (dq's accumulator taken as S2's dqg) against the plain call on
  the accumulators S3 would have formed, dq = dqg exp(gc) and dgc + dqg q exp(gc): block errors."""
  q, k, beta, gi, gf, dAqk, dAkk, dqg, ak, ab, ag = args
  run = lambda *a, **k: jax.jit(functools.partial(mgb.apply, scale=scale, chunk_size=BT, interpret=True, **kw,
                                                  **k))(*a)
  dq = dqg * jnp.exp(gi + gf)
  want = run(q, k, beta, gi, gf, dAqk, dAkk, dq, ak, ab, ag + dq * q.astype(F32))
  return errors(run(*args, defer_qg=True), want)


@pytest.mark.parametrize("case,gates", [("K128-HV2-100", "strong"),
                                        pytest.param("K64-HV2-40_64", "ordinary", marks=pytest.mark.large)])
def test_defer_qg_forms_s3s_part_of_dq(case, gates):
  """defer_qg (simulator): the plain call's outputs within float32 rounding (the same terms summed in
  another order)."""
  args, _ = make_inputs(case, gates, accumulate=True)
  errs = defer_qg_errors(args, CASES[case][3] ** -0.5)
  assert all(e[0] < 2e-6 and e[1] < 1e-6 for e in errs.values()), fmt(errs)


def test_dakk_parts_add_on_load():
  """dAkk given as parts [2, Ta, HV, BT] (S3's split kernel's slabs): every output bit for bit the
  call on their float32 sum (simulator: the kernel adds them as it loads them; the reference and
  the xla backend sum first), and the TPU kernel's predicate refuses parts with a reason."""
  from kda.stages.bwd_intra import mosaic_tpu, xla
  args, _ = make_inputs("K64-HV2-40_64", "strong", accumulate=True)
  dAkk = args[6]
  (p0,) = bwd_setup.randn(11, dAkk.shape)
  p0 = bwd_setup.mask_rows(p0, BT, strict=True)
  p1 = dAkk - p0
  parts, summed = jnp.concatenate([p0, p1]), p0 + p1
  with_ = lambda d: args[:6] + (d,) + args[7:]
  scale = 64 ** -0.5
  for f in (_kernel(scale), _reference(scale),
            jax.jit(functools.partial(xla.apply, scale=scale, chunk_size=BT))):
    got, want = f(*with_(parts)), f(*with_(summed))
    for name in FIELDS:
      np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  assert float(np.abs(np.asarray(got.dbeta)).max()) > 0
  reason = mosaic_tpu.supports(*with_(parts), scale=scale, chunk_size=BT)
  assert reason is not None and "dAkk" in reason, reason
