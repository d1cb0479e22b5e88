"""The Mosaic GPU bwd_dav kernel against the bwd_dav reference: simulator runs on CPU, CUDA
lowering, SMEM as lowered, the stage's predicate.

Inputs: test_output.stage_inputs' aligned layouts (seeded random Aqk, lower triangular with its
diagonal as intra makes it, and v_new; both 0 at padding rows and Aqk at padding columns; padding
rows after every sequence and a whole padding chunk) and a random float32 do, 0 at padding tokens
as pipeline.backward aligns it. v_new and Aqk in bf16 (what the forward's kernels hand over) or
float32; the reference gets the same values (upcast), so what is left is the kernel's own rounding:
the hi + lo bf16 split of do (and of float32 v_new, Aqk; ~2^-16 relative) and float32 summation.
"""
from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import pipeline
from kda import plan as planning
from kda.stages import bwd_dav
from kda.stages.bwd_dav import mosaic_gpu as mgv
from tests.stages import bwd_setup
from tests.stages.test_intra_mosaic import SMEM_TWO_CTAS
from tests.stages.test_output import stage_inputs
from tests.stages.test_output_mosaic import lowered_smem_bytes

fmt = bwd_setup.fmt
BT = 64
F32, BF16 = jnp.float32, jnp.bfloat16
FIELDS = bwd_dav.Out._fields

# Kernel vs reference, per dtype of v_new, Aqk and field: (the worst (chunk, head) block's
# max|d| / max|ref|, ||d|| / ||ref|| over the whole array). Measured maxima over every case below
# (default and large) in the comments; the bounds keep 5x or more. A missing tril or diagonal, a
# transposed product or operands rounded to bf16 (no split) fail them by orders of magnitude
# (test_tolerances_catch_wrong_formulas).
TOL = {
    "bfloat16": {"dAqk": (2e-5, 1.5e-5),      # measured 3.0e-6, 2.5e-6
                 "dv": (2.5e-5, 1.5e-5)},     # measured 4.9e-6 (the pipeline case), 2.5e-6
    "float32": {"dAqk": (3e-5, 2.5e-5),       # measured 5.9e-6, 4.7e-6
                "dv": (3.5e-5, 2.5e-5)},      # measured 6.5e-6, 4.5e-6
}
# do in bf16 too (what pipeline.backward hands over for bf16 o): TMA, one wgmma per product, the
# reference on the same bf16 values; only float32 summation order is left
TOL["all_bf16"] = TOL["bfloat16"]

CASES = {
    # id: lens, HV, V; Ta = 2 or 3 chunks: partial chunks and a whole padding chunk
    "V64-HV2-30_20": ([30, 20], 2, 64),
    "V128-HV1-100": ([100], 1, 128),
    "V128-HV2-50": ([50], 2, 128),
    "V64-HV1-64": ([64], 1, 64),
}


@functools.lru_cache(maxsize=None)
def make_inputs(case, dtype, seed=60):
  """(v_new, Aqk, do) and the [Ta] real-token mask; dtype "all_bf16": do bf16 as well."""
  lens, HV, V = CASES[case]
  _, _, Aqk, v_new, valid = stage_inputs(seed, lens, HV=HV, K=64, V=V, BT=BT)
  (do,) = bwd_setup.randn(seed + 1, v_new.shape)
  do = jnp.where(jnp.asarray(valid)[None, :, None, None], do, 0.0)
  if isinstance(dtype, str):
    return (v_new.astype(BF16), Aqk.astype(BF16), do.astype(BF16)), valid
  return (v_new.astype(dtype), Aqk.astype(dtype), do), valid


_kernel = jax.jit(functools.partial(mgv.apply, chunk_size=BT, interpret=True))
_reference = jax.jit(functools.partial(bwd_dav.reference.apply, chunk_size=BT))


@functools.lru_cache(maxsize=None)
def run_case(case, dtype):
  """(args, valid, kernel Out, reference Out, kernel seconds)."""
  args, valid = make_inputs(case, dtype)
  t0 = time.time()
  got = jax.block_until_ready(_kernel(*args))
  return args, valid, got, _reference(*args), time.time() - t0


def errors(got, want):
  return bwd_setup.block_errors(got, want, FIELDS)


def failures(errs, dtype):
  return [n for n, e in errs.items() if not (e[0] <= TOL[dtype][n][0] and e[1] <= TOL[dtype][n][1])]   # NaN fails


