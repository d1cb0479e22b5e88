"""The Mosaic GPU bwd_wy kernel against the bwd_wy reference: simulator runs on CPU, CUDA lowering,
SMEM as lowered, the stage's predicate.

Inputs: test_intra_mosaic.make_case's aligned layouts (bf16 q, k, v; padding rows after every
sequence and a whole padding chunk; ordinary gates, or strong ones with floored -inf gates, gc down
to about -8000), Ainv from the intra reference on them rounded to bf16 (what the forward kernels
save), and random S2 cotangents dqg, dkg, dw, du, dgc_last, zero at padding rows as S2 hands them
over. The reference gets the same bf16 values (upcast), so what is left is the kernel's own
rounding: hi + lo bf16 splits of the float32 wgmma operands and float32 order of summation.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import plan as planning
from kda.stages import bwd_wy, intra
from kda.stages.bwd_wy import mosaic_gpu as mgw
from kda.stages.intra import chunk_decays, from_chunks, to_chunks
from tests.stages import bwd_setup
from tests.stages.test_intra_mosaic import SMEM_TWO_CTAS, make_case
from tests.stages.test_output_mosaic import lowered_smem_bytes

fmt = bwd_setup.fmt
BT = 64
F32, BF16 = jnp.float32, jnp.bfloat16
FIELDS = bwd_wy.Out._fields
HI = jax.lax.Precision.HIGHEST

# Kernel vs reference, per field: (the worst (chunk, head) block's max|d| / max|ref|, ||d|| / ||ref||).
# Measured maxima over every case below (default and large) in the comments; the bounds keep 5x or
# more. A wrong formula fails them by orders of magnitude (test_tolerances_catch_wrong_formulas).
TOL = {
    "dq": (1e-5, 1e-5),        # measured 0 (one float32 product, as the reference)
    "dk": (2e-5, 5e-6),        # measured 3.6e-6, 1.0e-6
    "dv": (3e-5, 1.5e-5),      # measured 5.6e-6, 2.5e-6
    "dbeta": (3e-5, 1.5e-5),   # measured 4.8e-6, 2.6e-6
    "dgc": (2e-5, 6e-6),       # measured 3.2e-6, 1.2e-6
    "dg_state": (1e-6, 1e-7),  # measured 1.1e-7, 1.2e-8 (L's operand in three bf16 terms)
    "dAkk": (6e-5, 3e-5),      # measured 1.1e-5, 5.7e-6
}

CASES = {
    # id: lens, Ta, HV, K, V; 3 chunks: padding rows in a partial chunk, the last chunk all padding
    "K64-V64-HV2-40_64": ([40, 64], 192, 2, 64, 64),
    "K128-V64-HV1-100": ([100], 192, 1, 128, 64),
    "K64-V128-HV2-64_50": ([64, 50], 192, 2, 64, 128),
    "K128-V128-HV1-130": ([130], 192, 1, 128, 128),
}


def _packed_kw(lens, Ta):
  """A packed layout of `lens` (a 3-token and a 70-token gap, 5 tokens after the last, the tail chunks
  up to Ta) and the packed-dv keywords rows, pieces, T."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  layout, _ = packed_layout(lens, [3, 70], extra_T=5, tail_chunks=(Ta - sum(-(-n // BT) * BT for n in lens)) // BT)
  rows = padding.chunk_rows(layout)
  return layout, dict(rows=rows, pieces=padding.gap_pieces(rows, layout.aligned_cu, layout.T, BT), T=layout.T)


@functools.lru_cache(maxsize=None)
def make_inputs(case, gates, seed=60):
  """The stage's arguments (q, k, v, Ainv bf16; the rest float32) and the [Ta] real-token mask."""
  lens, Ta, HV, K, V = CASES[case]
  (q, k, v, beta, gi, gf), valid = make_case(lens, Ta, HV, K, V, gates)
  Ainv = intra.reference.apply(q, k, v, beta, gi, gf, scale=K ** -0.5, chunk_size=BT).Ainv.astype(BF16)
  NTa = Ta // BT
  dqg, dkg, dw, du = bwd_setup.randn(seed, q.shape, k.shape, k.shape, v.shape)
  live = jnp.asarray(valid)[None, :, None, None]
  dqg, dkg, dw, du = (jnp.where(live, x, 0.0) for x in (dqg, dkg, dw, du))
  (dgc_last,) = bwd_setup.randn(seed + 1, (1, NTa, HV, K))
  return (q, k, v, beta, gi, gf, Ainv, dqg, dkg, dw, du, dgc_last), valid


# TOL is the two-term cotangents' (~2^-16); test_one_term_cotangents_stay_within_bf16_rounding takes one
EXACT = mgw.Config(cotangent_terms=2)


@functools.lru_cache(maxsize=None)
def _kernel():
  return jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True, config=EXACT))


