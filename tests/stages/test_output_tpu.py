"""output stage, Mosaic TPU kernel: against the reference in the TPU interpreter (pltpu.InterpretParams),
its refusals, and its Mosaic lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import output
from kda.stages.output import mosaic_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages import tpu_setup as setup
from tests.stages.test_output import KERNEL_TOL

# float32: test_output.KERNEL_TOL (exact dots in the interpreter on both sides: summation order only,
# measured 0). bf16 qg, h, Aqk, v_new, the reference on the same bf16 values in float32: the
# kernel's dots take those bf16 operands as they are (bf16 products are exact in float32, on the
# MXU as in the interpreter) and accumulate in float32, so again summation order only (measured
# 7.3e-8 relative): the same bound.

@pytest.mark.parametrize("name", ["A", "B"])
def test_kernel_matches_reference(name):
  """tpu_setup's cases (inputs from the reference stages, in the case's dtype): float32 K = V = 64
  (lane padding) BT 16, bf16 K = V = 128 BT 32; an empty sequence, a 1-token one, partial chunks."""
  case = setup.CASES[name]
  args = setup.output_inputs(name)
  kw = dict(scale=case.scale, chunk_size=case.BT)
  want = setup.jitted(output.reference.apply, **kw)(*args)
  got = setup.kernel(mosaic_tpu.apply, **kw)(*args)
  assert got.o.dtype == jnp.float32
  cases.report_close("o", got.o, want.o, **KERNEL_TOL)
  valid = np.asarray(setup.forward(name).ins[5][0])
  assert not np.any(np.asarray(got.o[0])[~valid]), "o is not exactly 0 at padding tokens"


def test_supports_refuses_in_words():
  s = jax.ShapeDtypeStruct
  qg, h, A = s((1, 64, 2, 64), jnp.float32), s((1, 4, 2, 64, 32), jnp.float32), s((1, 64, 2, 16), jnp.float32)
  vn = s((1, 64, 2, 32), jnp.float32)
  assert mosaic_tpu.supports(qg, h, A, vn, chunk_size=16) is None
  assert "Aqk must have shape" in mosaic_tpu.supports(qg, h, s((1, 64, 2, 32), jnp.float32), vn, chunk_size=16)
  assert "h must have shape" in mosaic_tpu.supports(qg, s((1, 3, 2, 64, 32), jnp.float32), A, vn, chunk_size=16)
  with pytest.raises(ValueError, match="out_dtype"):
    mosaic_tpu.Config(out_dtype="float16")


@pytest.mark.parametrize("dtype,BT", [(jnp.float32, 32), (jnp.bfloat16, 64)], ids=["f32-BT32", "bf16-BT64"])
def test_kernel_lowers_for_tpu(dtype, BT):
  Ta, HV, K, V = 256, 4, 128, 128
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, scale=K ** -0.5, chunk_size=BT)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta // BT, HV, K, V), dtype), s((1, Ta, HV, BT), dtype),
                   s((1, Ta, HV, V), dtype)) == 1
