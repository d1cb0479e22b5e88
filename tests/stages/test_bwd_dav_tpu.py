"""The Mosaic TPU bwd_dav kernel against the bwd_dav reference (TPU interpret mode on CPU), its
Mosaic lowering for TPU and its predicate. Inputs: tpu_bwd_setup.case (varlen with a 1-token
sequence, a partial chunk, an empty sequence and a tail chunk)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from kda.stages import bwd_dav
from kda.stages.bwd_dav import mosaic_tpu as M
from tests.stages import tpu_bwd_setup as S


@pytest.mark.parametrize("case", S.all_cases())
def test_kernel_matches_reference(case):
  c = S.case(**case)
  args, kw, want = S.stage_args("bwd_dav", c)
  got = S.run(M, args, kw)
  for f in bwd_dav.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.tol(c))


@pytest.mark.large
def test_one_head_per_program_and_two_interpreter_cores():
  c = S.case()
  args, kw, want = S.stage_args("bwd_dav", c)
  got = S.run(M, args, kw, interpret=S.pltpu.InterpretParams(num_cores_or_threads=2), config=M.Config(1))
  for f in bwd_dav.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("BT", [16, 64])
def test_lowers_for_tpu(dtype, BT):
  args, kw = S.specs("bwd_dav", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512, BT=BT)
  assert S.lower_tpu(functools.partial(M.apply, **kw), *args) == 1


def test_supports():
  args, kw = S.specs("bwd_dav", S.F32, HV=4, Ta=512)
  assert M.supports(*args, **kw) is None
  v16 = S.jax.ShapeDtypeStruct(args[0].shape, jnp.float16)
  assert "float16" in M.supports(v16, *args[1:], **kw)
  assert "chunk_size" in M.supports(*args, chunk_size=48)
  assert "divide" in M.supports(*args, **kw, config=M.Config(3))
  big = S.specs("bwd_dav", S.F32, HV=1, Ta=512, V=1 << 16)[0]
  assert "VMEM" in M.supports(*big, **kw)
