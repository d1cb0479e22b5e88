"""state stage, Mosaic TPU kernel: against the reference in the TPU interpreter (pltpu.InterpretParams),
a NaN in one sequence not reaching the next, the interpreter's two-core order check, its refusals,
and its Mosaic lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kda.stages import state
from kda.stages.state import mosaic_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages.test_state import KERNEL_TOL, check_outputs, stage_inputs

# float32: test_state.KERNEL_TOL (both sides float32 with exact dots in the interpreter: summation
# order only; measured <= 4e-8 relative). bf16 kg, w, u (the reference runs on the same bf16 values
# in float32): the kernel's dots take bf16(S) and bf16(v_new) (2^-9 relative each, once per chunk)
# and it stores h and v_new in bf16 (2^-9 more). Measured max|d| / max|ref| over <= 3 chunks per
# sequence: h 2.0e-3, v_new 2.6e-3, final_state 3.3e-4 (values up to ~3); the bounds are ~4x that.
BF16_TOL = {"h": dict(atol=2e-2, rtol=1e-2), "v_new": dict(atol=2e-2, rtol=1e-2),
            "final_state": dict(atol=5e-3, rtol=5e-3)}

CASES = [
    # id, lens, K, V, BT, dtype: an empty sequence, a 1-token one, partial chunks, a tail after the last
    ("K64-V64-BT16-f32", [30, 0, 1, 50], 64, 64, 16, jnp.float32),
    ("K128-V64-BT32-bf16-trailing-empty", [17, 1, 40, 0], 128, 64, 32, jnp.bfloat16),
]


@functools.lru_cache(maxsize=None)
def _fns(BT, config=None, interpret=True):
  ref = jax.jit(functools.partial(state.reference.apply, chunk_size=BT))
  ker = jax.jit(functools.partial(mosaic_tpu.apply, chunk_size=BT, interpret=interpret, config=config))
  return ref, ker


def _inputs(lens, K, V, BT, dtype, seed=1):
  args = stage_inputs(seed, lens, HV=2, K=K, V=V, BT=BT)
  return tuple(x.astype(dtype) for x in args[:3]) + args[3:]


@pytest.mark.parametrize("lens,K,V,BT,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_reference(lens, K, V, BT, dtype):
  args = _inputs(lens, K, V, BT, dtype)
  ref, ker = _fns(BT)
  want, got = ref(*args), ker(*args)
  assert got.h.dtype == got.v_new.dtype == dtype and got.final_state.dtype == jnp.float32
  if dtype == jnp.float32:
    check_outputs(got, want, args[-1], BT, KERNEL_TOL)
  else:
    for name in state.Out._fields:
      cases.report_close(name, getattr(got, name), getattr(want, name), **BF16_TOL[name])
    check_outputs(got, got, args[-1], BT, KERNEL_TOL)   # the tail's zeros
  for n in (n for n, L in enumerate(lens) if L == 0):     # an empty sequence keeps its state
    np.testing.assert_array_equal(np.asarray(got.final_state[n]), np.asarray(args[5][n]))


def test_nan_in_one_sequence_stays_there():
  """A NaN initial state and NaN values in sequence 1: every output of sequences 0, 2, 3 is finite and
  as the reference's, which seeds each sequence with a select."""
  lens, K, V, BT = [30, 20, 1, 40], 64, 64, 16
  kg, w, u, gi, gf, h0, acu = _inputs(lens, K, V, BT, jnp.float32)
  h0 = h0.at[1, 0, 3, 5].set(jnp.nan)
  u = u.at[0, int(acu[1]) + 3, 1, 7].set(jnp.nan)
  args = (kg, w, u, gi, gf, h0, acu)
  ref, ker = _fns(BT)
  want, got = ref(*args), ker(*args)
  c0, c1 = int(acu[1]) // BT, int(acu[2]) // BT
  assert np.isnan(np.asarray(got.final_state[1])).any()
  others = lambda x, lo, hi: np.concatenate([np.asarray(x)[:, :lo], np.asarray(x)[:, hi:]], axis=1)
  for name, lo, hi in (("h", c0, c1), ("v_new", c0 * BT, c1 * BT)):
    g, w_ = others(getattr(got, name), lo, hi), others(getattr(want, name), lo, hi)
    assert np.isfinite(g).all(), f"{name}: a NaN left sequence 1"
    cases.report_close(name, g, w_, **KERNEL_TOL)
  keep = np.array([0, 2, 3])
  cases.report_close("final_state", got.final_state[keep], want.final_state[keep], **KERNEL_TOL)


def test_two_cores_any_head_order():
  """The interpreter on two cores splits the "parallel" head axis (one head per program) and checks
  that the carried chunk axis is visited in order: same results."""
  lens, K, V, BT = [30, 0, 50], 64, 64, 16
  args = _inputs(lens, K, V, BT, jnp.float32)
  ref, _ = _fns(BT)
  two = pltpu.InterpretParams(num_cores_or_threads=2)
  got = jax.jit(functools.partial(mosaic_tpu.apply, chunk_size=BT, interpret=two,
                                  config=mosaic_tpu.Config(heads=1)))(*args)
  check_outputs(got, ref(*args), args[-1], BT, KERNEL_TOL)


def test_no_sequence_and_refusals():
  kg = jnp.ones((1, 32, 2, 64), jnp.float32)
  none = mosaic_tpu.apply(kg, kg, kg, kg, kg, jnp.zeros((0, 2, 64, 64)), jnp.zeros((1,), jnp.int32),
                          chunk_size=16, interpret=True)
  assert not np.any(np.asarray(none.h)) and not np.any(np.asarray(none.v_new)) and none.final_state.shape[0] == 0
  s = jax.ShapeDtypeStruct
  h0, acu = s((2, 2, 64, 64), jnp.float32), s((3,), jnp.int32)
  assert mosaic_tpu.supports(kg, kg, kg, kg, kg, h0, acu, chunk_size=16) is None
  assert "initial_state must have shape" in mosaic_tpu.supports(kg, kg, kg, kg, kg, s((3, 2, 64, 64), jnp.float32),
                                                                acu, chunk_size=16)
  assert "multiple of chunk_size" in mosaic_tpu.supports(kg, kg, kg, kg, kg, h0, acu, chunk_size=64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_lowers_for_tpu(dtype):
  Ta, HV, K, V, BT, N = 256, 4, 128, 128, 64, 3
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, chunk_size=BT)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta, HV, K), dtype), s((1, Ta, HV, V), dtype),
                   s((1, Ta, HV, K), jnp.float32), s((1, Ta, HV, K), jnp.float32), s((N, HV, K, V), jnp.float32),
                   s((N + 1,), jnp.int32)) == 1
