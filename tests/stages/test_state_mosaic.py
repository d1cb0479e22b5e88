"""The Mosaic GPU state kernel against the state reference: simulator runs on CPU and CUDA lowering.

Inputs are rounded to bf16 and the reference gets the same rounded values back in float32, so the
comparison isolates the kernel: what is left is the bf16 rounding of S and v_new as wgmma operands
(both dots feed the carried state). Measured on these cases (max over fields and cases, run with -s
to print them): max|d| / max|ref| <= 1.5e-3 and ||d|| / ||ref|| <= 1.6e-3 (TOL allows 5e-3, 4e-3).
Against a float32 emulation of the kernel's own rounding (test_state_matches_bf16_emulation) the
kernel agrees to <= 5.7e-5, so the tolerance above is bf16 rounding, not a kernel error. These
comparisons run with float32-typed (bf16-exact) inputs, so h and v_new are stored in float32; with
bf16 inputs they are stored in bf16, and test_state_bf16_stores checks that those are exactly the
float32 ones rounded (the arithmetic does not depend on the store dtype).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import state
from kda.stages.state import mosaic_gpu as mgs
from tests import cases
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
# bf16 operands in both dots: the rounding of S and v_new (rel 2^-9 each) feeds the carried state;
# measured worst 1.5e-3 (max) and 1.6e-3 (norm) on the cases below (up to 24 chunks, chunk decay
# ~0.45); on non-contractive random w/kg an earlier draft measured 3.1e-3 / 2.7e-3.
TOL = {"max": 5e-3, "norm": 4e-3}


def reference(*args, chunk_size):
  return state.reference.apply(*args, chunk_size=chunk_size)


def make_case(lens, K, V, HV=2, tail_chunks=2, seed=0, poison=True):
  """Aligned inputs: sequence n at [acu[n], acu[n] + len_n), zeros up to acu[n+1] (align's output),
  then tail_chunks chunks nobody owns, poisoned with NaN (the kernel must never read them)."""
  acu, Ta, valid, tail = cases.aligned_layout(lens, BT, tail_chunks)
  ks = jax.random.split(jax.random.key(seed), 7)
  m = jnp.asarray(valid)[None, :, None, None]
  rnd = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)   # the kernel's operand rounding
  # Delta-rule-like inputs so the state carries over many chunks without blowing up: unit-norm k,
  # beta in (0, 1/4), w = beta k exp(gc), kg = k exp(gc_last - gc) (the WY inverse left out), slow
  # gates (chunk decay ~0.45) with 5% of the channels strong (decay ~0).
  k = jax.random.normal(ks[0], (1, Ta, HV, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = jax.random.uniform(ks[1], (1, Ta, HV, 1), maxval=0.25)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[2], (1, Ta, HV, K)))
  strong = jax.random.uniform(ks[5], (1, 1, HV, K)) < 0.05
  g = jnp.where(m, jnp.where(strong, g, g / 64), 0.0)                     # flat over padding
  gc = jnp.cumsum(g.reshape(1, Ta // BT, BT, HV, K), axis=2).reshape(1, Ta, HV, K)
  last = jnp.repeat(gc[:, BT - 1::BT], BT, axis=1)
  kg = rnd(jnp.where(m, k * jnp.exp(last - gc), 0.0))
  w = rnd(jnp.where(m, beta * k * jnp.exp(gc), 0.0))
  u = rnd(jnp.where(m, jax.random.normal(ks[3], (1, Ta, HV, V)), 0.0))
  gc_int = jnp.floor(gc)
  gc_frac = gc - gc_int
  h0 = jax.random.normal(ks[4], (len(lens), HV, K, V), jnp.float32)
  if poison:
    pt = jnp.asarray(tail)[None, :, None, None]
    kg, w, u, gc_int, gc_frac = (jnp.where(pt, jnp.nan, x) for x in (kg, w, u, gc_int, gc_frac))
  return (kg, w, u, gc_int, gc_frac, h0, jnp.asarray(acu)), acu, tail


def run_kernel(args, config=None):
  f = jax.jit(lambda *a: mgs.apply(*a, chunk_size=BT, interpret=True, config=config))
  t0 = time.time()
  out = jax.block_until_ready(f(*args))
  return out, time.time() - t0


def errors(out, ref, acu, tail):
  """Per field: (max|d| / max|ref|, ||d|| / ||ref||) over the owned region."""
  own = {"h": (slice(None), np.asarray(~tail[::BT])), "v_new": (slice(None), np.asarray(~tail)),
         "final_state": (slice(None),)}
  res = {}
  for name in out._fields:
    a = np.asarray(getattr(out, name), np.float64)[own[name]]
    b = np.asarray(getattr(ref, name), np.float64)[own[name]]
    d = np.abs(a - b)
    res[name] = (d.max() / max(np.abs(b).max(), 1e-30), np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
  return res


def check(lens, K, V, config=None, tail_chunks=2, seed=0):
  args, acu, tail = make_case(lens, K, V, tail_chunks=tail_chunks, seed=seed)
  out, secs = run_kernel(args, config)
  ref = reference(*args, chunk_size=BT)
  for name in out._fields:
    assert getattr(out, name).shape == getattr(ref, name).shape, name
    want = jnp.float32 if name == "final_state" else (config or mgs.Config()).stores(*args[:3])
    assert getattr(out, name).dtype == want, name
  errs = errors(out, ref, acu, tail)
  print(f"\n  lens={lens} K={K} V={V} {config or ''}: simulator {secs:.2f}s; " +
        ", ".join(f"{k} max {e[0]:.2e} norm {e[1]:.2e}" for k, e in errs.items()))
  for name, (emax, enorm) in errs.items():
    assert np.isfinite(emax) and emax <= TOL["max"], (name, emax)
    assert enorm <= TOL["norm"], (name, enorm)
  # nobody owns the tail: exact zeros, even though its inputs are NaN
  tail_c = tail[::BT]
  assert np.all(np.asarray(out.h)[:, tail_c] == 0.0)
  assert np.all(np.asarray(out.v_new)[:, tail] == 0.0)
  # an empty sequence hands its initial state through untouched
  for n, L in enumerate(lens):
    if L == 0:
      np.testing.assert_array_equal(np.asarray(out.final_state[n]), np.asarray(args[5][n]))
  return out, errs


def emulate(args):
  """The kernel's arithmetic in float32 numpy: the reference with S and v_new rounded to bf16 where
  they enter the dots. Against it only summation order is left (1e-5-ish), so a kernel bug cannot
  hide inside TOL. (Float32 vs float64 emulation already differ by up to 4e-4 on these inputs: an
  ulp of float32 noise flips a bf16 rounding now and then, and the flip carries through the state.)"""
  kg, w, u, gi, gf, h0, acu = (np.asarray(x) for x in args)
  acu = acu.astype(int)
  bf = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
  decay = np.exp(gi[0, BT - 1::BT] + gf[0, BT - 1::BT]).astype(np.float32)   # [NTa, HV, K]
  NTa, HV = decay.shape[:2]
  h = np.zeros((NTa, HV) + h0.shape[2:], np.float32)
  v_new = np.zeros(u.shape[1:], np.float32)
  final = h0.copy()
  for n in range(len(acu) - 1):
    for i in range(HV):
      S = h0[n, i]
      for c in range(acu[n] // BT, acu[n + 1] // BT):
        rows = slice(c * BT, (c + 1) * BT)
        h[c, i] = S
        v = u[0, rows, i] - w[0, rows, i] @ bf(S)
        v_new[rows, i] = v
        S = decay[c, i][:, None] * S + kg[0, rows, i].T @ bf(v)
      final[n, i] = S
  return h[None], v_new[None], final


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)], ids=["K64-V64", "K128-V128"])
def test_state_matches_bf16_emulation(K, V):
  args, acu, tail = make_case([1, 130, 0, 300], K, V, seed=2, poison=False)
  out, _ = run_kernel(args)
  emu = emulate(args)
  worst = []
  for name, e in zip(out._fields, emu):
    a = np.asarray(getattr(out, name), np.float64)
    worst.append(float(np.abs(a - e).max() / np.abs(e).max()))
  print(f"\n  vs bf16 emulation K={K} V={V}: max|d|/max|emu| = " + ", ".join(f"{x:.1e}" for x in worst))
  assert max(worst) <= 2e-4, worst   # measured <= 5.7e-5: summation order and the bf16 flips it causes


KV = [(64, 64), (128, 64), (64, 128)]
KV_IDS = [f"K{k}-V{v}" for k, v in KV]


@pytest.mark.parametrize("K,V", KV, ids=KV_IDS)
def test_state_matches_reference_boundaries(K, V):
  check([1, 63, 64, 65, 130], K, V)


@pytest.mark.parametrize("K,V", KV, ids=KV_IDS)
def test_state_matches_reference_empty_sequence(K, V):
  check([17, 0, 40], K, V)


@pytest.mark.parametrize("lens,K,V", [([600, 5, 200], 128, 128), ([1500, 3], 64, 64)],
                         ids=["K128-V128", "K64-V64"])
def test_state_matches_reference_long_sequences(lens, K, V):
  check(lens, K, V, seed=1)


@pytest.mark.parametrize("config", [
    mgs.Config(stage_stores=False), mgs.Config(seq_major=False), mgs.Config(longest_first=False),
    mgs.Config(lane_semantics=True), mgs.Config(swizzle_stages=True)],
    ids=["direct-stores", "seq-minor-grid", "input-order", "lane", "swizzled-stages"])
def test_state_matches_reference_configs(config):
  check([65, 0, 130, 1], 64, 64, config=config)


@pytest.mark.parametrize("K,V,config", [(64, 64, None), (128, 64, None), (64, 128, mgs.Config(stage_stores=False))],
                         ids=["K64-V64", "K128-V64", "K64-V128-direct-stores"])
def test_state_bf16_stores(K, V, config):
  """bf16 kg, w, u: h and v_new come out in bf16, exactly the float32 stores rounded (the kernel's
  arithmetic does not depend on the store dtype), tail included; final_state stays float32 and equal."""
  args, acu, tail = make_case([1, 130, 0, 65], K, V, seed=3)
  f32_out, _ = run_kernel(args, config)
  bf16_out, _ = run_kernel(tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:], config)
  assert f32_out.h.dtype == f32_out.v_new.dtype == jnp.float32
  assert bf16_out.h.dtype == bf16_out.v_new.dtype == jnp.bfloat16
  assert bf16_out.final_state.dtype == jnp.float32
  for name in ("h", "v_new"):
    np.testing.assert_array_equal(np.asarray(getattr(bf16_out, name).astype(jnp.float32)),
                                  np.asarray(getattr(f32_out, name).astype(jnp.bfloat16).astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(bf16_out.final_state), np.asarray(f32_out.final_state))
  assert not np.any(np.asarray(bf16_out.h.astype(jnp.float32))[:, tail[::BT]])
  forced, _ = run_kernel(args, mgs.Config(store_dtype="bfloat16", stage_stores=(config or mgs.Config()).stage_stores))
  assert forced.h.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(forced.h.astype(jnp.float32)), np.asarray(bf16_out.h.astype(jnp.float32)))


def test_state_no_tail_and_no_sequences():
  check([64, 3], 64, 64, tail_chunks=0)
  args, _, _ = make_case([5], 64, 64)
  args = args[:5] + (args[5][:0], jnp.zeros((1,), jnp.int32))
  out = mgs.apply(*args, chunk_size=BT, interpret=True)
  assert np.all(np.asarray(out.h) == 0) and np.all(np.asarray(out.v_new) == 0)
  assert out.final_state.shape == (0, 2, 64, 64)
  out = mgs.apply(*(x.astype(jnp.bfloat16) for x in args[:3]), *args[3:], chunk_size=BT, interpret=True)
  assert out.h.dtype == out.v_new.dtype == jnp.bfloat16


def test_supports_reasons():
  args, _, _ = make_case([5], 64, 64, poison=False)
  bf = tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:]
  assert mgs.supports(*bf, chunk_size=BT) is None
  assert mgs.supports(*bf, chunk_size=BT, config=mgs.Config(store_dtype="float32")) is None
  assert state.STAGE.mosaic_gpu is mgs
  assert "bfloat16 kg, w, u" in mgs.supports(*args, chunk_size=BT)     # float32: the dtype policy
  assert "chunk_size" in mgs.supports(*bf, chunk_size=32)
  kg, w, u, gi, gf, h0, cu = bf
  assert "K must" in mgs.supports(kg[..., :32], w[..., :32], u, gi[..., :32], gf[..., :32], h0[:, :, :32], cu,
                                  chunk_size=BT)
  S = jax.ShapeDtypeStruct
  k256 = (S(kg.shape[:3] + (256,), kg.dtype),) * 2
  g256 = (S(gi.shape[:3] + (256,), gi.dtype),) * 2
  assert "K must be one of (64, 128), got 256" in mgs.supports(*k256, u, *g256, S(h0.shape[:2] + (256, 64), h0.dtype),
                                                               cu, chunk_size=BT)
  assert "V must" in mgs.supports(kg, w, u[..., :48], gi, gf, h0[..., :48], cu, chunk_size=BT)
  assert "initial_state" in mgs.supports(kg, w, u, gi, gf, h0[:, :1], cu, chunk_size=BT)
  assert "float16" in mgs.supports(kg.astype(jnp.float16), w, u, gi, gf, h0, cu, chunk_size=BT)
  with pytest.raises(ValueError, match="chunk_size"):
    mgs.apply(*args, chunk_size=32, interpret=True)
  with pytest.raises(ValueError, match="group_chunks"):
    mgs.Config(group_chunks=None)


def _abstract(Ta, HV, K, V, N, dtype=jnp.bfloat16):
  S = jax.ShapeDtypeStruct
  return (S((1, Ta, HV, K), dtype), S((1, Ta, HV, K), dtype), S((1, Ta, HV, V), dtype),
          S((1, Ta, HV, K), jnp.float32), S((1, Ta, HV, K), jnp.float32), S((N, HV, K, V), jnp.float32),
          S((N + 1,), jnp.int32))


LOWER_CONFIGS = {"default": mgs.Config(), "direct-stores": mgs.Config(stage_stores=False),
                 "lane": mgs.Config(lane_semantics=True), "f32-stores": mgs.Config(store_dtype="float32"),
                 "f32-swizzled-stages": mgs.Config(store_dtype="float32", swizzle_stages=True),
                 "grouped": mgs.Config(group_chunks=8)}
LOWER_KV = [(64, 64), (64, 128), (128, 64), (128, 128)]
# by default every config at the smallest and the largest head dims, the mixed ones for the default
LOWER = [pytest.param(K, V, c, id=f"{n}-K{K}-V{V}",
                      marks=pytest.mark.large if K != V and n != "default" else ())
         for n, c in LOWER_CONFIGS.items() for K, V in LOWER_KV]


@pytest.mark.parametrize("K,V,config", LOWER)
def test_state_lowers_for_cuda(K, V, config):
  args = _abstract(32768 + 489 * BT, 16, K, V, 489)
  f = lambda *a: mgs.apply(*a, chunk_size=BT, config=config)
  t0 = time.time()
  lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  secs = time.time() - t0
  smem = lowered_smem_bytes(f, *args)
  print(f"\n  lowered K={K} V={V} {config} in {secs:.2f}s, SMEM {smem} bytes")
  assert "mosaic_gpu" in lowered.as_text() and smem <= 232448
  assert smem == mgs.smem_bytes(K, config, config.stores(*args[:3]))   # the predicate's figure


@functools.lru_cache(maxsize=None)
def _lowered_text(config):
  args = _abstract(8 * BT, 2, 64, 64, 5, jnp.float32)     # 5 sequences, 8 chunks: group_chunks=2 groups them
  return jax.jit(lambda *a: mgs.apply(*a, chunk_size=BT, config=config)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


FIELDS = {"longest_first": False, "seq_major": False, "stage_stores": False, "lane_semantics": True,
          "swizzle_stages": True, "store_dtype": "bfloat16", "group_chunks": 2}


@pytest.mark.parametrize("field", list(FIELDS))
def test_config_field_changes_the_program(field):
  """Each Config field gives another lowered program (float32 inputs: f32 stores); the simulator
  runs each against the reference in test_state_matches_reference_configs, test_state_bf16_stores
  and test_state_grouped_walk_same_bits."""
  assert _lowered_text(mgs.Config(**{field: FIELDS[field]})) != _lowered_text(mgs.Config())


def test_state_lowers_for_cuda_many_sequences_and_f32_inputs():
  # N > 65535 would break CUDA's grid z limit: the launcher moves the sequences to grid x
  args = _abstract(70000 * BT, 1, 64, 64, 70000, jnp.float32)
  jax.jit(lambda *a: mgs.apply(*a, chunk_size=BT)).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("config", [mgs.Config(group_chunks=2), mgs.Config(group_chunks=3, store_dtype="float32")],
                         ids=["G2", "G3-f32-stores"])
def test_state_grouped_walk_same_bits(config):
  """Config(group_chunks=G): a program walks the consecutive sequences starting in one window of G
  chunks (S from each h0, final_state at each end, the prefetch running on across them), P =
  cdiv(NTa, G) < N programs: h, v_new and final_state bit for bit one program per sequence's, with
  empty sequences inside groups and the tail zeroed."""
  lens = [1, 63, 64, 0, 65, 130, 3, 0, 70, 1]
  args, _, _ = make_case(lens, 64, 64, seed=8)
  assert -(-args[0].shape[1] // BT // config.group_chunks) < len(lens)     # grouped mode applies
  got, _ = run_kernel(args, config)
  want, _ = run_kernel(args, dataclasses.replace(config, group_chunks=0))
  for name in ("h", "v_new", "final_state"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
