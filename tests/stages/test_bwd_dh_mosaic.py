"""The Mosaic GPU bwd_dh kernel against the bwd_dh reference: simulator runs on CPU and CUDA lowering.

Inputs: the state test's delta-rule-like kg, w, u and gates (test_state_mosaic.make_case, aligned
layout with tail chunks), h and v_new from the state reference on them, qg = q * exp(gc) for unit
q, and random float32 do, dv, dht (bwd_setup.randn, everywhere, padding and tail included). qg, kg,
w, h, v_new are rounded to bf16 (the forward kernels store them so) and the reference gets the
same rounded values back in float32, so the comparison isolates the kernel: what is left is its
own roundings of wgmma operands, bf16(dS), bf16(-du) (the walk's bf16(-du / scale)); do is bf16
already and the scale multiplies float32 products. Measured on these cases
(run with -s to print them; -m large included): max|d| / max|ref| <= 2.8e-3 and ||d|| / ||ref||
<= 1.9e-3 over all fields (dkg, dw the largest; du
~1.2e-3, dh0 ~3e-4, dgc_last ~2e-4); TOL allows 6e-3 and 5e-3. check() also compares with a
float32 numpy emulation of the kernel's roundings (`emulate`): <= 4.5e-4 (float32 summation order
flipping a bf16 rounding now and then; EMU_TOL 1e-3), and the emulation with a wrong formula (no
decay, a flipped sign, no scale, ...) misses the reference by far more than TOL
(test_bwd_dh_wrong_formulas_fail), so a kernel with such a bug cannot pass.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import bwd_dav, bwd_dh, state
from kda.stages.bwd_dh import mosaic_gpu as mgd
from tests.stages import bwd_setup
from tests.stages.test_output_mosaic import lowered_smem_bytes
from tests.stages.test_state_mosaic import make_case as state_case

BT = 64
TOL = {"max": 6e-3, "norm": 5e-3}
EMU_TOL = 1e-3   # measured <= 4.5e-4 (dw, 24 chunks): float32 summation order flips a bf16(-du) rounding now and then
FIELDS = bwd_dh.Out._fields
NAN_TAIL = ("qg", "kg", "w", "gc_int", "gc_frac", "h", "v_new", "do")   # never read at the tail
ARGS = ("qg", "kg", "w", "gc_int", "gc_frac", "h", "v_new", "do", "dv", "dht", "aligned_cu")


def make_case(lens, K, V, HV=2, tail_chunks=2, seed=0):
  """Cached per arguments (the tests share a few cases, so the kernel compiles once per shape).
  """
  return _make_case(tuple(lens), K, V, HV, tail_chunks, seed)


@functools.lru_cache(maxsize=None)
def _make_case(lens, K, V, HV, tail_chunks, seed):
  """-> (args in apply's order, float32 with qg, kg, w, h, v_new bf16-exact; acu; tail [Ta] bool)."""
  (kg, w, u, gi, gf, h0, acu), acu_np, tail = state_case(lens, K, V, HV=HV, tail_chunks=tail_chunks,
                                                         seed=seed, poison=False)
  st = state.reference.apply(kg, w, u, gi, gf, h0, acu, chunk_size=BT)
  Ta = kg.shape[1]
  rnd = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  q = jax.random.normal(jax.random.key(seed + 100), (1, Ta, HV, K))
  q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  qg = rnd(jnp.where(kg != 0, q * jnp.exp(gi + gf), 0.0))      # 0 at padding, as kg
  do, dv, dht = bwd_setup.randn(seed + 7, (1, Ta, HV, V), (1, Ta, HV, V), (len(lens), HV, K, V))
  return (qg, kg, w, gi, gf, rnd(st.h), rnd(st.v_new), do, dv, dht, acu), acu_np, tail


@functools.lru_cache(maxsize=None)
def _kernel(scale, config):
  return jax.jit(functools.partial(mgd.apply, scale=scale, chunk_size=BT, interpret=True, config=config))


@functools.lru_cache(maxsize=None)
def _reference(scale):
  return jax.jit(functools.partial(bwd_dh.reference.apply, scale=scale, chunk_size=BT))


def run_kernel(args, config=None):
  K = args[0].shape[-1]
  t0 = time.time()
  out = jax.block_until_ready(_kernel(K ** -0.5, config)(*args))
  return out, time.time() - t0


def errors(out, ref):
  """Per field: (max|d| / max|ref|, ||d|| / ||ref||), over everything (padding and tail included)."""
  res = {}
  for name in FIELDS:
    a = np.asarray(getattr(out, name), np.float64)
    b = np.asarray(getattr(ref, name), np.float64)
    d = np.abs(a - b)
    res[name] = (d.max() / max(np.abs(b).max(), 1e-30), np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
  return res


def check(lens, K, V, config=None, tail_chunks=2, seed=0, HV=2, emulation=True):
  args, acu, tail = make_case(lens, K, V, HV=HV, tail_chunks=tail_chunks, seed=seed)
  out, secs = run_kernel(args, config)
  ref = _reference(K ** -0.5)(*args)
  for name in FIELDS:
    assert getattr(out, name).shape == getattr(ref, name).shape, name
    assert getattr(out, name).dtype == jnp.float32, name
  errs = errors(out, ref)
  print(f"\n  lens={lens} K={K} V={V} HV={HV} {config or ''}: simulator {secs:.2f}s; " +
        ", ".join(f"{k} max {e[0]:.2e} norm {e[1]:.2e}" for k, e in errs.items()))
  for name, (emax, enorm) in errs.items():
    assert np.isfinite(emax) and emax <= TOL["max"], (name, emax)
    assert enorm <= TOL["norm"], (name, enorm)
  if emulation:
    emu = emulate(args, K ** -0.5)
    worst = {}
    for name in FIELDS:
      a, e = np.asarray(getattr(out, name), np.float64), np.asarray(getattr(emu, name), np.float64)
      worst[name] = float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))
    print("  vs bf16 emulation: " + ", ".join(f"{k} {x:.1e}" for k, x in worst.items()))
    assert max(worst.values()) <= EMU_TOL, worst
  # the tail: du = dv, the rest 0, exactly (h = 0 there)
  dv = np.asarray(args[8])
  np.testing.assert_array_equal(np.asarray(out.du)[:, tail], dv[:, tail])
  for name in ("dqg", "dkg", "dw"):
    assert not np.any(np.asarray(getattr(out, name))[:, tail]), name
  assert not np.any(np.asarray(out.dgc_last)[:, tail[::BT]])
  # an empty sequence hands dht through untouched
  for n, L in enumerate(lens):
    if L == 0:
      np.testing.assert_array_equal(np.asarray(out.dh0[n]), np.asarray(args[9][n]))
  return args, out, ref, errs