DTYPES = {"bfloat16": BF16, "float32": F32, "all_bf16": "all_bf16"}
DEFAULT = {("V64-HV2-30_20", "bfloat16"), ("V128-HV1-100", "bfloat16"), ("V128-HV2-50", "float32"),
           ("V64-HV1-64", "float32"), ("V64-HV2-30_20", "all_bf16"), ("V128-HV2-50", "all_bf16")}
MATRIX = [(c, d) for c in CASES for d in DTYPES]


@pytest.mark.parametrize("case,dtype", [pytest.param(*m, marks=() if m in DEFAULT else pytest.mark.large)
                                        for m in MATRIX], ids=[f"{c}-{d}" for c, d in MATRIX])
def test_kernel_matches_reference(case, dtype):
  args, valid, got, want, secs = run_case(case, DTYPES[dtype])
  errs = errors(got, want)
  print(f"\n  {case} {dtype} ({secs:.2f}s): {fmt(errs)}")
  for name in FIELDS:
    x, w = getattr(got, name), getattr(want, name)
    assert x.dtype == F32 and x.shape == w.shape, (name, x.dtype, x.shape)
  assert not failures(errs, dtype), f"beyond TOL: {fmt(errs)}"
  # exact zeros: above the diagonal, at padding rows and columns of dAqk, at padding rows of dv
  dA, dv = (np.asarray(x)[0] for x in got)
  assert np.abs(dA).max() > 0 and np.abs(dv).max() > 0
  np.testing.assert_array_equal(dA, np.asarray(bwd_setup.mask_rows(got.dAqk, BT, strict=False))[0])
  col_pad = ~valid.reshape(-1, BT)[np.arange(len(valid)) // BT]        # [Ta, BT]: column j of row t's chunk
  assert not dA[~valid].any() and not np.where(col_pad[:, None, :], dA, 0.0).any()
  assert not dv[~valid].any()


def _variant(v_new, Aqk, do, *, diag=True, tril=True, transpose_A=True, no_split=False):
  """The stage's formula in float64 numpy with one thing wrong: no diagonal or no tril in dAqk,
  Aqk @ do for Aqk^T @ do, or the operands rounded to bf16 (a kernel without the hi + lo split)."""
  if no_split:
    v_new, Aqk, do = (x.astype(BF16) for x in (v_new, Aqk, do))
  v, A, d = (np.asarray(bwd_setup.chunk_mats(x.astype(F32), BT), np.float64) for x in (v_new, Aqk, do))
  dA = d @ np.swapaxes(v, -1, -2)                                        # [NTa, HV, BT(i), BT(j)]
  i, j = np.arange(BT)[:, None], np.arange(BT)[None, :]
  if tril:
    dA = np.where((j < i) | ((j == i) & diag), dA, 0.0)
  dv = (np.swapaxes(A, -1, -2) if transpose_A else A) @ d
  return bwd_dav.Out(*(bwd_setup.row_layout(jnp.asarray(x, F32)) for x in (dA, dv)))


@pytest.mark.parametrize("case,dtype", [("V64-HV2-30_20", "bfloat16"), ("V128-HV2-50", "all_bf16"),
                                        pytest.param("V128-HV2-50", "float32", marks=pytest.mark.large)])
def test_tolerances_catch_wrong_formulas(case, dtype):
  """TOL is tight enough: the kernel's outputs fail against references of subtly wrong formulas;
  the right formula (this _variant unchanged) passes."""
  args, _, got, _, _ = run_case(case, DTYPES[dtype])
  assert not failures(errors(got, _variant(*args)), dtype), case
  wrong = {"diagonal missing": (dict(diag=False), {"dAqk"}), "tril missing": (dict(tril=False), {"dAqk"}),
           "Aqk not transposed": (dict(transpose_A=False), {"dv"}),
           "operands in bf16 (no split)": (dict(no_split=True), {"dAqk", "dv"})}
  if dtype == "all_bf16":                    # bf16 operands are the right ones there
    del wrong["operands in bf16 (no split)"]
  for label, (kw, must_fail) in wrong.items():
    errs = errors(got, _variant(*args, **kw))
    print(f"\n  {case} {dtype} vs {label}: {fmt(errs)}")
    assert must_fail <= set(failures(errs, dtype)), (case, label, fmt(errs))


# -- the predicate -----------------------------------------------------------------------------------

def _abstract(Ta, HV, V, dtype=BF16):
  S = jax.ShapeDtypeStruct
  return S((1, Ta, HV, V), dtype), S((1, Ta, HV, BT), dtype), S((1, Ta, HV, V), F32)


def test_supports():
  """`supports`, the stage's predicate: what the kernel can run, and bf16 v_new, Aqk (`apply` itself
  takes float32 ones); the pipeline's choice follows it."""
  kw = dict(chunk_size=BT)
  zeros = lambda *a, **k: [jnp.zeros(s.shape, s.dtype) for s in _abstract(*a, **k)]
  good = zeros(128, 2, 64)
  assert mgv.supports(*good, **kw) is None and mgv.supports(*good, config=mgv.Config(), **kw) is None
  assert bwd_dav.STAGE.mosaic_gpu is mgv
  f32 = zeros(128, 2, 64, dtype=F32)
  assert "takes bfloat16 v_new, Aqk (float32 keeps the reference), got v_new float32, Aqk float32" in mgv.supports(*f32, **kw)
  assert "got Aqk float32" in mgv.supports(good[0], f32[1], good[2], **kw)
  with_ = lambda i, x: good[:i] + [x] + good[i + 1:]
  refused = {
      "chunk_size must be 64, got 32": (good, dict(kw, chunk_size=32)),
      "V must be one of (64, 128), got 256": (zeros(128, 2, 256), kw),    # the stage's jnp reference runs
      "V must be one of (64, 128), got 32": (zeros(64, 1, 32), kw),
      "Ta must be a multiple of 64, got 100": ([x[:, :100] for x in good], kw),
      "v_new must be [1, Ta, HV, V]": ([jnp.concatenate([x, x]) for x in good], kw),
      "Aqk must have shape (1, 128, 2, 64)": (with_(1, good[1][..., :32]), kw),
      "do must have shape (1, 128, 2, 64)": (with_(2, good[2][:, :64]), kw),
      "mosaic_gpu bwd_dav takes floating do, got int32": (with_(2, good[2].astype(jnp.int32)), kw),
      "mosaic_gpu bwd_dav takes floating Aqk, got int32": (with_(1, good[1].astype(jnp.int32)), kw),
  }
  for reason, (args, kwargs) in refused.items():
    assert reason in (mgv.supports(*args, **kwargs) or ""), (reason, mgv.supports(*args, **kwargs))
    with pytest.raises(ValueError, match=re.escape(f"mosaic_gpu bwd_dav kernel: {reason}")):
      mgv.apply(*args, interpret=True, **kwargs)
  big = _abstract(128, mgv.MAX_GRID_YZ + 1, 64)
  assert "HV must be <= 65535" in mgv.supports(*big, **kw)
  # the pipeline: an impl dict naming bwd_dav runs the kernel or raises the predicate's reason;
  # impl=None takes it on Hopper
  strict = planning.make_plan(scale=0.125, chunk_size=BT, impl={"bwd_dav": "mosaic_gpu"})
  assert planning.choose(strict, "bwd_dav", *good, **kw) == "mosaic_gpu"
  with pytest.raises(ValueError, match=r"impl\['bwd_dav'\] = 'mosaic_gpu': V must be one of"):
    planning.choose(strict, "bwd_dav", *zeros(128, 2, 96), **kw)
  with pytest.raises(ValueError, match=r"impl\['bwd_dav'\] = 'mosaic_gpu': .*takes bfloat16 v_new"):
    planning.choose(strict, "bwd_dav", *f32, **kw)
  assert planning.default_impls(("bwd_dav",), "gpu", "sm90")["bwd_dav"] == "mosaic_gpu"
  assert planning.default_impls(("bwd_dav",), "gpu", "gpu")["bwd_dav"] != "mosaic_gpu"


# -- CUDA lowering and SMEM --------------------------------------------------------------------------

@pytest.mark.parametrize("V,dtype", [(128, "bfloat16"), (64, "float32"), (128, "all_bf16"),
                                     pytest.param(64, "bfloat16", marks=pytest.mark.large),
                                     pytest.param(128, "float32", marks=pytest.mark.large)])
def test_kernel_lowers_for_cuda(V, dtype):
  """One Mosaic GPU kernel, lowered for CUDA from the CPU with 70000 chunks (on grid x)."""
  f = functools.partial(mgv.apply, chunk_size=BT)
  args = _abstract(70000 * BT, 2, V, BF16 if dtype == "all_bf16" else DTYPES[dtype])
  if dtype == "all_bf16":
    args = args[:2] + (jax.ShapeDtypeStruct(args[2].shape, BF16),)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1


@pytest.mark.parametrize("V,all_bf16,want", [(64, False, 49152), (128, False, 81920), (128, True, 40968)])
def test_kernel_smem(V, all_bf16, want):
  """Two CTAs per SM, as lowered for CUDA and as `smem_bytes` (the predicate's figure) computes it
  from the launcher's scratch: the split body's hi and lo parts of do, v_new [64, V] and Aqk
  [64, 64] (six swizzled bf16 tiles, nothing by TMA: no barrier); the bf16 body's three tiles and a
  barrier."""
  args = _abstract(4096, 16, V)
  if all_bf16:
    args = args[:2] + (jax.ShapeDtypeStruct(args[2].shape, BF16),)
  smem = lowered_smem_bytes(functools.partial(mgv.apply, chunk_size=BT), *args)
  print(f"\n  bwd_dav V={V} all_bf16={all_bf16}: SMEM {smem} bytes as lowered")
  assert smem <= SMEM_TWO_CTAS
  assert smem == want == mgv.smem_bytes(V, all_bf16)


@pytest.mark.large
def test_pipeline_hands_the_kernel_bf16_and_it_takes_them():
  """pipeline.backward with impl="mosaic_gpu" (simulator) on bf16 inputs: the forward's intra kernel
  saves Aqk and S0's kernels recompute v_new in bf16, so bwd_dav runs the kernel (the predicate
  takes the call), and its record matches the reference on the same inputs within TOL."""
  from kda import padding
  from tests import cases
  inp = cases.make_inputs(3, lens=[45, 80, 0, 20], H=2, HV=2, K=64, V=64, dtype=BF16)
  T = inp.q.shape[1]
  plan = planning.make_plan(scale=0.125, chunk_size=BT, impl="mosaic_gpu", interpret=True)
  (do,) = bwd_setup.randn(4, inp.v.shape)
  do = do.astype(BF16)                       # o's dtype, as jax.grad hands it over
  dht = jnp.zeros(inp.initial_state.shape, F32)
  x = (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state, inp.A_log, inp.dt_bias)

  @jax.jit
  def recorded(x, cu, do, dht):
    layout = padding.layout_from_cu_seqlens(cu, T, BT)
    _, _, frec = pipeline.forward(plan, layout, *x)
    return pipeline.backward(plan, layout, *x, pipeline.saved(frec), do, dht, record=True)[1]

  rec = jax.block_until_ready(recorded(x, inp.cu_seqlens, do, dht))
  args = rec["inputs"]["bwd_dav"]
  assert [jnp.dtype(a.dtype) for a in args[:3]] == [jnp.dtype(BF16)] * 3     # do aligned in o's dtype
  assert planning.choose(plan, "bwd_dav", *args, chunk_size=BT) == "mosaic_gpu"
  errs = errors(rec["bwd_dav"], _reference(*args))
  print(f"\n  pipeline bwd_dav record vs reference: {fmt(errs)}")
  assert not failures(errs, "bfloat16"), fmt(errs)


@pytest.mark.parametrize("dtype", ["all_bf16", "float32"])
def test_skip_tail_reads_nothing_there(dtype):
  """Config(skip_tail=True) with aligned_cu: the chunk past aligned_cu[-1] (the case's whole padding
  chunk) gets zeros without being read (NaN there changes nothing), every other chunk the same bits
  as with the switch off."""
  args, valid, got, _, _ = run_case("V64-HV2-30_20", DTYPES[dtype])
  acu = jnp.asarray([0, 64, 128], jnp.int32)             # lens 30, 20: the third chunk is tail
  assert args[0].shape[1] == 3 * BT
  tail = (jnp.arange(3 * BT) >= 128)[None, :, None, None]
  poisoned = tuple(jnp.where(tail, jnp.nan, x).astype(x.dtype) for x in args)
  skip = jax.jit(functools.partial(mgv.apply, chunk_size=BT, interpret=True, config=mgv.Config(skip_tail=True)))
  out = jax.block_until_ready(skip(*poisoned, acu))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(got, name)), name)
  # Config(skip_tail=False): every chunk computed (the program without aligned_cu), the same bits
  noskip = jax.jit(functools.partial(mgv.apply, chunk_size=BT, interpret=True, config=mgv.Config(skip_tail=False)))
  same = jax.block_until_ready(noskip(*args, acu))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(same, name)), np.asarray(getattr(got, name)), name)
  # the reference takes aligned_cu too (unused)
  ref = bwd_dav.reference.apply(*args, acu, chunk_size=BT)
  assert not failures(errors(out, ref), dtype)