@functools.lru_cache(maxsize=None)
def run_case(case, gates):
  args, valid = make_inputs(case, gates)
  got = jax.block_until_ready(_kernel()(*args))
  want = jax.jit(functools.partial(bwd_wy.reference.apply, chunk_size=BT))(*args)
  return args, valid, got, want


def errors(got, want):
  return bwd_setup.block_errors(got, want, FIELDS)


def failures(errs):
  return [n for n, e in errs.items() if not (e[0] <= TOL[n][0] and e[1] <= TOL[n][1])]   # NaN fails


DEFAULT = {("K64-V64-HV2-40_64", "strong"), ("K128-V128-HV1-130", "ordinary")}
MATRIX = [(c, g) for c in CASES for g in ("ordinary", "strong")]


@pytest.mark.parametrize("case,gates", [pytest.param(*m, marks=() if m in DEFAULT else pytest.mark.large)
                                        for m in MATRIX], ids=[f"{c}-{g}" for c, g in MATRIX])
def test_kernel_matches_reference(case, gates):
  args, valid, got, want = run_case(case, gates)
  errs = errors(got, want)
  print(f"\n  {case} {gates}: {fmt(errs)}")
  assert np.any(np.asarray(args[4]) != 0) == (gates == "strong")
  for name in FIELDS:
    x, w = getattr(got, name), getattr(want, name)
    assert x.dtype == F32 and x.shape == w.shape, (name, x.dtype, x.shape, w.shape)
    assert bool(jnp.all(jnp.isfinite(x))), f"{name}: not finite"
  bad = failures(errs)
  assert not bad, f"{bad} beyond TOL: {fmt(errs)}"


def _variant(q, k, v, beta, gi, gf, Ainv, dqg, dkg, dw, du, dgc_last, *, inclusive=False, transposed=True,
             drop_v_dbeta=False, diag=False):
  """The reference's formulas with one thing wrong: dg_state's cumsum inclusive, dAkk without its
  transposes (Ainv dAinv Ainv), dbeta without its v part, or dAkk's diagonal kept."""
  ein = lambda s, *a: jnp.einsum(s, *a, precision=HI)
  q, k, v, beta, gi, gf, Ainv, dqg, dkg, dw, du = (
      to_chunks(x.astype(F32), BT) for x in (q, k, v, beta, gi, gf, Ainv, dqg, dkg, dw, du))
  b = beta[..., None]
  eg, el = chunk_decays(gi, gf)
  kg, kb, vb = k * el, b * k * eg, b * v
  dkb = ein("cihj,cihk->cjhk", Ainv, dw)
  dvb = ein("cihj,cihv->cjhv", Ainv, du)
  dAinv = ein("cihk,cjhk->cihj", dw, kb) + ein("cihv,cjhv->cihj", du, vb)
  if transposed:
    M = ein("ciha,cihb->cahb", Ainv, ein("cihj,cbhj->cihb", dAinv, Ainv))
  else:
    M = ein("caih,cihb->cahb", jnp.moveaxis(Ainv, 2, 3), ein("cihj,cjhb->cihb", dAinv, Ainv))
  i, j = np.arange(BT)[None, :, None, None], np.arange(BT)[None, None, None, :]
  dAkk = jnp.where((i >= j) if diag else (i > j), -M, 0.0)
  dbeta = jnp.sum(dkb * k * eg, -1) + (0.0 if drop_v_dbeta else jnp.sum(dvb * v, -1))
  x = dkg * kg
  before = jnp.cumsum(x, axis=1) - (0.0 if inclusive else x)
  return bwd_wy.Out(*(from_chunks(y) for y in (
      dqg * eg, dkg * el + dkb * b * eg, dvb * b, dbeta, dqg * q * eg + dkb * kb,
      before + dgc_last[0][:, None], dAkk)))


@pytest.mark.parametrize("case,gates", [("K64-V64-HV2-40_64", "ordinary"),
                                        pytest.param("K128-V128-HV1-130", "strong", marks=pytest.mark.large)])
def test_tolerances_catch_wrong_formulas(case, gates):
  """TOL is tight enough: the kernel's outputs fail against subtly wrong formulas; the right one
  (_variant unchanged) passes."""
  args, _, got, _ = run_case(case, gates)
  assert not failures(errors(got, _variant(*args))), case
  wrong = {"inclusive cumsum": (dict(inclusive=True), {"dg_state"}),
           "dAkk untransposed": (dict(transposed=False), {"dAkk"}),
           "dbeta without v": (dict(drop_v_dbeta=True), {"dbeta"}),
           "dAkk diagonal kept": (dict(diag=True), {"dAkk"})}
  for label, (kw, must_fail) in wrong.items():
    errs = errors(got, _variant(*args, **kw))
    print(f"\n  {case} {gates} vs {label}: {fmt(errs)}")
    assert must_fail <= set(failures(errs)), (label, failures(errs))


