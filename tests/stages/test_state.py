"""state stage: the reference against a float64 chunk recurrence, the Pallas kernel against the
reference (interpret mode), and the kernel's Triton lowering for an H200."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.stages import state
from tests import cases
from tests.lowering import lower_h200

# Reference (float32, HIGHEST) vs float64 over <= 12 chunks with K <= 16, values up to ~3: measured
# <= 1.1e-7; 1e-5 leaves headroom without hiding a wrong formula.
REF_TOL = dict(atol=1e-5, rtol=1e-5)
# Kernel vs reference, both float32 with full-precision dots on CPU: they differ only in summation
# order (measured <= 6e-8, values up to ~3.5); 2e-5 allows other XLA CPU versions to reorder sums.
KERNEL_TOL = dict(atol=2e-5, rtol=2e-5)


def numpy_state(kg, w, u, gi, gf, h0, aligned_cu, BT):
  """The docstring's chunk recurrence, one sequence and head at a time, in float64."""
  kg, w, u, gi, gf, h0 = (np.asarray(x, np.float64) for x in (kg, w, u, gi, gf, h0))
  gc = gi + gf
  acu = np.asarray(aligned_cu)
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  h = np.zeros((1, Ta // BT, HV, K, V))
  v_new = np.zeros((1, Ta, HV, V))
  final = h0.copy()
  for n in range(len(acu) - 1):
    for j in range(HV):
      S = h0[n, j].copy()
      for c in range(acu[n] // BT, acu[n + 1] // BT):
        r = slice(c * BT, (c + 1) * BT)
        h[0, c, j] = S
        v_new[0, r, j] = u[0, r, j] - w[0, r, j] @ S
        S = np.exp(gc[0, c * BT + BT - 1, j])[:, None] * S + kg[0, r, j].T @ v_new[0, r, j]
      final[n, j] = S
  return h, v_new, final


def stage_inputs(seed, lens, *, HV, K, V, BT, initial_state=True):
  """Random inputs of the state stage in kda.padding's aligned layout, zeros at padding positions.

  Drawn like tests/cases.make_inputs (unit-norm k, log-sigmoid gates with a few strong ones, beta in
  (0, 1)), one numpy stream per tensor: jax.random would compile per shape, which costs more than the
  kernels here. kg and gc are as the gate/intra stages make them; w and u skip intra's (I + Akk)^-1.
  """
  acu = padding.aligned_cu_seqlens(jnp.asarray(lens, jnp.int32), BT)
  Ta = padding.aligned_length(sum(lens) + 3, len(lens), BT)
  valid = np.zeros((1, Ta, 1, 1), bool)
  for n, L in enumerate(lens):
    valid[0, int(acu[n]):int(acu[n]) + L] = True
  r = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6)]
  k = r[0].standard_normal((1, Ta, HV, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = r[1].standard_normal((1, Ta, HV, V))
  g = -np.logaddexp(0.0, -2.0 * r[2].standard_normal((1, Ta, HV, K))) / 2.0
  g = np.where(r[3].uniform(size=(1, Ta, HV, 1)) < 0.05, 8.0 * g - 1.0, g)
  beta = 1.0 / (1.0 + np.exp(-r[4].standard_normal((1, Ta, HV, 1))))
  k, v, g, beta = (np.where(valid, x, 0.0) for x in (k, v, g, beta))
  g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
  gi, gf = (np.cumsum(x.reshape(1, Ta // BT, BT, HV, K), axis=2) for x in (np.ceil(g), g - np.ceil(g)))
  gc = gi + gf
  kg = (k.reshape(gc.shape) * np.exp(gc[:, :, -1:] - gc)).reshape(k.shape)
  gc, gi, gf = (x.reshape(k.shape) for x in (gc, gi, gf))
  w = beta * k * np.exp(gc)
  u = beta * v
  h0 = 0.5 * r[5].standard_normal((len(lens), HV, K, V)) if initial_state else np.zeros((len(lens), HV, K, V))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(kg), f32(w), f32(u), f32(gi), f32(gf), f32(h0), acu


@functools.lru_cache(maxsize=None)
def _reference(BT):
  return jax.jit(functools.partial(state.reference.apply, chunk_size=BT))


@functools.lru_cache(maxsize=None)
def _kernel(BT, config=None):
  return jax.jit(functools.partial(state.pallas.apply, chunk_size=BT, interpret=True, config=config))


def check_outputs(got, want, acu, BT, tol):
  for name in state.Out._fields:
    chex.assert_shape(getattr(got, name), getattr(want, name).shape)
    cases.report_close(name, getattr(got, name), getattr(want, name), **tol)
  end = int(acu[-1])
  assert not np.any(np.asarray(got.h[:, end // BT:])), "h after aligned_cu[-1] is not exactly 0"
  assert not np.any(np.asarray(got.v_new[:, end:])), "v_new after aligned_cu[-1] is not exactly 0"


@pytest.mark.parametrize("profile,BT", [("with_empty", 16), ("trailing_empty", 16), ("45_80_20", 32)])
def test_reference_matches_numpy_chunk_recurrence(profile, BT):
  args = stage_inputs(1, cases.SEQ_LENS[profile], HV=2, K=16, V=8, BT=BT)
  got = _reference(BT)(*args)
  h, v_new, final = numpy_state(*args, BT)
  cases.report_close("h", got.h, h, **REF_TOL)
  cases.report_close("v_new", got.v_new, v_new, **REF_TOL)
  cases.report_close("final_state", got.final_state, final, **REF_TOL)
  lens = cases.SEQ_LENS[profile]
  for n in (n for n, L in enumerate(lens) if L == 0):   # an empty sequence keeps its state
    np.testing.assert_array_equal(np.asarray(got.final_state[n]), np.asarray(args[5][n]))


KERNEL_CASES = [
    # profile, K, V, BT, initial_state, block_v
    ("30_50", 32, 32, 16, True, 64),
    ("with_empty", 64, 64, 32, True, 64),
    ("trailing_empty", 96, 96, 64, True, 64),       # K and V zero-padded to 128; 2 V tiles
    ("boundaries", 64, 128, 64, False, 64),
    ("long_short", 32, 96, 16, False, 64),
    ("45_80_20", 96, 64, 32, True, 32),
    ("100_50", 32, 128, 32, True, 32),              # 4 V tiles
]


@pytest.mark.parametrize(
    "profile,K,V,BT,h0,block_v", KERNEL_CASES,
    ids=[f"{p}-K{K}-V{V}-BT{BT}-{'h0' if h else 'noh0'}-BV{b}" for p, K, V, BT, h, b in KERNEL_CASES])
def test_kernel_matches_reference_varlen(profile, K, V, BT, h0, block_v):
  args = stage_inputs(2, cases.SEQ_LENS[profile], HV=2, K=K, V=V, BT=BT, initial_state=h0)
  acu = args[-1]
  want = _reference(BT)(*args)
  got = _kernel(BT, state.pallas.Config(block_v=block_v))(*args)
  check_outputs(got, want, acu, BT, KERNEL_TOL)


def test_kernel_in_k_slabs_matches_reference():
  """The state carried as K // block_k row slabs (how K = 256 fits the shared memory) is the same state."""
  args = stage_inputs(5, cases.SEQ_LENS["45_80_20"], HV=2, K=64, V=32, BT=32, initial_state=True)
  want = _reference(32)(*args)
  got = _kernel(32, state.pallas.Config(block_v=32, block_k=16))(*args)
  check_outputs(got, want, args[-1], 32, KERNEL_TOL)


def test_kernel_never_reads_the_tail():
  """NaN inputs after aligned_cu[-1]: the owned outputs do not change and the tail is still 0.

  Also covers sequences handed out in input order (longest_first=False)."""
  BT = 16
  kg, w, u, gi, gf, h0, acu = stage_inputs(3, cases.SEQ_LENS["long_short"], HV=2, K=32, V=32, BT=BT)
  want = _reference(BT)(kg, w, u, gi, gf, h0, acu)
  tail = (jnp.arange(kg.shape[1]) >= acu[-1])[None, :, None, None]
  kg, w, u, gi, gf = (jnp.where(tail, jnp.nan, x) for x in (kg, w, u, gi, gf))
  got = _kernel(BT, state.pallas.Config(longest_first=False))(kg, w, u, gi, gf, h0, acu)
  check_outputs(got, want, acu, BT, KERNEL_TOL)


def test_kernel_without_sequences_gives_zeros():
  z = jnp.ones((1, 32, 2, 16))
  got = state.pallas.apply(z, z, z, z, z, jnp.zeros((0, 2, 16, 16)), jnp.zeros((1,), jnp.int32),
                           chunk_size=16, interpret=True)
  chex.assert_shape((got.h, got.v_new, got.final_state), [(1, 2, 2, 16, 16), (1, 32, 2, 16), (0, 2, 16, 16)])
  assert not np.any(np.asarray(got.h)) and not np.any(np.asarray(got.v_new))


def test_kernel_one_compile_for_two_layouts():
  """aligned_cu is traced: another length profile with the same N and T reuses the compile."""
  BT = 16
  f = jax.jit(functools.partial(state.pallas.apply, chunk_size=BT, interpret=True))
  for lens in ((30, 0, 50), (3, 64, 13)):
    args = stage_inputs(4, lens, HV=2, K=32, V=64, BT=BT)
    check_outputs(f(*args), _reference(BT)(*args), args[-1], BT, KERNEL_TOL)
  assert f._cache_size() == 1


def test_config_rejects_bad_tiles():
  with pytest.raises(ValueError, match="block_v"):
    state.pallas.Config(block_v=48)
  with pytest.raises(ValueError, match="precision"):
    state.pallas.Config(precision="fast")
  with pytest.raises(ValueError, match="num_warps"):
    state.pallas.Config(num_warps=3)


LOWER_CASES = [(128, 128, 64, "highest"), (128, 128, 64, "tf32x3"), (96, 96, 64, "highest"),
               (128, 128, 16, "highest"), (64, 128, 32, "highest"), (256, 256, 64, "tf32x3")]


@pytest.mark.parametrize("K,V,BT,precision", LOWER_CASES,
                         ids=[f"K{K}-V{V}-BT{BT}-{p}" for K, V, BT, p in LOWER_CASES])
def test_kernel_lowers_for_h200(K, V, BT, precision):
  Ta, HV, N = 8 * BT, 2, 3
  kd, vd = jnp.zeros((1, Ta, HV, K)), jnp.zeros((1, Ta, HV, V))
  acu = jnp.zeros((N + 1,), jnp.int32)
  fn = functools.partial(state.pallas.apply, chunk_size=BT, config=state.pallas.Config(precision=precision))
  txt = lower_h200(fn, kd, kd, vd, kd, kd, jnp.zeros((N, HV, K, V)), acu)
  assert "kda_state" in txt


@pytest.mark.parametrize("field,value", [("block_v", 32), ("block_k", 64), ("precision", "highest"),
                                         ("num_warps", 8), ("num_stages", 3), ("longest_first", False)])
def test_config_field_changes_the_program(field, value):
  """Each Config field changes the lowered program; block_v, block_k and longest_first run against
  the reference above (precision and the launch parameters leave the interpreted program as is)."""
  Ta, HV, N, K, V = 8 * 64, 2, 3, 128, 64
  kd, vd = jnp.zeros((1, Ta, HV, K)), jnp.zeros((1, Ta, HV, V))
  lower = lambda config: lower_h200(functools.partial(state.pallas.apply, chunk_size=64, config=config),
                                    kd, kd, vd, kd, kd, jnp.zeros((N, HV, K, V)), jnp.zeros((N + 1,), jnp.int32))
  assert lower(state.pallas.Config(**{field: value})) != lower(state.pallas.Config())