def emulate(args, scale, mutant=None):
  """The kernel's arithmetic in float32 numpy: the reference with bf16(dS), bf16(-du) (the walk's
  bf16(-du / scale)) where they enter the dots, do as given and the scale applied to the products.
  `mutant` names a wrong formula to emulate instead."""
  qg, kg, w, gi, gf, h, vn, do, dv, dht = (np.asarray(x, np.float32) for x in args[:10])
  acu = np.asarray(args[10]).astype(int)
  bf = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
  decay = np.exp(gi[0, BT - 1::BT] + gf[0, BT - 1::BT]).astype(np.float32)    # [NTa, HV, K]
  s = np.float32(scale if mutant != "no_scale" else 1.0)
  dob = bf(do)[0]
  NTa, HV = decay.shape[:2]
  dh0 = dht.copy()
  du = dv[0].copy()
  dqg, dkg, dw = (np.zeros(qg.shape[1:], np.float32) for _ in range(3))
  dgc = np.zeros(decay.shape, np.float32)
  sign = -1.0 if mutant == "w_sign" else 1.0
  for n in range(len(acu) - 1):
    for i in range(HV):
      dS = dht[n, i]
      for c in reversed(range(acu[n] // BT, acu[n + 1] // BT)):
        rows = slice(c * BT, (c + 1) * BT)
        S, d = h[0, c, i], decay[c, i]
        dSb = bf(dS)
        du_c = dv[0, rows, i] + kg[0, rows, i] @ dSb
        ndu = bf(-du_c)
        ndu_s = bf(du_c * np.float32(-1.0 / s))
        du[rows, i] = du_c
        dkg[rows, i] = vn[0, rows, i] @ dSb.T
        dqg[rows, i] = s * (dob[rows, i] @ S.T)
        dw[rows, i] = ndu @ S.T
        dgc[c, i] = (1.0 if mutant == "dgc_no_decay" else d) * np.sum(S * dSb, axis=1)
        keep = dS if mutant == "no_decay" else d[:, None] * dS
        dS = keep + s * (qg[0, rows, i].T @ dob[rows, i] + sign * (w[0, rows, i].T @ ndu_s))
      dh0[n, i] = dS
  return bwd_dh.Out(dh0, du[None], dqg[None], dkg[None], dw[None], dgc[None])


# lengths 1, 63, 64, 65 and an empty sequence, two tail chunks; one compile per (K, V) and dtype
LENS = [1, 63, 0, 64, 65]
KV = [(64, 64), (128, 128), (128, 64), (64, 128)]
DEFAULT_KV = {(64, 64), (128, 128)}   # (128, 64) and (64, 128): large (CI budget)


@pytest.mark.parametrize("K,V", [pytest.param(k, v, marks=() if (k, v) in DEFAULT_KV else pytest.mark.large)
                                 for k, v in KV], ids=[f"K{k}-V{v}" for k, v in KV])
def test_bwd_dh_matches_reference_and_emulation(K, V):
  check(LENS, K, V)


@pytest.mark.parametrize("mutant", ["no_decay", "w_sign", "no_scale", "dgc_no_decay"])
def test_bwd_dh_wrong_formulas_fail(mutant):
  """A kernel within EMU_TOL of a wrong-formula emulation would miss the reference by >> TOL."""
  args, _, _ = make_case(LENS, 64, 64)
  ref = _reference(64 ** -0.5)(*args)
  right = errors(emulate(args, 64 ** -0.5), ref)
  wrong = errors(emulate(args, 64 ** -0.5, mutant), ref)
  assert max(e[0] for e in right.values()) <= TOL["max"] / 2, right
  assert max(e[0] for e in wrong.values()) >= 20 * TOL["max"], (mutant, wrong)


def test_bwd_dh_never_reads_the_tail():
  """NaN in everything but dv at the tail chunks: the outputs are bit for bit those of clean inputs."""
  args, acu, tail = make_case(LENS, 64, 64)
  clean, _ = run_kernel(args)
  pt = jnp.asarray(tail)
  bad = list(args)
  for k, name in enumerate(ARGS):
    if name == "h":
      bad[k] = jnp.where(pt[::BT][None, :, None, None, None], jnp.nan, args[k])
    elif name in NAN_TAIL:
      bad[k] = jnp.where(pt[None, :, None, None], jnp.nan, args[k])
  poisoned, _ = run_kernel(tuple(bad))
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(poisoned, name)), np.asarray(getattr(clean, name)), name)


