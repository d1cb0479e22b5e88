"""The fused state -> output Mosaic GPU kernel against the composition of the members' references
(state.reference -> output.reference): simulator runs on CPU and CUDA lowering, both variants.

Inputs are rounded to bf16 and the references get the same values in float32, so what is left is
the kernel's bf16 rounding of S and v_new where they enter the wgmmas, as in test_state_mosaic.py:
measured max|d| / max|ref| <= 2.3e-3 for o (2.4e-3 with a bf16 o) and 1.6e-3 for final_state,
||d|| / ||ref|| <= 1.7e-3 (2.4e-3 with a bf16 o), against TOL below. Against the Mosaic state and output kernels composed (bf16 h and v_new in between:
the same roundings) the fused kernel agrees to float32 summation order: measured 0 in the simulator.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.fused.state_output import mosaic_gpu as so
from kda import plan as planning
from kda.stages import output, state
from tests import cases
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
TOL = {"max": 5e-3, "norm": 4e-3}    # bf16 operands of the dots; see the module docstring
SERIAL, SPLIT = so.Config(), so.Config(warp_specialized=True)
VARIANTS = {"serial": SERIAL, "warp-specialized": SPLIT}


def fused_case(lens, K, V, HV=1, tail_chunks=2, seed=0):
  """Aligned inputs in numpy (jax.random would compile per shape, which costs more than the
  kernels here): sequence n at [acu[n], acu[n] + len_n), zeros up to acu[n+1] (align's output),
  then tail_chunks chunks nobody owns, poisoned with NaN. Delta-rule-like state inputs as in
  test_state_mosaic.make_case (unit-norm k, beta < 1/4, slow gates with 5% strong channels),
  qg and a causal Aqk zero at padding tokens, as intra makes them. Returns (args with bf16
  kg, w, u, qg, Aqk; the same values in float32; owned token mask)."""
  acu, Ta, valid, tail = cases.aligned_layout(lens, BT, tail_chunks)
  r = [np.random.default_rng(x) for x in np.random.SeedSequence(seed).spawn(8)]
  m = valid[None, :, None, None]
  k = r[0].standard_normal((1, Ta, HV, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  beta = r[1].uniform(0, 0.25, (1, Ta, HV, 1))
  g = -np.log1p(np.exp(-r[2].standard_normal((1, Ta, HV, K))))             # log_sigmoid
  g = np.where(m, np.where(r[3].uniform(size=(1, 1, HV, K)) < 0.05, g, g / 64), 0.0)
  gc = np.cumsum(g.reshape(1, Ta // BT, BT, HV, K), axis=2).reshape(1, Ta, HV, K)
  last = np.repeat(gc[:, BT - 1::BT], BT, axis=1)
  kg = np.where(m, k * np.exp(last - gc), 0.0)
  w = np.where(m, beta * k * np.exp(gc), 0.0)
  u = np.where(m, r[4].standard_normal((1, Ta, HV, V)), 0.0)
  qg = np.where(m, r[5].standard_normal((1, Ta, HV, K)) / np.sqrt(K), 0.0)
  causal = (np.arange(Ta) % BT)[:, None] >= np.arange(BT)[None, :]
  col_valid = valid.reshape(-1, BT).repeat(BT, 0)                         # [Ta, BT]
  Aqk = np.where(m & (causal & col_valid)[None, :, None, :], r[6].standard_normal((1, Ta, HV, BT)) / 8, 0.0)
  h0 = r[7].standard_normal((len(lens), HV, K, V))
  gi = np.floor(gc)
  pt = tail[None, :, None, None]
  kg, w, u, qg, Aqk, gi, gf = (np.where(pt, np.nan, x) for x in (kg, w, u, qg, Aqk, gi, gc - gi))
  bf = tuple(jnp.asarray(x, jnp.bfloat16) for x in (kg, w, u, qg, Aqk))
  rest = tuple(jnp.asarray(x, jnp.float32) for x in (gi, gf, h0)) + (jnp.asarray(acu),)
  return bf + rest, tuple(x.astype(jnp.float32) for x in bf) + rest, ~tail


@functools.lru_cache(maxsize=None)
def _composed(scale):
  def composed(kg, w, u, qg, Aqk, gi, gf, h0, acu):
    st = state.reference.apply(kg, w, u, gi, gf, h0, acu, chunk_size=BT)
    return output.reference.apply(qg, st.h, Aqk, st.v_new, scale=scale, chunk_size=BT).o, st.final_state
  return jax.jit(composed)


def composed_reference(*args, scale):
  return _composed(scale)(*args)


@functools.lru_cache(maxsize=None)
def _fused(scale, config):
  return jax.jit(functools.partial(so.apply, scale=scale, chunk_size=BT, interpret=True, config=config))


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return (np.abs(a - b).max() / max(np.abs(b).max(), 1e-30),
          np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(lens, K, V, config, HV=1, tail_chunks=2, seed=0):
  bf, f32, owned = fused_case(lens, K, V, HV=HV, tail_chunks=tail_chunks, seed=seed)
  scale = K ** -0.5
  t0 = time.time()
  o, final = jax.block_until_ready(_fused(scale, config)(*bf))
  secs = time.time() - t0
  ref_o, ref_final = composed_reference(*f32, scale=scale)
  assert o.shape == ref_o.shape and o.dtype == so.OUT_DTYPES[config.out_dtype]
  assert final.shape == ref_final.shape and final.dtype == jnp.float32
  eo, ef = rel(np.asarray(o)[:, owned], np.asarray(ref_o)[:, owned]), rel(final, ref_final)
  print(f"\n  lens={lens} K={K} V={V} {config}: simulator {secs:.2f}s; o max {eo[0]:.2e} norm {eo[1]:.2e}, "
        f"final max {ef[0]:.2e} norm {ef[1]:.2e}")
  for e in (eo, ef):
    assert np.isfinite(e[0]) and e[0] <= TOL["max"] and e[1] <= TOL["norm"], (eo, ef)
  # padding tokens and the NaN-poisoned tail: exactly 0
  assert np.all(np.asarray(o)[:, ~owned] == 0)
  for n, L in enumerate(lens):
    if L == 0:
      np.testing.assert_array_equal(np.asarray(final[n]), np.asarray(f32[7][n]))
  return bf, o, final


KV = [(64, 64), (128, 128), (64, 128), (128, 64)]


@pytest.mark.parametrize("K,V", KV, ids=[f"K{k}-V{v}" for k, v in KV])
def test_fused_matches_composed_references_serial(K, V):
  check([1, 63, 64, 0, 65, 130], K, V, SERIAL)


@pytest.mark.parametrize("K,V,HV", [(64, 64, 2), (128, 128, 1)], ids=["K64-V64-HV2", "K128-V128"])
def test_fused_matches_composed_references_warp_specialized(K, V, HV):
  check([1, 63, 64, 0, 65, 130], K, V, SPLIT, HV=HV)


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_fused_single_sequence(variant):
  check([300], 64, 64, VARIANTS[variant], seed=1)


@pytest.mark.parametrize("config", [so.Config(input_slots=1), so.Config(input_slots=1, stage_o=False),
                                    so.Config(warp_specialized=True, stage_o=False)],
                         ids=["one-slot", "one-slot-direct-o", "warp-specialized-direct-o"])
def test_fused_variants_same_bits(config):
  """Loads without prefetch and o stored from registers change nothing in the arithmetic."""
  bf, _, _ = fused_case([130, 0, 65, 1], 64, 128, seed=4)
  want = _fused(0.125, SERIAL)(*bf)
  for a, b in zip(_fused(0.125, config)(*bf), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_equals_composed_mosaic_kernels():
  """The state kernel (bf16 h, v_new) then the output kernel: the same roundings, so the fused
  variants match the composition up to float32 summation order."""
  bf, _, owned = fused_case([130, 0, 65, 1], 64, 64, HV=2, seed=2)
  kg, w, u, qg, Aqk, gi, gf, h0, acu = bf
  st = state.mosaic_gpu.apply(kg, w, u, gi, gf, h0, acu, chunk_size=BT, interpret=True)
  assert st.h.dtype == st.v_new.dtype == jnp.bfloat16
  o_ref = output.mosaic_gpu.apply(qg, st.h, Aqk, st.v_new, scale=0.125, chunk_size=BT, interpret=True).o
  for config in VARIANTS.values():
    o, final = _fused(0.125, config)(*bf)
    eo, ef = rel(np.asarray(o)[:, owned], np.asarray(o_ref)[:, owned]), rel(final, st.final_state)
    assert eo[0] <= 1e-5 and ef[0] <= 1e-5, (config, eo, ef)


def test_fused_bf16_output_no_tail_and_no_sequences():
  bf, o, final = check([65, 3], 64, 64, so.Config(out_dtype="bfloat16"), tail_chunks=0)
  o32, final32 = _fused(0.125, SERIAL)(*bf)
  np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)),
                                np.asarray(o32.astype(jnp.bfloat16).astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(final), np.asarray(final32))
  empty = bf[:7] + (bf[7][:0], jnp.zeros((1,), jnp.int32))
  o, final = so.apply(*empty, scale=0.125, chunk_size=BT, interpret=True)
  assert np.all(np.asarray(o) == 0) and final.shape == (0, 1, 64, 64)


def test_fused_supports():
  bf, f32, _ = fused_case([5], 64, 64, tail_chunks=0)
  assert so.supports(*bf, scale=0.125, chunk_size=BT) is None
  assert "bfloat16" in so.supports(*f32, scale=0.125, chunk_size=BT)
  assert "chunk_size" in so.supports(*bf, chunk_size=32)
  kg, w, u, qg, Aqk, gi, gf, h0, acu = bf
  assert "qg" in so.supports(kg, w, u, qg[..., :32], Aqk, gi, gf, h0, acu, chunk_size=BT)
  assert "Aqk" in so.supports(kg, w, u, qg, Aqk[..., :32], gi, gf, h0, acu, chunk_size=BT)
  assert "V must" in so.supports(kg, w, u[..., :48], qg, Aqk, gi, gf, h0[..., :48], acu, chunk_size=BT)
  S = jax.ShapeDtypeStruct
  k256 = lambda x: S(x.shape[:3] + (256,), x.dtype)
  assert "K must be one of (64, 128), got 256" in so.supports(
      k256(kg), k256(w), u, k256(qg), Aqk, k256(gi), k256(gf), S(h0.shape[:2] + (256, 64), h0.dtype), acu,
      chunk_size=BT)
  with pytest.raises(ValueError, match="chunk_size"):
    so.apply(*bf, scale=0.125, chunk_size=32, interpret=True)
  with pytest.raises(ValueError, match="out_dtype"):
    so.Config(out_dtype="float16")
  with pytest.raises(ValueError, match="input_slots"):
    so.Config(warp_specialized=True, input_slots=1)


def _abstract(Ta, HV, K, V, N):
  S, b, f = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  return (S((1, Ta, HV, K), b), S((1, Ta, HV, K), b), S((1, Ta, HV, V), b), S((1, Ta, HV, K), b),
          S((1, Ta, HV, BT), b), S((1, Ta, HV, K), f), S((1, Ta, HV, K), f), S((N, HV, K, V), f),
          S((N + 1,), jnp.int32))


CONFIGS = [SERIAL, SPLIT, so.Config(out_dtype="bfloat16"), so.Config(warp_specialized=True, out_dtype="bfloat16"),
           so.Config(input_slots=1), so.Config(input_slots=1, stage_o=False),
           so.Config(warp_specialized=True, stage_o=False), so.Config(group_chunks=0)]
CONFIG_IDS = ["serial", "warp-specialized", "serial-bf16-o", "warp-specialized-bf16-o", "one-slot",
              "one-slot-direct-o", "warp-specialized-direct-o", "one-program-per-sequence"]


@pytest.mark.parametrize("K,V", KV, ids=[f"K{k}-V{v}" for k, v in KV])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_fused_lowers_for_cuda(K, V, config):
  args = _abstract(32768 + 489 * BT, 16, K, V, 489)
  f = lambda *a: so.apply(*a, scale=K ** -0.5, chunk_size=BT, config=config)
  smem = lowered_smem_bytes(f, *args)
  print(f"\n  K={K} V={V} {config}: SMEM {smem} bytes as lowered")
  assert smem == so.smem_bytes(K, config) <= 232448     # the predicate's figure


@functools.lru_cache(maxsize=None)
def _lowered_text(config):
  f = lambda *a: so.apply(*a, scale=0.125, chunk_size=BT, config=config)
  return jax.jit(f).trace(*_abstract(8 * BT, 2, 64, 64, 5)).lower(lowering_platforms=("cuda",)).as_text()


FIELDS = {"warp_specialized": True, "out_dtype": "bfloat16", "longest_first": False, "input_slots": 1,
          "stage_o": False, "group_chunks": 0}
BASE = {"longest_first": {"group_chunks": 0}}   # the grouped walk's order ignores longest_first


@pytest.mark.parametrize("field", list(FIELDS))
def test_config_field_changes_the_program(field):
  """Each Config field gives another lowered program (5 sequences in 8 chunks: the default
  group_chunks groups them); the simulator runs each against the references or the default's bits
  (test_fused_matches_composed_references_*, test_fused_bf16_output_*, test_fused_variants_same_bits,
  test_fused_grouped_walk_same_bits, test_fused_single_sequence). With kda's lowering cache (on in the
  tests, conftest.py) lowerings of one kernel carry the same module, so programs differ only where
  the field changes something."""
  base = BASE.get(field, {})
  assert _lowered_text(so.Config(**base, **{field: FIELDS[field]})) != _lowered_text(so.Config(**base))


def test_fused_lowers_for_cuda_many_sequences():
  # N > 65535 would break CUDA's grid z limit: the launcher moves the sequences to grid x
  args = _abstract(70000 * BT, 1, 64, 64, 70000)
  jax.jit(lambda *a: so.apply(*a, scale=0.125, chunk_size=BT, config=SPLIT)).trace(*args).lower(
      lowering_platforms=("cuda",))


def test_pipeline_fuses_state_and_output_only_when_both_select_mosaic_gpu(monkeypatch):
  """chunk_kda with impl="mosaic_gpu" (simulator) calls the fused kernel and matches the recurrence;
  breaking the group (output on the reference) or recording every stage runs them unfused."""
  import kda
  from kda import padding, pipeline
  from kda.reference import recurrent_kda
  calls = []
  real = so.apply
  monkeypatch.setattr(so, "apply", lambda *a, **kw: calls.append(1) or real(*a, **kw))   # a spy: same results
  r = [np.random.default_rng(s) for s in range(5)]
  T, H, K, V = 130, 2, 64, 64
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (jnp.asarray(unit(r[i].standard_normal((1, T, H, K))), jnp.bfloat16) for i in (0, 1))
  v = jnp.asarray(r[2].standard_normal((1, T, H, V)), jnp.bfloat16)
  g = jnp.asarray(np.log(1 / (1 + np.exp(-r[3].standard_normal((1, T, H, K))))) / 4, jnp.float32)
  beta = jnp.asarray(r[4].uniform(0.1, 0.9, (1, T, H)), jnp.bfloat16)
  cu = jnp.array([0, 65, 130], jnp.int32)
  f32 = lambda x: x.astype(jnp.float32)
  want, want_ht = recurrent_kda(f32(q), f32(k), f32(v), g, f32(beta), output_final_state=True, cu_seqlens=cu)
  for impl, fused in (("mosaic_gpu", 1), ({"intra": "mosaic_gpu", "state": "mosaic_gpu", "output": "reference"}, 0)):
    calls.clear()
    o, ht = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, impl=impl)
    assert len(calls) == fused, impl
    # bf16 inputs, bf16 intermediates and o: measured 5.1e-3 (o), 4.5e-3 (final) of max|ref|
    assert float(jnp.max(jnp.abs(f32(o) - want))) <= 1e-2 * float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(ht - want_ht))) <= 1e-2 * float(jnp.max(jnp.abs(want_ht)))
  calls.clear()
  plan = planning.make_plan(scale=K ** -0.5, chunk_size=64, impl="mosaic_gpu")
  layout = padding.layout_from_cu_seqlens(cu, T, 64)
  h0 = jnp.zeros((2, H, K, V), jnp.float32)
  _, _, rec = pipeline.forward(plan, layout, q, k, v, g, beta, h0, None, None, record=True)
  assert not calls and {"state", "output"} <= set(rec)


# --- packed mode: o stored straight into the packed layout (rows=chunk_rows(layout), T)

@functools.lru_cache(maxsize=None)
def _fused_packed(scale, config, T):
  return jax.jit(lambda *a, rows: so.apply(*a, scale=scale, chunk_size=BT, interpret=True, config=config,
                                                rows=rows, T=T))


def check_packed(lens, starts, T, K, V, config, HV=1, tail_chunks=1, seed=0, layout=None):
  """Packed mode against padding.unalign_with(layout, aligned mode's o): bit for bit, the same
  final_state, and exact zeros at every packed token no sequence owns."""
  from kda import padding
  bf, _, _ = fused_case(lens, K, V, HV=HV, tail_chunks=tail_chunks, seed=seed)
  Ta = bf[0].shape[1]
  if layout is None:
    layout = padding.Layout(jnp.asarray(starts, jnp.int32), jnp.asarray(lens, jnp.int32), bf[8], T, Ta, BT)
  assert layout.Ta == Ta and np.array_equal(np.asarray(layout.aligned_cu), np.asarray(bf[8]))
  scale = K ** -0.5
  o_al, final_al = _fused(scale, config)(*bf)
  o, final = _fused_packed(scale, config, T)(*bf, rows=padding.chunk_rows(layout))
  assert o.shape == (1, T, HV, V) and o.dtype == so.OUT_DTYPES[config.out_dtype]
  want = padding.unalign_with(layout, o_al)
  np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(final), np.asarray(final_al))
  owned = np.asarray(padding.packed_owned_mask(layout))
  assert not owned.all() or tail_chunks == 0
  assert np.all(np.asarray(o.astype(jnp.float32))[:, ~owned] == 0)
  return o


PACKED = [((64, 64), SERIAL), ((128, 128), so.Config(warp_specialized=True, out_dtype="bfloat16")),
          ((64, 128), so.Config(out_dtype="bfloat16")), ((128, 64), SPLIT)]


@pytest.mark.parametrize("KV,config", PACKED, ids=["K64-V64-serial", "K128-V128-split-bf16",
                                                   "K64-V128-serial-bf16", "K128-V64-split"])
def test_fused_packed_o_equals_unaligned(KV, config):
  """cu_seqlens layout: lengths 1, 63, 64, an empty one, 65; tokens after cu_seqlens[-1], the last
  sequence ends within 64 rows of T, and T = 204 is not a multiple of 8."""
  lens = [1, 63, 64, 0, 65] if KV[0] == 64 else [65, 1, 0, 64, 63]
  cu = np.concatenate([[0], np.cumsum(lens)])
  check_packed(lens, cu[:-1], int(cu[-1]) + 11, *KV, config)


@pytest.mark.parametrize("config", [SERIAL, so.Config(warp_specialized=True, out_dtype="bfloat16"),
                                    so.Config(group_chunks=0)], ids=["serial", "split-bf16", "one-program-per-sequence"])
def test_fused_packed_o_segment_gaps(config):
  """segment_ids-style layout (padding.make_layout): a leading gap, gaps between runs, an empty slot
  (start T) and a trailing gap: every gap token exactly 0; T = 237."""
  from kda import padding
  lens, starts, T = [63, 1, 64, 0, 70], [3, 70, 72, 237, 150], 237
  layout = padding.make_layout(starts, lens, T, BT)
  check_packed(lens, starts, T, 64, 64, config, HV=2, tail_chunks=0, seed=3, layout=layout)


def test_fused_packed_no_gaps_and_no_sequences():
  """One full and one partial chunk filling T exactly (nothing to zero); N = 0 gives zeros [1, T]."""
  check_packed([64, 70], [0, 64], 134, 64, 64, SPLIT, tail_chunks=0, seed=5)
  bf, _, _ = fused_case([5], 64, 64, tail_chunks=0)
  from kda import padding
  empty = bf[:7] + (bf[7][:0], jnp.zeros((1,), jnp.int32))
  zero = jnp.zeros((1,), jnp.int32)
  o, final = so.apply(*empty, scale=0.125, chunk_size=BT, interpret=True, rows=padding.ChunkRows(zero, zero), T=13)
  assert o.shape == (1, 13, 1, 64) and np.all(np.asarray(o) == 0) and final.shape == (0, 1, 64, 64)


def test_fused_packed_supports_checks_rows():
  from kda import padding
  bf, _, _ = fused_case([5, 70], 64, 64, tail_chunks=0)
  NTa = bf[0].shape[1] // BT
  i32 = jnp.zeros((NTa,), jnp.int32)
  good = padding.ChunkRows(i32, i32)
  assert so.supports(*bf, chunk_size=BT, rows=good, T=75) is None
  assert "T" in so.supports(*bf, chunk_size=BT, rows=good)
  assert "T" in so.supports(*bf, chunk_size=BT, T=75)
  assert "rows.src" in so.supports(*bf, chunk_size=BT, rows=padding.ChunkRows(i32[:1], i32), T=75)
  assert "rows.count" in so.supports(*bf, chunk_size=BT, rows=padding.ChunkRows(i32, i32.astype(jnp.float32)), T=75)
  assert "ChunkRows" in so.supports(*bf, chunk_size=BT, rows=i32, T=75)
  with pytest.raises(ValueError, match="rows"):
    so.apply(*bf, scale=0.125, chunk_size=BT, interpret=True, rows=padding.ChunkRows(i32[:1], i32), T=75)


PACKED_LOWER = [SERIAL, SPLIT, so.Config(warp_specialized=True, out_dtype="bfloat16"),
                so.Config(input_slots=1, stage_o=False), so.Config(group_chunks=0)]


@pytest.mark.parametrize("config", PACKED_LOWER, ids=["serial", "warp-specialized", "warp-specialized-bf16-o",
                                                      "one-slot-direct-o", "one-program-per-sequence"])
def test_fused_packed_lowers_for_cuda(config):
  """Packed mode lowers for CUDA with T not a multiple of 8 (plain SMEM stage, TMA stores of 1..64
  rows at dynamic rows); its SMEM is the aligned mode's, except that stage_o=False keeps the stage."""
  from kda import padding
  Ta, N, T = 32768 + 489 * BT, 489, 32768 + 13
  args = _abstract(Ta, 16, 128, 128, N)
  rows = padding.ChunkRows(*(jax.ShapeDtypeStruct((Ta // BT,), jnp.int32),) * 2)
  smem = lowered_smem_bytes(lambda *a: so.apply(*a[:-1], scale=0.125, chunk_size=BT, config=config,
                                                     rows=a[-1], T=T), *args, rows)
  aligned = lowered_smem_bytes(lambda *a: so.apply(*a, scale=0.125, chunk_size=BT,
                                                        config=dataclasses.replace(config, stage_o=True)), *args)
  print(f"\n  packed {config}: SMEM {smem} bytes as lowered")
  assert smem == aligned == so.smem_bytes(128, config, packed=True) <= 232448


def test_fused_packed_store_rows_writes_exactly_count_rows():
  """The partial-chunk store (kda._mosaic_gpu.store_rows) in isolation, deterministic in one program each
  (the fused kernel's programs run in an order that hides an over-write in the simulator):
  program n zeroes its [2 * BT, 64] slice, then stores n rows of ones at row 37: exactly rows
  [37, 37 + n) are 1, for every n in [0, 64]."""
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from kda._mosaic_gpu import F32, WG, store_rows

  def body(o_g, ones_s, zeros_s):
    n = lax.axis_index("n")
    ones_s[...] = plgpu.layout_cast(jnp.ones((BT, 64), F32), WG)
    zeros_s[...] = plgpu.layout_cast(jnp.zeros((BT, 64), F32), WG)
    plgpu.commit_smem()
    for half in (0, 1):
      plgpu.copy_smem_to_gmem(zeros_s, o_g.at[n, pl.ds(half * BT, BT), :])
    plgpu.wait_smem_to_gmem(0)
    store_rows(ones_s, lambda ds: o_g.at[n, ds, :], 37, n)
    plgpu.wait_smem_to_gmem(0)

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((BT + 1, 2 * BT, 64), jnp.float32), grid=(BT + 1,),
                   grid_names=("n",), scratch_types=[plgpu.SMEM((BT, 64), jnp.float32)] * 2,
                   interpret=plgpu.InterpretGPUParams())
  got = np.asarray(jax.jit(f)())
  rows = np.arange(2 * BT)
  want = ((rows[None, :] >= 37) & (rows[None, :] < 37 + np.arange(BT + 1)[:, None])).astype(np.float32)
  np.testing.assert_array_equal(got, np.broadcast_to(want[:, :, None], got.shape))


GROUP_LENS = [1, 63, 64, 0, 65, 130, 3, 0, 70, 1]   # 12 chunks, two of them tail: NTa 14, N 10


@pytest.mark.parametrize("G", [2, 3], ids=["G2", "G3"])
def test_fused_grouped_walk_same_bits(G):
  """Config(group_chunks=G) (8 the default): each program walks the consecutive sequences starting in one window
  of G chunks (S from each one's h0, final_state at each one's end, the prefetch running on across
  them): o and final_state bit for bit the one-program-per-sequence kernel's, with empty sequences
  inside groups and the NaN-poisoned tail zeroed by P = cdiv(NTa, G) < N programs."""
  bf, _, _ = fused_case(GROUP_LENS, 64, 64, HV=2, seed=6)
  assert -(-bf[0].shape[1] // BT // G) < len(GROUP_LENS)        # grouped mode applies
  want = _fused(0.125, so.Config(group_chunks=0))(*bf)
  got = _fused(0.125, so.Config(group_chunks=G))(*bf)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_grouped_walk_packed():
  """Grouped mode with o packed: equal to the aligned grouped o unaligned (check_packed), hence to
  the per-sequence kernel's; every packed token of no sequence exactly 0."""
  cu = np.concatenate([[0], np.cumsum(GROUP_LENS)])
  check_packed(GROUP_LENS, cu[:-1], int(cu[-1]) + 9, 64, 64, so.Config(group_chunks=2), seed=7)


# --- inverse mode: the kernel applies X = Ainv, v_new = X (beta v - kd S), from kd, beta v and X's split

def inverse_case(lens, K, V, HV=1, tail_chunks=1, seed=0):
  """fused_case's inputs with w, u taken apart: per chunk a unit lower-triangular X (the inverse of
  I + Akk, strictly lower part of size ~0.1), kd with w = X kd and bv with u = X bv. Returns (args
  for the inverse mode: kg, kd, bv, qg, Aqk, gi, gf, h0, acu, inverse=(X hi, X lo) all bf16 parts;
  args for the w, u mode with the same values in float32)."""
  bf, f32, _ = fused_case(lens, K, V, HV=HV, tail_chunks=tail_chunks, seed=seed)
  r = np.random.default_rng(seed + 100)
  Ta = bf[0].shape[1]
  NTa = Ta // BT
  X = np.tril(r.standard_normal((NTa, HV, BT, BT)) * 0.1, -1) + np.eye(BT)
  X_hi = np.asarray(jnp.asarray(X, jnp.bfloat16).astype(jnp.float32))
  X_lo = np.asarray(jnp.asarray(X - X_hi, jnp.bfloat16).astype(jnp.float32))
  chunks = lambda x: np.asarray(x, np.float32).reshape(NTa, BT, HV, -1).transpose(0, 2, 1, 3)   # [NTa, HV, BT, d]
  back = lambda x: x.transpose(0, 2, 1, 3).reshape(1, Ta, HV, -1)
  kd = np.asarray(f32[1]) * 0.5                  # fused_case's w as kd, its u as beta v (NaN at the tail)
  bv = np.asarray(f32[2]) * 0.25
  kd, bv = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (kd, bv))
  Xf = X_hi + X_lo
  w, u = (back(Xf @ chunks(x)) for x in (kd, bv))
  # X is random at padding rows too, so w, u are not 0 there (intra's are); Aqk's zero columns and
  # kg's zero rows keep them out of o and S on both sides
  to_bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  xs = tuple(to_bf(back(x)) for x in (X_hi, X_lo))
  inv_args = (bf[0], to_bf(kd), to_bf(bv), bf[3], bf[4]) + bf[5:]
  wu_args = (f32[0], jnp.asarray(w, jnp.float32), jnp.asarray(u, jnp.float32)) + f32[3:]
  return inv_args, xs, wu_args


@pytest.mark.parametrize("K,V", [(64, 64), (128, 64)], ids=["K64-V64", "K128-V64"])
def test_fused_inverse_matches_composed_references(K, V):
  """Inverse mode against the references composed on w = X kd, u = X beta v (float32 from the
  same bf16 values): o and final_state within TOL; padding tokens and the tail exactly 0."""
  lens = [1, 63, 64, 0, 65, 130]
  inv_args, xs, wu_args = inverse_case(lens, K, V)
  _, _, owned = fused_case(lens, K, V, tail_chunks=1)
  scale = K ** -0.5
  o, final = jax.jit(lambda *a: so.apply(*a[:-2], scale=scale, chunk_size=BT, interpret=True,
                                              inverse=a[-2:]))(*inv_args, *xs)
  ref_o, ref_final = composed_reference(*wu_args, scale=scale)
  eo, ef = rel(np.asarray(o)[:, owned], np.asarray(ref_o)[:, owned]), rel(final, ref_final)
  print(f"\n  inverse K={K} V={V}: o max {eo[0]:.2e} norm {eo[1]:.2e}, final max {ef[0]:.2e} norm {ef[1]:.2e}")
  for e in (eo, ef):
    assert np.isfinite(e[0]) and e[0] <= TOL["max"] and e[1] <= TOL["norm"], (eo, ef)
  assert np.all(np.asarray(o)[:, ~owned] == 0)


def test_fused_inverse_packed_and_refusals():
  """Inverse mode packed (bf16 o, grouped walk) equals its aligned mode unaligned, bit for bit; the
  warp-specialised variant and malformed X parts are refused with the reason."""
  from kda import padding
  lens = [1, 63, 64, 0, 65]
  inv_args, xs, _ = inverse_case(lens, 64, 64, HV=2, seed=2)
  cu = np.concatenate([[0], np.cumsum(lens)])
  T = int(cu[-1]) + 11
  layout = padding.Layout(jnp.asarray(cu[:-1], jnp.int32), jnp.asarray(lens, jnp.int32), inv_args[8], T,
                          inv_args[0].shape[1], BT)
  cfg = so.Config(out_dtype="bfloat16", group_chunks=2)
  run = lambda **kw: jax.jit(lambda *a: so.apply(*a[:-2], scale=0.125, chunk_size=BT, interpret=True, config=cfg,
                                                      inverse=a[-2:], **kw))(*inv_args, *xs)
  o_al, final_al = run()
  o, final = run(rows=padding.chunk_rows(layout), T=T)
  want = padding.unalign_with(layout, o_al)
  np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(final), np.asarray(final_al))
  with pytest.raises(ValueError, match="serial"):
    so.apply(*inv_args, scale=0.125, chunk_size=BT, interpret=True, config=SPLIT, inverse=xs)
  with pytest.raises(ValueError, match="Ainv's low part"):
    so.apply(*inv_args, scale=0.125, chunk_size=BT, interpret=True, inverse=(xs[0], xs[1][..., :32]))


def test_fused_inverse_lowers_for_cuda():
  """Inverse mode lowers for CUDA at K = V = 128 (packed, the pipeline's call) within one CTA's SMEM."""
  from kda import padding
  Ta, N, T = 32768 + 489 * BT, 489, 32768 + 13
  args = _abstract(Ta, 16, 128, 128, N)
  x = jax.ShapeDtypeStruct((1, Ta, 16, BT), jnp.bfloat16)
  rows = padding.ChunkRows(*(jax.ShapeDtypeStruct((Ta // BT,), jnp.int32),) * 2)
  smem = lowered_smem_bytes(lambda *a: so.apply(*a[:-3], scale=0.125, chunk_size=BT, rows=a[-1], T=T,
                                                     inverse=a[-3:-1]), *args, x, x, rows)
  print(f"\n  inverse packed: SMEM {smem} bytes as lowered")
  assert smem == so.smem_bytes(128, packed=True, inverse=True) <= 232448
