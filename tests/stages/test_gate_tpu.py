"""gate stage, Mosaic TPU kernel: against the reference in the TPU interpreter (pltpu.InterpretParams),
its refusals, and its Mosaic lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

from kda.stages import gate
from kda.stages.gate import mosaic_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages import tpu_setup as setup
from tests.stages.test_gate import check_padding, check_parts, extreme_gates, form_args, pooled_inputs

# Kernel vs reference. g: the reference's own float32 formula on the same values (the interpreter
# evaluates it with the same XLA ops): measured 0. gc_int: integers summed exactly either way.
# gc_frac: the kernel's tril dot (the interpreter computes it exactly) against the reference's
# sequential float32 cumsum of <= 64 terms in (-1, 0]: measured <= 5.7e-6 absolute on |gc_frac| <= 32.
TOL = {"g": dict(atol=1e-6, rtol=1e-6), "gc_int": dict(atol=1e-30, rtol=0), "gc_frac": dict(atol=2e-5, rtol=2e-5)}

CASES = [
    # id, lens, K, BT, dtype, form, extreme: an empty sequence, a 1-token one and partial chunks in each
    ("B-softplus-K128-BT32-bf16", list(setup.CASES["B"].lens), 128, 32, jnp.bfloat16, "softplus", False),
    ("sigmoid-noA-K128-BT16-f32", [17, 1, 0, 40], 128, 16, jnp.float32, "sigmoid-noA", False),
    # gates -inf, -1e30, -1e5, -1e4 ... (test_gate.EXTREMES) given in log space: floored at -128
    ("A-identity-extreme-K64-BT16-f32", list(setup.CASES["A"].lens), 64, 16, jnp.float32, "identity", True),
]


@pytest.mark.parametrize("lens,K,BT,dtype,form,extreme", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_reference(lens, K, BT, dtype, form, extreme):
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=lens, HV=2, K=K, BT=BT, dtype=dtype,
                                                       gate_kind="plain" if form == "identity" else "raw")
  if extreme:
    g = extreme_gates(g, 3, frac=0.1).astype(dtype)
  g = jnp.where(valid[:, :, None, None], g, jnp.nan)          # padding values must never be read
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  want = setup.jitted(gate.reference.apply, chunk_size=BT, **kw)(*args)
  got = setup.kernel(mosaic_tpu.apply, chunk_size=BT, **kw)(*args)
  for name in gate.Out._fields:
    chex.assert_shape(getattr(got, name), getattr(want, name).shape)
    assert getattr(got, name).dtype == jnp.float32
    cases.report_close(name, getattr(got, name), getattr(want, name), **TOL[name])
  check_padding(got, valid, BT)
  check_parts(got)
  if extreme:
    assert float(jnp.min(got.g)) == gate.GATE_FLOOR


def test_supports_refuses_in_words():
  g = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float32)
  valid = jax.ShapeDtypeStruct((1, 64), jnp.bool_)
  kw = dict(use_gate_in_kernel=False, lower_bound=None)
  assert mosaic_tpu.supports(g, valid, None, None, chunk_size=32, **kw) is None
  assert "multiple of 16" in mosaic_tpu.supports(g, valid, None, None, chunk_size=8, **kw)
  assert "float16" in mosaic_tpu.supports(jax.ShapeDtypeStruct(g.shape, jnp.float16), valid, None, None,
                                          chunk_size=32, **kw)
  assert "A_log" in mosaic_tpu.supports(g, valid, None, None, chunk_size=32, use_gate_in_kernel=True,
                                        lower_bound=None)
  with pytest.raises(ValueError, match="heads"):
    mosaic_tpu.Config(heads=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_lowers_for_tpu(dtype):
  Ta, HV, K = 256, 4, 128
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, chunk_size=64, use_gate_in_kernel=True, lower_bound=None)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta), jnp.bool_), s((HV,), jnp.float32),
                   s((HV * K,), jnp.float32)) == 1