def test_padding_rows():
  """At padding rows (q = k = v = beta = 0 and S2's cotangents 0 there) dq, dk, dv, dbeta, dgc are
  exactly 0 in the kernel as in the reference; dg_state carries dgc_last there (bwd_gate drops it)."""
  args, valid, got, want = run_case("K64-V64-HV2-40_64", "strong")
  pad = ~valid
  for name in ("dq", "dk", "dv", "dbeta", "dgc"):
    assert not np.asarray(getattr(got, name))[0, pad].any(), name
    assert not np.asarray(getattr(want, name))[0, pad].any(), name
  assert np.asarray(got.dg_state)[0, pad].any()


@pytest.mark.large
def test_float32_inputs_are_rounded_to_bf16():
  """float32 q, k, v, Ainv (here bf16-exact values) are cast in the launcher: the same bits."""
  args, _, got, _ = run_case("K64-V64-HV2-40_64", "ordinary")
  up = tuple(x.astype(F32) if i in (0, 1, 2, 6) else x for i, x in enumerate(args))
  f32 = jax.block_until_ready(_kernel()(*up))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(f32, name)), np.asarray(getattr(got, name)), name)


# -- the predicate -----------------------------------------------------------------------------------

def _abstract(Ta, HV, K, V, dt=BF16):
  S = jax.ShapeDtypeStruct
  xk, xv = S((1, Ta, HV, K), F32), S((1, Ta, HV, V), F32)
  return (S((1, Ta, HV, K), dt), S((1, Ta, HV, K), dt), S((1, Ta, HV, V), dt), S((1, Ta, HV), F32),
          xk, xk, S((1, Ta, HV, BT), dt), xk, xk, xk, xv, S((1, Ta // BT, HV, K), F32))


def test_supports():
  """`supports`, the stage's predicate: what the kernel can run, and bf16 q, k, v, Ainv (`apply`
  itself rounds float32 ones); the pipeline's choice follows it."""
  kw = dict(chunk_size=BT)
  good = [jnp.zeros(s.shape, s.dtype) for s in _abstract(128, 2, 64, 128)]
  assert mgw.supports(*good, **kw) is None and mgw.supports(*good, config=mgw.Config(), **kw) is None
  assert bwd_wy.STAGE.mosaic_gpu is mgw
  f32 = [x.astype(F32) for x in good]
  assert "takes bfloat16 q, k, v, Ainv" in mgw.supports(*f32, **kw)   # float32 keeps the reference
  zeros = lambda *a: [jnp.zeros(s.shape, s.dtype) for s in _abstract(*a)]
  with_ = lambda i, x: good[:i] + [x] + good[i + 1:]
  refused = {
      "chunk_size must be 64, got 32": (good, dict(kw, chunk_size=32)),
      "K must be one of (64, 128), got 256": (zeros(128, 2, 256, 64), kw),    # the stage's jnp reference runs
      "K must be one of (64, 128), got 96": (zeros(128, 2, 96, 64), kw),
      "V must be one of (64, 128), got 32": (zeros(128, 2, 64, 32), kw),
      "Ta must be a multiple of 64, got 100": ([x[:, :100] if x.ndim < 4 or x.shape[1] == 128 else x
                                                for x in good], kw),
      "dgc_last must have shape": (with_(11, good[11][:, :1]), kw),
      "Ainv must have shape": (with_(6, good[6][..., :32]), kw),
      "du must have shape": (with_(10, good[10][..., :64]), kw),
  }
  for reason, (args, kwargs) in refused.items():
    assert reason in (mgw.supports(*args, **kwargs) or ""), (reason, mgw.supports(*args, **kwargs))
    with pytest.raises(ValueError, match=re.escape(f"mosaic_gpu bwd_wy kernel: {reason}")):
      mgw.apply(*args, interpret=True, **kwargs)
  assert "takes floating dw, got int32" in mgw.supports(*with_(9, good[9].astype(jnp.int32)), **kw)
  strict = planning.make_plan(scale=0.125, chunk_size=BT, impl={"bwd_wy": "mosaic_gpu"})
  assert planning.choose(strict, "bwd_wy", *good, **kw) == "mosaic_gpu"
  with pytest.raises(ValueError, match=r"impl\['bwd_wy'\] = 'mosaic_gpu': mosaic_gpu bwd_wy takes bfloat16"):
    planning.choose(strict, "bwd_wy", *f32, **kw)
  assert planning.default_impls(("bwd_wy",), "gpu", "sm90")["bwd_wy"] == "mosaic_gpu"


# -- CUDA lowering and SMEM --------------------------------------------------------------------------

def test_kernel_lowers_for_cuda():
  """Lowered for CUDA from the CPU with 70000 chunks (on grid x) and float32 q, k, v, Ainv (the
  launcher's casts): one Mosaic GPU kernel."""
  f = functools.partial(mgw.apply, chunk_size=BT)
  txt = jax.jit(f).trace(*_abstract(70000 * BT, 2, 128, 64, dt=F32)).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1


@pytest.mark.parametrize("K,V,want", [(128, 128, 100360), (64, 64, 75784)])
def test_kernel_smem(K, V, want):
  """Two CTAs per SM: q, k, v slabs, Ainv, four work tiles and L, [64, 64] bf16 each (8 KiB), the
  reduction scratch and the barrier; as lowered for CUDA and as `smem_bytes` (the predicate's
  figure) computes it from the launcher's scratch."""
  smem = lowered_smem_bytes(functools.partial(mgw.apply, chunk_size=BT), *_abstract(4096, 16, K, V))
  print(f"\n  bwd_wy K={K} V={V}: SMEM {smem} bytes as lowered")
  tiles = 2 * K // 64 + V // 64 + 6
  assert tiles * 8192 < smem <= tiles * 8192 + 4096
  assert smem <= SMEM_TWO_CTAS and smem == want == mgw.smem_bytes(K, V)


@pytest.mark.large
def test_chunk_kda_grad_with_the_kernel():
  """kda.chunk_kda's gradient with bwd_wy's kernel (simulator) against bwd_wy's reference, bf16 inputs,
  the intra kernel in the forward in both (it saves the bf16 Ainv the kernel takes): the pipeline's
  wiring (argument order, dg_state, dAkk into bwd_intra)."""
  import kda
  from tests import cases
  inp = cases.make_inputs(3, lens=[45, 80, 0, 20], H=2, HV=2, K=64, V=64, gate="plain")
  x = tuple(y.astype(BF16) for y in (inp.q, inp.k, inp.v)) + (inp.g, inp.beta.astype(BF16))
  wo = jax.random.normal(jax.random.PRNGKey(9), inp.v.shape)

  def grads(impl):
    def loss(q, k, v, g, beta):
      o, _ = kda.chunk_kda(q, k, v, g, beta, initial_state=inp.initial_state, cu_seqlens=inp.cu_seqlens,
                           chunk_size=BT, impl=impl)
      return jnp.sum(o.astype(F32) * wo)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*x)

  got, want = grads({"bwd_wy": "mosaic_gpu", "intra": "mosaic_gpu"}), grads({"intra": "mosaic_gpu"})
  # the gradients return in the inputs' bf16: the kernel's ~1e-5 differences flip a rounding now
  # and then (one bf16 ulp, 2^-8 of an element; measured 3.4e-4 of the max on dv)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
    bwd_setup.close(name, a.astype(F32), b.astype(F32), tol=4e-3)


@pytest.mark.large         # ~6 s (CI budget); its CUDA lowering runs by default
def test_skip_tail_reads_nothing_there():
  """Config(skip_tail=True) with aligned_cu: the chunk past aligned_cu[-1] (the case's last, all
  padding) gets zeros without being read (NaN there changes nothing); with S2's dgc_last 0 there, as
  bwd_dh hands it, every output is bit for bit the one without the switch."""
  args, _ = make_inputs("K64-V64-HV2-40_64", "strong")
  acu = jnp.asarray([0, 64, 128], jnp.int32)
  args = args[:11] + (args[11].at[:, 2].set(0.0),)
  plain = jax.block_until_ready(_kernel()(*args))
  tail = (jnp.arange(192) >= 128)
  poison = lambda x: jnp.where(tail.reshape((1, 192) + (1,) * (x.ndim - 2)), jnp.nan, x).astype(x.dtype)
  bad = tuple(poison(x) for x in args[:11]) + (args[11].at[:, 2].set(jnp.nan),)
  skip = jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True,
                                   config=dataclasses.replace(EXACT, skip_tail=True)))
  out = jax.block_until_ready(skip(*bad, acu))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(plain, name)), name)
  np.testing.assert_array_equal(np.asarray(skip(*args).dq), np.asarray(plain.dq))   # no aligned_cu: no skip
  ref = bwd_wy.reference.apply(*args, acu, chunk_size=BT)
  assert not failures(errors(out, ref))


