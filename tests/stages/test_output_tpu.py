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
from tests.stages.test_output import KERNEL_TOL, stage_inputs

# float32: test_output.KERNEL_TOL (exact dots in the interpreter on both sides: summation order only,
# measured 0). bf16 qg, h, Aqk, v_new, the reference on the same bf16 values in float32: the
# kernel's dots take those bf16 operands as they are (bf16 products are exact in float32, on the
# MXU as in the interpreter) and accumulate in float32, so again summation order only (measured
# 7.3e-8 relative): the same bound.

CASES = [
    # id, lens, K, V, BT, dtype: an empty sequence, a 1-token one, partial chunks, a tail
    ("K64-V64-BT16-f32", [30, 0, 1, 50], 64, 64, 16, jnp.float32),
    ("K128-V64-BT32-bf16", [17, 1, 0, 40], 128, 64, 32, jnp.bfloat16),
]


@pytest.mark.parametrize("lens,K,V,BT,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_reference(lens, K, V, BT, dtype):
  qg, h, Aqk, v_new, valid = stage_inputs(1, lens, HV=2, K=K, V=V, BT=BT)
  args = tuple(x.astype(dtype) for x in (qg, h, Aqk, v_new))
  kw = dict(scale=K ** -0.5, chunk_size=BT)
  want = jax.jit(functools.partial(output.reference.apply, **kw))(*args)
  got = jax.jit(functools.partial(mosaic_tpu.apply, interpret=True, **kw))(*args)
  assert got.o.dtype == jnp.float32
  cases.report_close("o", got.o, want.o, **KERNEL_TOL)
  assert not np.any(np.asarray(got.o[0])[~valid]), "o is not exactly 0 at padding tokens"


def test_supports_refuses_in_words():
  s = jax.ShapeDtypeStruct
  qg, h, A = s((1, 64, 2, 64), jnp.float32), s((1, 4, 2, 64, 32), jnp.float32), s((1, 64, 2, 16), jnp.float32)
  vn = s((1, 64, 2, 32), jnp.float32)
  assert mosaic_tpu.supports(qg, h, A, vn, chunk_size=16) is None
  assert "Aqk must have shape" in mosaic_tpu.supports(qg, h, A, vn, chunk_size=32)
  assert "h must have shape" in mosaic_tpu.supports(qg, s((1, 3, 2, 64, 32), jnp.float32), A, vn, chunk_size=16)
  with pytest.raises(ValueError, match="out_dtype"):
    mosaic_tpu.Config(out_dtype="float16")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_lowers_for_tpu(dtype):
  Ta, HV, K, V, BT = 256, 4, 128, 128, 64
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, scale=K ** -0.5, chunk_size=BT)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta // BT, HV, K, V), dtype), s((1, Ta, HV, BT), dtype),
                   s((1, Ta, HV, V), dtype)) == 1