FLIPPED = {"seq_major": False, "longest_first": False}    # every Config field off its default


@pytest.mark.parametrize("config", [mgd.Config(**FLIPPED),
                                    pytest.param(mgd.Config(seq_major=False), marks=pytest.mark.large),
                                    pytest.param(mgd.Config(longest_first=False), marks=pytest.mark.large)],
                         ids=["seq-minor-grid-input-order", "seq-minor-grid", "input-order"])
def test_bwd_dh_matches_reference_configs(config):
  """Config fields off their defaults (the walk's grid and sequence order): the outputs still match
  the reference (simulator)."""
  check(LENS, 64, 64, config=config, emulation=False)


@pytest.mark.parametrize("field", sorted(FLIPPED))
def test_bwd_dh_config_fields_change_the_program(field):
  """Each Config field flipped from its default gives another lowered program (CUDA)."""
  args = _abstract(4096, 2, 64, 64, 9)
  lower = lambda config: jax.jit(lambda *a: mgd.apply(*a, scale=0.125, chunk_size=BT, config=config)).trace(
      *args).lower(lowering_platforms=("cuda",)).as_text()
  assert lower(mgd.Config(**{field: FLIPPED[field]})) != lower(mgd.Config())


def test_bwd_dh_bf16_inputs():
  """bf16 qg, kg, w, h, v_new (the dtype policy's): the same outputs as their float32 values."""
  args, _, _ = make_case(LENS, 64, 64)
  f32_out, _ = run_kernel(args)
  bf = tuple(x.astype(jnp.bfloat16) if n in ("qg", "kg", "w", "h", "v_new") else x for n, x in zip(ARGS, args))
  bf16_out, _ = run_kernel(bf)
  for name in FIELDS:
    assert getattr(bf16_out, name).dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(getattr(bf16_out, name)), np.asarray(getattr(f32_out, name)), name)
  assert mgd.supports(*bf, chunk_size=BT, scale=0.125) is None
  assert "takes bfloat16 qg, kg, w, h, v_new" in mgd.supports(*args, chunk_size=BT, scale=0.125)