def _lowered(config, K=128, V=128):
  return _lowered_text(config, K, V)


@functools.lru_cache(maxsize=None)              # one lowering per (config, K, V), however called
def _lowered_text(config, K, V):
  args = _abstract(4096, 2, K, V) + (jax.ShapeDtypeStruct((9,), jnp.int32),)
  txt = jax.jit(functools.partial(mgw.apply, chunk_size=BT, config=config)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  return txt


# every Config field off its default
FLIPPED = {"approx_math": False, "skip_tail": False, "cotangent_terms": 3 - mgw.Config().cotangent_terms,
           "overlap_loads": not mgw.Config().overlap_loads,
           "split": not mgw.Config().split}


@pytest.mark.parametrize("field", sorted(FLIPPED))
def test_config_fields_change_the_program(field):
  """Each Config field flipped from its default gives another lowered program (CUDA, with aligned_cu)."""
  assert _lowered(mgw.Config(**{field: FLIPPED[field]})) != _lowered(mgw.Config())


def test_flipped_config_matches_the_reference():
  """Every Config field off its default (exp without ex2.approx, the tail chunk computed from its
  zero inputs), with two-term cotangents (TOL's): the outputs still match the reference (simulator)."""
  args, _ = make_inputs("K64-V64-HV2-40_64", "strong")
  acu = jnp.asarray([0, 64, 128], jnp.int32)
  args = args[:11] + (args[11].at[:, 2].set(0.0),)         # dgc_last 0 past aligned_cu[-1], as bwd_dh hands it
  cfg = mgw.Config(**{**FLIPPED, "cotangent_terms": 2})
  got = jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True, config=cfg))(*args, acu)
  errs = errors(got, bwd_wy.reference.apply(*args, acu, chunk_size=BT))
  assert not failures(errs), fmt(errs)


