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
from tests.stages import tpu_setup as setup
from tests.stages.test_state import KERNEL_TOL, check_outputs

# float32: test_state.KERNEL_TOL (both sides float32 with exact dots in the interpreter: summation
# order only; measured <= 4e-8 relative). bf16 kg, w, u (the reference runs on the same bf16 values
# in float32): the kernel's dots take bf16(S) and bf16(v_new) (2^-9 relative each, once per chunk)
# and it stores h and v_new in bf16 (2^-9 more). Measured max|d| / max|ref| over <= 3 chunks per
# sequence: h 2.0e-3, v_new 2.6e-3, final_state 3.3e-4 (values up to ~3); the bounds are ~4x that.
BF16_TOL = {"h": dict(atol=2e-2, rtol=1e-2), "v_new": dict(atol=2e-2, rtol=1e-2),
            "final_state": dict(atol=5e-3, rtol=5e-3)}


def _run(args, BT, **kw):
  want = setup.jitted(state.reference.apply, chunk_size=BT)(*args)
  got = setup.kernel(mosaic_tpu.apply, chunk_size=BT, **kw)(*args)
  return got, want


@pytest.mark.parametrize("name", ["A", "B"])
def test_kernel_matches_reference(name):
  """tpu_setup's cases (kg, w, u, gc from the reference gate and intra): float32 K = V = 64 (lane
  padding) BT 16, bf16 K = V = 128 BT 32; an empty sequence, a 1-token one, partial chunks, a tail."""
  case = setup.CASES[name]
  args = setup.state_inputs(name)
  got, want = _run(args, case.BT)
  assert got.h.dtype == got.v_new.dtype == case.dtype and got.final_state.dtype == jnp.float32
  if case.dtype == jnp.float32:
    check_outputs(got, want, args[-1], case.BT, KERNEL_TOL)
  else:
    for field in state.Out._fields:
      cases.report_close(field, getattr(got, field), getattr(want, field), **BF16_TOL[field])
    check_outputs(got, got, args[-1], case.BT, KERNEL_TOL)   # the tail's zeros
  for n in (n for n, L in enumerate(case.lens) if L == 0):     # an empty sequence keeps its state
    np.testing.assert_array_equal(np.asarray(got.final_state[n]), np.asarray(args[5][n]))


def test_nan_in_one_sequence_stays_there():
  """A NaN initial state and a NaN value in sequence 0 (case A): every output of sequences 1-3 is
  finite and as the reference's, which seeds each sequence with a select."""
  BT = setup.CASES["A"].BT
  kg, w, u, gi, gf, h0, acu = setup.state_inputs("A")
  h0 = h0.at[0, 0, 3, 5].set(jnp.nan)
  u = u.at[0, 3, 1, 7].set(jnp.nan)
  got, want = _run((kg, w, u, gi, gf, h0, acu), BT)
  end = int(acu[1])                                            # sequence 0's rows end here
  assert np.isnan(np.asarray(got.final_state[0])).any() and np.isnan(np.asarray(got.v_new[:, :end])).any()
  for field, lo in (("h", end // BT), ("v_new", end)):
    g, w_ = np.asarray(getattr(got, field))[:, lo:], np.asarray(getattr(want, field))[:, lo:]
    assert np.isfinite(g).all(), f"{field}: a NaN left sequence 0"
    cases.report_close(field, g, w_, **KERNEL_TOL)
  cases.report_close("final_state", got.final_state[1:], want.final_state[1:], **KERNEL_TOL)


def test_two_cores_any_head_order_and_a_tail():
  """The interpreter on two cores splits the "parallel" head axis (one head per program) and checks
  that the carried chunk axis is visited in order: same results. Case A with two chunks past
  aligned_cu[-1] (random kg, w; u = 0): h and v_new are 0 there, so the state is reset on the tail
  rather than carried on from the last sequence."""
  kg, w, u, gi, gf, h0, acu = setup.state_inputs("A")
  BT = setup.CASES["A"].BT
  tail = lambda x, fill: jnp.concatenate([x, fill(jax.random.PRNGKey(7), (1, 2 * BT) + x.shape[2:])], axis=1)
  rand, zeros = jax.random.normal, lambda key, shape: jnp.zeros(shape)
  args = (tail(kg, rand), tail(w, rand), tail(u, zeros), tail(gi, zeros), tail(gf, zeros), h0, acu)
  two = pltpu.InterpretParams(num_cores_or_threads=2)
  got = jax.jit(functools.partial(mosaic_tpu.apply, chunk_size=BT, interpret=two,
                                  config=mosaic_tpu.Config(heads=1)))(*args)
  check_outputs(got, setup.jitted(state.reference.apply, chunk_size=BT)(*args), args[-1], BT, KERNEL_TOL)


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


@pytest.mark.parametrize("dtype,BT", [(jnp.float32, 32), (jnp.bfloat16, 64)], ids=["f32-BT32", "bf16-BT64"])
def test_kernel_lowers_for_tpu(dtype, BT):
  Ta, HV, K, V, N = 256, 4, 128, 128, 3
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, chunk_size=BT)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta, HV, K), dtype), s((1, Ta, HV, V), dtype),
                   s((1, Ta, HV, K), jnp.float32), s((1, Ta, HV, K), jnp.float32), s((N, HV, K, V), jnp.float32),
                   s((N + 1,), jnp.int32)) == 1