@pytest.mark.large
def test_bwd_dh_no_tail():
  check([64, 3], 64, 64, tail_chunks=0, emulation=False)


def test_bwd_dh_no_sequences():
  args, _, _ = make_case(LENS, 64, 64)
  args = args[:9] + (args[9][:0], jnp.zeros((1,), jnp.int32))
  out = mgd.apply(*args, scale=0.125, chunk_size=BT, interpret=True)   # no program: all is tail
  assert out.dh0.shape == (0, 2, 64, 64)
  np.testing.assert_array_equal(np.asarray(out.du), np.asarray(args[8]))
  for name in ("dqg", "dkg", "dw", "dgc_last"):
    assert not np.any(np.asarray(getattr(out, name))), name


def test_supports_reasons():
  args, _, _ = make_case(LENS, 64, 64)
  args = tuple(x.astype(jnp.bfloat16) if n in ("qg", "kg", "w", "h", "v_new") else x for n, x in zip(ARGS, args))
  S = lambda *a, **k: mgd.supports(*a, chunk_size=k.pop("chunk_size", BT), scale=0.125)
  assert S(*args) is None and mgd.supports(*args, chunk_size=BT, config=mgd.Config()) is None
  assert "chunk_size" in S(*args, chunk_size=32)
  qg, kg, w, gi, gf, h, vn, do, dv, dht, cu = args
  K256 = lambda x: jnp.concatenate([x] * 4, axis=-1)                   # the stage's jnp reference runs there
  assert "K must be one of (64, 128), got 256" in S(*map(K256, (qg, kg, w, gi, gf)), jnp.concatenate([h] * 4, axis=3),
                                                    vn, do, dv, jnp.concatenate([dht] * 4, axis=2), cu)
  assert "K must" in S(qg[..., :32], kg[..., :32], w[..., :32], gi[..., :32], gf[..., :32], h[:, :, :, :32],
                       vn, do, dv, dht[:, :, :32], cu)
  assert "V must" in S(qg, kg, w, gi, gf, h[..., :48], vn[..., :48], do[..., :48], dv[..., :48], dht[..., :48], cu)
  assert "dht" in S(qg, kg, w, gi, gf, h, vn, do, dv, dht[:, :1], cu)
  assert "h must" in S(qg, kg, w, gi, gf, h[:, :1], vn, do, dv, dht, cu)
  assert "dv" in S(qg, kg, w, gi, gf, h, vn, do, dv[:, :64], dht, cu)
  assert "float16" in S(qg, kg.astype(jnp.float16), w, gi, gf, h, vn, do, dv, dht, cu)
  assert "aligned_cu" in S(*args[:10], cu.astype(jnp.float32))
  assert "pairs need K == V == 128, got K=64, V=64" in mgd.supports(*args, chunk_size=BT, pairs=True)
  with pytest.raises(ValueError, match="chunk_size"):
    mgd.apply(*args, scale=0.125, chunk_size=32, interpret=True)


def test_stage_registration():
  st = bwd_dh.STAGE
  assert st.mosaic_gpu is mgd


def _abstract(Ta, HV, K, V, N, dtype=jnp.bfloat16):
  S = jax.ShapeDtypeStruct
  f32 = jnp.float32
  NTa = Ta // BT
  return (S((1, Ta, HV, K), dtype), S((1, Ta, HV, K), dtype), S((1, Ta, HV, K), dtype),
          S((1, Ta, HV, K), f32), S((1, Ta, HV, K), f32), S((1, NTa, HV, K, V), dtype),
          S((1, Ta, HV, V), dtype), S((1, Ta, HV, V), f32), S((1, Ta, HV, V), f32),
          S((N, HV, K, V), f32), S((N + 1,), jnp.int32))


# SMEM of the walk kernel as lowered (bytes, barriers and alignment included), per K; V does not change it
SMEM_AS_LOWERED = {64: 115728, 128: 173072}   # the walk kernel (the terms kernel needs less)
SMEM_TWO_CTAS = 233472 // 2 - 1024             # 228 KiB per H200 SM, 1 KiB reserved per CTA