def test_dv_dtype_rounds_dv_alone():
  """dv_dtype=bfloat16 (what the pipeline passes for bf16 v): dv is float32 dv rounded once, every
  other output the same bits; the reference does the same."""
  args, _, got, want = run_case("K64-V64-HV2-40_64", "ordinary")
  out = jax.block_until_ready(jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True,
                                                        dv_dtype=BF16, config=EXACT))(*args))
  assert out.dv.dtype == BF16 and got.dv.dtype == F32
  np.testing.assert_array_equal(np.asarray(out.dv.astype(F32)), np.asarray(got.dv.astype(BF16).astype(F32)))
  for name in FIELDS:
    if name != "dv":
      np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(got, name)), name)
  ref = bwd_wy.reference.apply(*args, chunk_size=BT, dv_dtype=BF16)
  assert ref.dv.dtype == BF16
  np.testing.assert_array_equal(np.asarray(ref.dv.astype(F32)), np.asarray(want.dv.astype(BF16).astype(F32)))
  txt = jax.jit(functools.partial(mgw.apply, chunk_size=BT, dv_dtype=BF16)).trace(
      *_abstract(4096, 2, 128, 128)).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1


@pytest.mark.parametrize("case,gaps", [("K64-V128-HV2-64_50", [3, 70])], ids=["K64-V128-gaps"])
def test_packed_dv_equals_aligned_unaligned(case, gaps):
  """rows / pieces / T given: dv stored packed (bf16, as the pipeline asks) equals the aligned
  kernel's dv unaligned, bit for bit, exactly 0 at tokens of no sequence (a 70-token gap: two
  pieces, and 5 tokens after the last); every other output bit for bit the aligned kernel's."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  lens, Ta, HV, K, V = CASES[case]
  args, valid = make_inputs(case, "ordinary")
  layout, pvalid = packed_layout(lens, gaps, extra_T=5, tail_chunks=(Ta - 128) // BT)
  assert layout.Ta == Ta and np.array_equal(pvalid, np.asarray(valid))
  rows = padding.chunk_rows(layout)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, BT)
  f = lambda *a, **kw: mgw.apply(*a, layout.aligned_cu, chunk_size=BT, dv_dtype=BF16, interpret=True, **kw)
  got = jax.jit(lambda *a: f(*a, rows=rows, pieces=pieces, T=layout.T))(*args)
  want = jax.jit(f)(*args)
  owned = np.asarray(padding.packed_owned_mask(layout))
  dv = np.asarray(got.dv.astype(F32))
  assert got.dv.shape == (1, layout.T, HV, V) and got.dv.dtype == BF16
  np.testing.assert_array_equal(dv, np.asarray(padding.unalign_with(layout, want.dv).astype(F32)))
  assert np.all(dv[:, ~owned] == 0) and (~owned).sum() == 78
  for name in FIELDS:
    if name != "dv":
      np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  with pytest.raises(ValueError, match="packed dv"):
    mgw.apply(*args, chunk_size=BT, rows=rows, pieces=pieces, T=layout.T)


@pytest.mark.parametrize("case,split", [("K64-V128-HV2-64_50", False), ("K128-V128-HV1-130", True)],
                         ids=["K64-V128", "K128-split"])
def test_packed_qkv_equals_aligned(case, split):
  """qkv_packed: q, k, v read from the packed arrays (NaN at tokens of no sequence: a 70-token gap
  and 5 tokens after the last) give every output bit for bit the call on their aligned copies (in-order
  and split kernels, packed dv); it lowers for CUDA."""
  lens, Ta, HV, K, V = CASES[case]
  args, _ = make_inputs(case, "ordinary")
  layout, kw = _packed_kw(lens, Ta)
  assert layout.Ta == Ta
  kw.update(dv_dtype=BF16, chunk_size=BT, config=mgw.Config(split=split))
  packed, aligned = bwd_setup.packed_and_aligned(layout, args[:3])
  f = lambda *a, **k: mgw.apply(*a, layout.aligned_cu, interpret=True, **kw, **k)
  want = jax.jit(f)(*aligned, *args[3:])
  got = jax.jit(lambda *a: f(*a, qkv_packed=True))(*packed, *args[3:])
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  assert float(np.abs(np.asarray(got.dk)).max()) > 0
  low = jax.jit(lambda *a: mgw.apply(*a, layout.aligned_cu, qkv_packed=True, **kw)).trace(
      *packed, *args[3:]).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in line for line in low.splitlines()) == 1


@pytest.mark.parametrize("K,V,packed", [(128, 128, False), (64, 128, True)])
def test_overlapped_loads_give_the_same_bits(K, V, packed):
  """Config(overlap_loads=True) issues the later operands' loads while the products run: every
  output bit for bit the in-order kernel's (simulator; aligned, and packed dv with a gap), each
  cotangent-term count; and it lowers for CUDA (each operand still read before its rows are
  written in place)."""
  case = {(128, 128): "K128-V128-HV1-130", (64, 128): "K64-V128-HV2-64_50"}[(K, V)]
  args, kw = _strong_args(case, packed)
  for ct in (1, 2):
    run = lambda overlap: jax.jit(functools.partial(
        mgw.apply, chunk_size=BT, interpret=True, dv_dtype=BF16 if packed else None,
        config=mgw.Config(cotangent_terms=ct, overlap_loads=overlap), **kw))(*args)
    got, want = run(True), run(False)
    for name in FIELDS:
      np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), f"{name} ct={ct}")
  assert "stablehlo.custom_call @mosaic_gpu" in _lowered(mgw.Config(overlap_loads=True), K, V)


@pytest.mark.parametrize("case,packed", [("K64-V64-HV2-40_64", False), ("K128-V128-HV1-130", False),
                                         ("K128-V128-HV1-130", True)], ids=["K64", "K128", "K128-packed"])
def test_split_kernel_matches_the_in_order_kernel(case, packed):
  """Config(split=True): one program per (slab, head, chunk), every operand by TMA up front. Every
  output but dbeta and dAkk bit for bit the in-order kernel's; those two are sums over the slabs'
  parts (float32 associated by slab: the same bits at one slab, K = 64), and all within the
  reference's tolerance (simulator; aligned, and packed dv with a gap)."""
  K = CASES[case][3]
  args, kw = _strong_args(case, packed)
  run = lambda **c: jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True,
                                              dv_dtype=BF16 if packed else None,
                                              config=dataclasses.replace(EXACT, **c), **kw))(*args)
  got, want = run(split=True), run()
  for name in FIELDS:
    a, b = np.asarray(getattr(got, name).astype(F32)), np.asarray(getattr(want, name).astype(F32))
    if name in ("dbeta", "dAkk") and K > 64:
      assert np.abs(a - b).max() <= 3e-5 * np.abs(b).max(), name
    else:
      np.testing.assert_array_equal(a, b, name)
  if not packed:
    errs = errors(got, bwd_wy.reference.apply(*args, chunk_size=BT))
    assert not failures(errs), fmt(errs)


