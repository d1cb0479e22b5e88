"""The Mosaic TPU bwd_wy kernel against the bwd_wy reference (TPU interpret mode on CPU), its Mosaic
lowering for TPU and its predicate. bf16 cases pass dv_dtype=bf16 to both, as the pipeline does."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from kda.stages import bwd_wy
from kda.stages.bwd_wy import mosaic_tpu as M
from tests.stages import tpu_bwd_setup as S


@pytest.mark.parametrize("case", S.all_cases())
def test_kernel_matches_reference(case):
  c = S.case(**case)
  args, kw, want = S.stage_args("bwd_wy", c)
  if c.q.dtype == S.BF16:      # the reference's output rounding
    kw = dict(kw, dv_dtype=S.BF16)
    want = want._replace(dv=want.dv.astype(S.BF16))
  got = S.run(M, args, kw)
  assert got.dv.dtype == want.dv.dtype
  for f in bwd_wy.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.tol(c))


@pytest.mark.large
def test_one_head_per_program():
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw, want = S.stage_args("bwd_wy", c)
  got = S.run(M, args, kw, config=M.Config(1))
  for f in bwd_wy.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("BT", [16, 64])
def test_lowers_for_tpu(dtype, BT):
  args, kw = S.specs("bwd_wy", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512, BT=BT)
  assert S.lower_tpu(functools.partial(M.apply, **kw), *args) == 1


def test_supports():
  args, kw = S.specs("bwd_wy", S.F32, HV=4, Ta=512)
  assert M.supports(*args, **kw) is None
  assert "Ainv" in M.supports(*args[:6], S.jax.ShapeDtypeStruct((1, 512, 4, 32), S.F32), *args[7:], **kw)
  assert "float16" in M.supports(*args, **dict(kw, dv_dtype=jnp.float16))
  big, kwb = S.specs("bwd_wy", S.F32, HV=1, Ta=512, K=8192, V=8192)
  assert "VMEM" in M.supports(*big, **kwb)