def lower_check(K, V, config):
  args = _abstract(32768 + 489 * BT, 16, K, V, 489)
  f = lambda *a: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, config=config)
  t0 = time.time()
  lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  secs = time.time() - t0
  smem = lowered_smem_bytes(f, *args)
  print(f"\n  lowered K={K} V={V} {config} in {secs:.2f}s, SMEM {smem} bytes")
  assert "mosaic_gpu" in lowered.as_text() and smem <= 232448
  assert smem == SMEM_AS_LOWERED[K] == mgd.walk_smem_bytes(K)   # the predicate's figure


@pytest.mark.parametrize("K,V", [(64, 64), (64, 128), (128, 64), (128, 128)],
                         ids=["K64-V64", "K64-V128", "K128-V64", "K128-V128"])
def test_bwd_dh_lowers_for_cuda(K, V):
  lower_check(K, V, mgd.Config())


def test_bwd_dh_lowers_for_cuda_many_sequences_and_f32_inputs():
  # N > 65535 would break CUDA's grid z limit: the launcher moves the sequences to grid x
  args = _abstract(70000 * BT, 1, 64, 64, 70000, jnp.float32)
  jax.jit(lambda *a: mgd.apply(*a, scale=0.125, chunk_size=BT)).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.large
@pytest.mark.parametrize("lens,K,V", [([600, 5, 200], 128, 128), ([1500, 3], 64, 64), ([130, 17, 0, 40], 128, 64)],
                         ids=["K128-V128", "K64-V64", "K128-V64"])
def test_bwd_dh_matches_reference_long_sequences(lens, K, V):
  check(lens, K, V, seed=1)


def test_bwd_dh_on_forward_records():
  """Inputs as test_bwd_dh builds them: the forward references' records (bwd_setup.forward_records:
  make_inputs data, partial chunks, an empty sequence), S1's dv, random do and dht; qg, kg, w, h,
  v_new rounded to bf16 for both sides."""
  s = bwd_setup.forward_records(lens=(1, 63, 0, 65), K=64, V=64, chunk_size=BT, gate="plain")
  kg, w, u, gi, gc, h0, acu = s.rec["inputs"]["state"]
  qg, h, Aqk, v_new = s.rec["inputs"]["output"]
  do, dht = bwd_setup.randn(30, u.shape, h0.shape)
  dv = bwd_dav.reference.apply(v_new, Aqk, do, chunk_size=BT).dv
  rnd = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  args = (rnd(qg), rnd(kg), rnd(w), gi, gc, rnd(h), rnd(v_new), do, dv, dht, acu)
  assert s.plan.scale == 64 ** -0.5       # the scale run_kernel passes
  out, _ = run_kernel(args)
  ref = _reference(s.plan.scale)(*args)
  errs = errors(out, ref)
  print("\n  forward records: " + ", ".join(f"{k} max {e[0]:.2e} norm {e[1]:.2e}" for k, e in errs.items()))
  for name, (emax, enorm) in errs.items():
    assert np.isfinite(emax) and emax <= TOL["max"] and enorm <= TOL["norm"], (name, emax, enorm)
  empty = np.asarray(s.layout.lens) == 0
  np.testing.assert_array_equal(np.asarray(out.dh0)[empty], np.asarray(dht)[empty])


@pytest.mark.parametrize("K,V", [(64, 64), pytest.param(64, 128, marks=pytest.mark.large)],
                         ids=["K64-V64", "K64-V128"])