def test_skip_tail_lowers_for_cuda():
  """Config.skip_tail changes the lowered program (with aligned_cu); both lower for CUDA."""
  args = _abstract(4096, 2, 128) + (jax.ShapeDtypeStruct((9,), jnp.int32),)
  txt = {}
  for skip in (True, False):
    f = functools.partial(mgv.apply, chunk_size=BT, config=mgv.Config(skip_tail=skip))
    txt[skip] = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt[skip].splitlines()) == 1
  assert txt[True] != txt[False]


@pytest.mark.parametrize("V", [64, 128])
def test_packed_do_equals_aligned(V):
  """do_packed + rows: the kernel reads do packed (a 70-token gap and 5 tokens after the last
  sequence: NaN, never read into a result) and both outputs are bit for bit the aligned do's, with
  and without the tail's zeros; the aligned do is not read (NaN everywhere changes nothing); with
  clean, non-finite values at real tokens read as 0. It lowers for CUDA with its plain landing
  counted in `smem_bytes`."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  lens, HV = [30, 64, 0, 65, 1], 2
  layout, valid = packed_layout(lens, [0, 70, 0, 0, 0], extra_T=5, tail_chunks=1)
  Ta = layout.Ta
  real = jnp.asarray(valid)[None, :, None, None]
  vn, A = bwd_setup.randn(11, (1, Ta, HV, V), (1, Ta, HV, BT))
  vn = jnp.where(real, vn, 0.0).astype(BF16)
  A = bwd_setup.mask_rows(jnp.where(real, A, 0.0), BT, strict=False).astype(BF16)
  (do_p,) = bwd_setup.randn(12, (1, layout.T, HV, V))
  owned = padding.packed_owned_mask(layout)[None, :, None, None]
  do_p = jnp.where(owned, do_p, jnp.nan).astype(BF16)
  do = padding.align_with(layout, jnp.where(owned, do_p, 0))
  rows = padding.chunk_rows(layout)
  run = lambda do, **kw: jax.block_until_ready(jax.jit(functools.partial(
      mgv.apply, chunk_size=BT, interpret=True, **kw))(vn, A, do, layout.aligned_cu))
  for tz in (True, False):
    want = run(do, tail_zeros=tz)
    got = run(jnp.full_like(do, jnp.nan), tail_zeros=tz, do_packed=do_p, rows=rows)
    live = slice(None) if tz else slice(0, int(layout.aligned_cu[-1]))
    for name in FIELDS:
      np.testing.assert_array_equal(np.asarray(getattr(got, name))[:, live], np.asarray(getattr(want, name))[:, live],
                                    name)
    assert float(np.abs(np.asarray(want.dv)[:, live]).max()) > 0
  # clean (traced): a NaN and an inf in do at real tokens read as 0, the same bits as 0 there
  t = int(layout.starts[1]) + 4
  bad = do_p.at[0, t, 1, 3].set(jnp.nan).at[0, t + 40, 0, 0].set(jnp.inf)
  zeroed = jnp.where(jnp.isfinite(bad) | ~owned, bad, 0).astype(BF16)
  f = jax.jit(lambda clean, p: mgv.apply(vn, A, do, layout.aligned_cu, chunk_size=BT, interpret=True, do_packed=p,
                                         rows=rows, clean=clean))
  for name, a, b in zip(FIELDS, f(True, bad), f(False, zeroed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)
  assert not np.isfinite(np.asarray(f(False, bad).dv)).all()
  assert "packed do must be bf16" in mgv.supports(vn, A, do, chunk_size=BT, do_packed=do_p.astype(F32))
  smem = lowered_smem_bytes(lambda *a: mgv.apply(*a, chunk_size=BT, do_packed=do_p, rows=rows), vn, A, do)
  assert smem == mgv.smem_bytes(V, True, packed=True) == mgv.smem_bytes(V, True) + BT * V * 2