def test_split_kernel_lowers_in_one_cta():
  """The split kernel lowers for CUDA (K = V = 128, aligned and packed dv) with `split.smem_bytes`
  of SMEM, one CTA per SM; K != V runs the in-order kernel whatever the switch."""
  from kda import padding
  S = jax.ShapeDtypeStruct
  cfg = mgw.Config(split=True)
  args = _abstract(4096, 16, 128, 128) + (S((9,), jnp.int32),)
  smem = lowered_smem_bytes(lambda *a: mgw.apply(*a, chunk_size=BT, config=cfg), *args)
  assert smem == mgw.split.smem_bytes() and SMEM_TWO_CTAS < smem <= 232448
  Ta, T = 4096, 4000
  i32 = lambda *shape: S(shape, jnp.int32)
  f = lambda *a: mgw.apply(*a[:13], chunk_size=BT, dv_dtype=BF16, rows=padding.ChunkRows(*a[13:15]),
                           pieces=a[15], T=T, config=cfg)
  packed = (*_abstract(Ta, 16, 128, 128), i32(5), i32(Ta // BT), i32(Ta // BT), i32(2, T // BT + 6))
  assert lowered_smem_bytes(f, *packed) == mgw.split.smem_bytes(BF16)
  assert _lowered(cfg, 64, 128) == _lowered(mgw.Config(), 64, 128)


def test_packed_dv_lowers_for_cuda_in_two_ctas():
  """The packed-dv kernel at K = V = 128 lowers for CUDA; its plain bf16 stage (8 KiB) keeps two
  CTAs per SM."""
  from kda import padding
  S = jax.ShapeDtypeStruct
  Ta, T = 4096, 4000
  NTa = Ta // BT
  f = lambda *a: mgw.apply(*a[:13], chunk_size=BT, dv_dtype=BF16, rows=padding.ChunkRows(*a[13:15]),
                           pieces=a[15], T=T)
  i32 = lambda *shape: S(shape, jnp.int32)
  args = (*_abstract(Ta, 16, 128, 128), i32(5), i32(NTa), i32(NTa), i32(2, T // BT + 6))
  smem = lowered_smem_bytes(f, *args)
  print(f"\n  bwd_wy packed dv: SMEM {smem} bytes as lowered")
  assert smem <= SMEM_TWO_CTAS and smem == mgw.smem_bytes(128, 128, BF16)
  kw = dict(chunk_size=BT, dv_dtype=BF16, rows=padding.ChunkRows(*args[13:15]))
  assert mgw.supports(*args[:13], **kw) is None


@pytest.mark.parametrize("K,V,aliased", [(128, 128, 4), pytest.param(128, 64, 3, marks=pytest.mark.large)])
def test_inplace_lowers_with_aliases(K, V, aliased):
  """The lowered kernel aliases S2's terms to its results: dqg, dkg, dw (and du where K == V)."""
  txt = _lowered(mgw.Config(), K, V)                         # with aligned_cu
  call = [l for l in txt.splitlines() if "stablehlo.custom_call @mosaic_gpu" in l]
  assert len(call) == 1
  assert len(re.findall(r"output_operand_alias<", call[0])) == aliased, call[0][:400]


@pytest.mark.parametrize("case,packed,split", [("K128-V128-HV1-130", False, False), ("K128-V128-HV1-130", True, True),
                                               ("K64-V128-HV2-64_50", True, False)],
                         ids=["K128", "K128-packed-split", "K64-V128-packed"])
def test_bf16_du_gives_the_same_bits(case, packed, split):
  """cotangent_terms=1 rounds du to one bf16 term: du given in bf16 (S2's du_dtype) is read as is and
  every output is bit for bit the float32 du's (simulator; in-order and split kernels, packed dv);
  dg_state then has its own buffer: three in-place aliases where K == V."""
  args, kw = _strong_args(case, packed)
  args[10] = args[10].astype(BF16).astype(F32)             # du, bf16-exact
  cfg = mgw.Config(cotangent_terms=1, split=split)
  run = lambda *a: jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True,
                                             dv_dtype=BF16 if packed else None, config=cfg, **kw))(*a)
  want = run(*args)
  got = run(*args[:10], args[10].astype(BF16), *args[11:])
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  lowered = list(_abstract(4096, 2, 128, 128))
  lowered[10] = jax.ShapeDtypeStruct(lowered[10].shape, BF16)
  assert _aliases(cfg, lowered) == 3


def _strong_args(case, packed):
  """make_inputs(case, "strong")'s arguments as a list (aligned_cu appended where packed) and the
  packed-dv keywords (where packed)."""
  lens, Ta, HV, K, V = CASES[case]
  args, _ = make_inputs(case, "strong")
  kw = {}
  if packed:
    layout, kw = _packed_kw(lens, Ta)
    args = args + (layout.aligned_cu,)
  return list(args), kw


def _aliases(cfg, lowered, **kw):
  """The kernel's in-place aliases as lowered for CUDA on abstract arguments (aligned_cu appended)."""
  txt = jax.jit(functools.partial(mgw.apply, chunk_size=BT, config=cfg, **kw)).trace(
      *lowered, jax.ShapeDtypeStruct((9,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  call = [line for line in txt.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  assert len(call) == 1
  return len(re.findall(r"output_operand_alias<", call[0]))


def test_one_term_cotangents_stay_within_bf16_rounding():
  """Config(cotangent_terms=1): du and dw enter their products as one bf16 term (rounded once,
  2^-9): another lowered program, and every output within a few bf16 roundings of the reference;
  dv misses the two-term bounds (the mode ran), dq and dg_state do not change."""
  cfg = mgw.Config(cotangent_terms=1)
  assert _lowered(cfg) != _lowered(EXACT)
  args, _, exact, want = run_case("K128-V128-HV1-130", "ordinary")
  got = jax.block_until_ready(jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True, config=cfg))(*args))
  errs = errors(got, want)
  assert all(e[0] <= 1e-2 and e[1] <= 5e-3 for e in errs.values()), fmt(errs)
  assert errs["dv"][0] > 10 * TOL["dv"][0], fmt(errs)
  for name in ("dq", "dg_state"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(exact, name)), name)


@pytest.mark.parametrize("case,packed,split", [("K128-V128-HV1-130", False, False), ("K128-V128-HV1-130", True, True),
                                               ("K64-V128-HV2-64_50", True, False)],
                         ids=["K128", "K128-packed-split", "K64-V128-packed"])
def test_pairs_give_the_same_bits(case, packed, split):
  """pairs=True: dqg, dkg given as their pairs (S2's `pairs`) give dq, dk as theirs, bit for bit
  to_pairs of the call on float32 dqg, dkg = hi + lo, and every other output that call's bits
  (simulator; in-order and split kernels, aligned and packed dv, bf16 du); dq, dk go over dqg, dkg:
  three in-place aliases, as with bf16 du alone."""
  from kda._mosaic_gpu import from_pairs, to_pairs
  args, kw = _strong_args(case, packed)
  args[10] = args[10].astype(BF16)                         # du in bf16, as the pipeline hands it
  pairs = [to_pairs(x) for x in args[7:9]]
  args[7:9] = [from_pairs(p) for p in pairs]               # the float32 values the pairs hold
  cfg = mgw.Config(cotangent_terms=1, split=split)
  run = lambda *a, **k: jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True,
                                                  dv_dtype=BF16 if packed else None, config=cfg, **kw, **k))(*a)
  want = run(*args)
  got = run(*args[:7], *pairs, *args[9:], pairs=True)
  for name in FIELDS:
    w = getattr(want, name)
    w = to_pairs(w) if name in ("dq", "dk") else w
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(w), name)
  assert float(np.abs(np.asarray(got.dk, np.float32)).max()) > 0
  S = jax.ShapeDtypeStruct
  lowered = list(_abstract(4096, 2, 128, 128))
  lowered[7:9] = [S((1, 4096 // BT, 2, 2 * BT, 128), BF16)] * 2
  lowered[10] = S(lowered[10].shape, BF16)
  assert _aliases(cfg, lowered, pairs=True) == 3
  assert mgw.supports(*lowered, chunk_size=BT, pairs=True) is None
  assert "pairs are bfloat16, got dqg float32" in mgw.supports(
      *lowered[:7], S(lowered[7].shape, F32), *lowered[8:], chunk_size=BT, pairs=True)
  assert "dqg must have shape (1, 64, 2, 128, 128)" in mgw.supports(*_abstract(4096, 2, 128, 128), chunk_size=BT,
                                                                   pairs=True)


@pytest.mark.parametrize("case,split", [("K64-V128-HV2-64_50", False),
                                        pytest.param("K128-V128-HV1-130", True, marks=pytest.mark.large)],
                         ids=["K64-V128", "K128-split"])
def test_packed_qkv_clean_reads_non_finite_values_as_zero(case, split):
  """qkv_packed with clean (traced): a NaN in q, an inf in k and a -inf in v at real tokens are read
  as 0, every output bit for bit the call with 0 there (in-order and split kernels); clean False
  leaves them (they reach the outputs)."""
  lens, Ta, HV, K, V = CASES[case]
  args, _ = make_inputs(case, "ordinary")
  layout, kw = _packed_kw(lens, Ta)
  kw.update(dv_dtype=BF16, chunk_size=BT, qkv_packed=True, config=mgw.Config(split=split))
  packed, _ = bwd_setup.packed_and_aligned(layout, args[:3])
  t, h = int(layout.starts[len(lens) - 1]) + 5, HV - 1
  bad = [packed[0].at[0, t, h, 3].set(jnp.nan), packed[1].at[0, t + 9, 0, 0].set(jnp.inf),
         packed[2].at[0, t + 20, h, 7].set(-jnp.inf)]
  zeroed = [jnp.where(jnp.isfinite(b) | ~jnp.isfinite(p), b, 0).astype(b.dtype) for b, p in zip(bad, packed)]
  f = jax.jit(lambda clean, *a: mgw.apply(*a, layout.aligned_cu, interpret=True, clean=clean, **kw))
  want = f(False, *zeroed, *args[3:])
  got = f(True, *bad, *args[3:])
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  assert not all(np.isfinite(np.asarray(x)).all() for x in f(False, *bad, *args[3:]))


@pytest.mark.parametrize("case,packed,split", [("K128-V128-HV1-130", True, False),
                                               pytest.param("K128-V128-HV1-130", False, True, marks=pytest.mark.large),
                                               pytest.param("K64-V128-HV2-64_50", True, False, marks=pytest.mark.large)],
                         ids=["K128-packed", "K128-split", "K64-V128-packed"])
def test_defer_qg_leaves_dq_to_bwd_intra(case, packed, split):
  """defer_qg: no dq, and dgc without its dqg q exp(gc) term (S4 adds it); every other output bit for
  bit the plain call's (simulator; in-order kernel with packed dv, split kernel). As lowered for CUDA
  (K = V = 128, bf16 du): dqg is not an operand, so two in-place aliases (dk over dkg, dgc over dw)."""
  args, kw = _strong_args(case, packed)
  cfg = mgw.Config(split=split)
  run = lambda *a, **k: jax.jit(functools.partial(mgw.apply, chunk_size=BT, interpret=True, config=cfg,
                                                  dv_dtype=BF16 if packed else None, **kw, **k))(*a)
  want, got = run(*args), run(*args, defer_qg=True)
  assert got.dq is None
  for name in ("dk", "dv", "dbeta", "dg_state", "dAkk"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  q, gi, gf, dqg = (args[i].astype(F32) for i in (0, 4, 5, 7))
  rest = want.dgc - dqg * q * jnp.exp(gi + gf)             # S3's dgc without the term S4 adds
  assert bwd_setup.block_errors(got._replace(dgc=got.dgc), want._replace(dgc=rest), ["dgc"])["dgc"][0] < 1e-6
  lowered = list(_abstract(4096, 2, 128, 128))
  lowered[10] = jax.ShapeDtypeStruct(lowered[10].shape, BF16)
  if not split:
    assert _aliases(cfg, lowered, defer_qg=True) == 2