def test_bwd_dh_packed_do_equals_aligned(K, V):
  """do_packed + rows: the walk and terms kernels read do packed (a 70-token gap and 5 tokens after
  the last sequence: NaN, never read into a result) and every output is bit for bit the aligned
  do's; the aligned do is not read then (NaN everywhere changes nothing); with clean, non-finite
  values at real tokens read as 0."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  args, acu, _ = make_case(LENS, K, V)
  Ta, HV = args[0].shape[1], args[0].shape[2]
  layout, _ = packed_layout(LENS, [0, 70, 0, 0, 0], extra_T=5, tail_chunks=(Ta - int(acu[-1])) // BT)
  assert layout.Ta == Ta and np.array_equal(np.asarray(layout.aligned_cu), np.asarray(acu))
  owned = padding.packed_owned_mask(layout)[None, :, None, None]
  do_p = jax.random.normal(jax.random.key(3), (1, layout.T, HV, V)).astype(jnp.bfloat16)
  do_p = jnp.where(owned, do_p, jnp.asarray(jnp.nan, jnp.bfloat16))
  args = args[:7] + (padding.align_with(layout, do_p),) + args[8:]
  f = lambda *a, **kw: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, interpret=True, **kw)
  want = jax.jit(f)(*args)
  unread = args[:7] + (jnp.full_like(args[7], jnp.nan),) + args[8:]
  kw = dict(do_packed=do_p, rows=padding.chunk_rows(layout))
  got = jax.jit(lambda *a: f(*a, **kw))(*unread)
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  # clean (traced): a NaN and an inf in do at real tokens read as 0 by both kernels, the same bits
  t = int(layout.starts[1]) + 4
  bad = do_p.at[0, t, 1, 3].set(jnp.nan).at[0, t + 40, 0, 0].set(jnp.inf)
  zeroed = jnp.where(jnp.isfinite(bad) | ~owned, bad, 0).astype(jnp.bfloat16)
  g = jax.jit(lambda clean, p: f(*unread, do_packed=p, rows=kw["rows"], clean=clean))
  for name, a, b in zip(FIELDS, g(True, bad), g(False, zeroed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)
  assert not all(np.isfinite(np.asarray(x)).all() for x in g(False, bad))
  # the walk (lowered first) with its two landings of packed rows: the predicate's figure
  smem = lowered_smem_bytes(lambda *a: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, **kw), *args)
  assert smem == mgd.walk_smem_bytes(K, packed=True) == SMEM_AS_LOWERED[K] + 2 * BT * 64 * 2


def _with_packed_do(K, V, packed):
  """make_case(LENS, K, V)'s arguments and, where packed, do replaced by the aligned copy of a packed
  do (a 70-token gap and 5 tokens after the last sequence, zeros there) with the keywords that hand
  the terms kernel the packed one."""
  from kda import padding
  from tests.stages.test_gate_mosaic import packed_layout
  args, acu, _ = make_case(LENS, K, V)
  if not packed:
    return args, {}
  Ta, HV = args[0].shape[1], args[0].shape[2]
  layout, _ = packed_layout(LENS, [0, 70, 0, 0, 0], extra_T=5, tail_chunks=(Ta - int(acu[-1])) // BT)
  do_p = jax.random.normal(jax.random.key(3), (1, layout.T, HV, V)).astype(jnp.bfloat16)
  do_p = jnp.where(padding.packed_owned_mask(layout)[None, :, None, None], do_p, jnp.bfloat16(0))
  args = args[:7] + (padding.align_with(layout, do_p),) + args[8:]
  return args, dict(do_packed=do_p, rows=padding.chunk_rows(layout))


@pytest.mark.parametrize("K,V,packed", [(64, 64, False), (64, 64, True), (64, 128, False)],
                         ids=["K64-V64", "K64-V64-packed", "K64-V128"])
def test_bwd_dh_bf16_du_over_v_new(K, V, packed):
  """du_dtype=bfloat16: du comes back as bf16(du) (stored over v_new's buffer; the tail's too) and
  dh0, dqg, dkg, dw, dgc_last bit for bit the float32 call's (dw stored over du's buffer where
  K == V); with do read packed as well. Lowers for CUDA with v_new and du as mutable refs."""
  args, kw = _with_packed_do(K, V, packed)
  f = lambda *a, **k: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, interpret=True, **kw, **k)
  want = jax.jit(f)(*args)
  got = jax.jit(lambda *a: f(*a, du_dtype=jnp.bfloat16))(*args)
  assert got.du.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got.du), np.asarray(want.du.astype(jnp.bfloat16)))
  for name in ("dh0", "dqg", "dkg", "dw", "dgc_last"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  assert float(np.abs(np.asarray(got.dw)).max()) > 0
  text = jax.jit(lambda *a: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, du_dtype=jnp.bfloat16, **kw)).trace(
      *args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in line for line in text.splitlines()) == 2


@pytest.mark.parametrize("packed", [False, True], ids=["aligned", "packed"])
def test_bwd_dh_pairs_over_h_and_dh(packed):
  """pairs=True (K = V = 128, with du_dtype=bfloat16 as the packed backward calls it): dqg and dkg
  come as their pairs, bit for bit to_pairs of the float32 call's (the tail's zeros included), and
  dh0, du, dw, dgc_last bit for bit that call's; with do read packed as well. Lowers for CUDA with
  h and dh as mutable refs."""
  from kda._mosaic_gpu import from_pairs, to_pairs
  K = V = 128
  args, kw = _with_packed_do(K, V, packed)
  kw["du_dtype"] = jnp.bfloat16
  f = lambda *a, **k: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, interpret=True, **kw, **k)
  want = jax.jit(f)(*args)
  got = jax.jit(lambda *a: f(*a, pairs=True))(*args)
  NTa, HV = args[0].shape[1] // BT, args[0].shape[2]
  for name in ("dqg", "dkg"):
    p = getattr(got, name)
    assert p.shape == (1, NTa, HV, 2 * BT, K) and p.dtype == jnp.bfloat16, (name, p.shape, p.dtype)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(to_pairs(getattr(want, name))), name)
    x, ref = np.asarray(from_pairs(p)), np.asarray(getattr(want, name))
    assert np.abs(x - ref).max() <= 2 ** -16 * np.abs(ref).max() and np.abs(ref).max() > 0, name
  for name in ("dh0", "du", "dw", "dgc_last"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
  text = jax.jit(lambda *a: mgd.apply(*a, scale=K ** -0.5, chunk_size=BT, pairs=True, **kw)).trace(
      *args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in line for line in text.splitlines()) == 2


def test_bwd_dh_terms_kernel_smem():
  """The terms kernel lowers for CUDA at K = V = 128 in two CTAs per SM, aligned and reading do
  packed (do's plain landing shares v_new's bytes; one barrier more), with the SMEM `terms_smem_bytes`
  (the predicate's figure) computes from the launcher's scratch."""
  S, Ta, T, HV, K, V = jax.ShapeDtypeStruct, 4096, 4000, 16, 128, 128
  NTa = Ta // BT
  bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
  common = (S((NTa, HV, K, V), bf), S((NTa, HV, K, V), bf), S((Ta, HV, V), bf))
  tail = (S((Ta, HV, V), f32), S((NTa, HV, K), f32))
  aligned = lowered_smem_bytes(lambda *a: mgd._terms_kernel(Ta, HV, K, V, scale=K ** -0.5, interp=None)(*a),
                               S((5,), i32), *common, S((Ta, HV, V), bf), *tail)
  packed = lowered_smem_bytes(
      lambda *a: mgd._terms_kernel(Ta, HV, K, V, scale=K ** -0.5, interp=None, packed=True)(*a),
      S((5,), i32), S((NTa,), i32), S((NTa,), i32), S((1,), i32), *common, S((T, HV, V), bf), *tail)
  print(f"\n  bwd_dh terms SMEM: aligned {aligned}, packed do {packed} bytes")
  assert aligned == mgd.terms_smem_bytes(K, V) == 100360 and packed == mgd.terms_smem_bytes(K, V, True) == 100368
  assert packed <= SMEM_TWO_CTAS


def test_walk_alone_stores_bf16_du():
  """walk(): the walk kernel alone (for bwd_wy's terms kernel) gives apply's dh0 and du rounded to
  bf16 at the chunks before aligned_cu[-1] (its own bf16 buffer; the tail's rows unwritten), with
  do read packed as well, and the decay of each chunk."""
  from kda.stages.state import chunk_decay
  args, kw = _with_packed_do(64, 64, True)
  acu = args[-1]
  live = int(acu[-1])
  f = lambda *a, **k: mgd.apply(*a, scale=64 ** -0.5, chunk_size=BT, interpret=True, **kw, **k)
  want = jax.jit(f)(*args)
  a = args[:5] + args[6:]                               # walk takes no h
  dh0, dh, du, decay = jax.jit(lambda *a: mgd.walk(*a, scale=64 ** -0.5, interpret=True, **kw))(*a)
  np.testing.assert_array_equal(np.asarray(dh0), np.asarray(want.dh0))
  assert du.dtype == jnp.bfloat16 and dh.dtype == jnp.bfloat16 and dh.shape == args[5].shape
  np.testing.assert_array_equal(np.asarray(du[:, :live]), np.asarray(want.du[:, :live].astype(jnp.bfloat16)))
  np.testing.assert_array_equal(np.asarray(decay), np.asarray(chunk_decay(args[3], args[4], BT)))
  dh = np.asarray(dh[:, :live // BT].astype(jnp.float32))      # unwritten at the tail chunks
  assert np.isfinite(dh).all() and np.abs(dh).max() > 0
