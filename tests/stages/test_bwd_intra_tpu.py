"""The Mosaic TPU bwd_intra kernel against the bwd_intra reference (TPU interpret mode on CPU), its
Mosaic lowering for TPU and its predicate. The stage's own terms are compared with zero
accumulators (with S3's gradients added they would be a fraction of the total); one case adds them.
bf16 cases pass grad_dtype=bf16 to both, as the pipeline does."""
from __future__ import annotations

import functools

import pytest

from kda.stages import bwd_intra
from kda.stages.bwd_intra import mosaic_tpu as M
from tests.stages import tpu_bwd_setup as S


@pytest.mark.parametrize("case", S.all_cases())
def test_kernel_matches_reference(case):
  c = S.case(**case)
  args, kw, want = S.stage_args("bwd_intra", c, zero_acc=True)
  if c.q.dtype == S.BF16:      # the reference's output rounding: (0 + terms) in grad_dtype
    kw = dict(kw, grad_dtype=S.BF16)
    want = want._replace(dq=want.dq.astype(S.BF16), dk=want.dk.astype(S.BF16))
  got = S.run(M, args, kw)
  assert got.dq.dtype == want.dq.dtype and got.dk.dtype == want.dk.dtype
  for f in bwd_intra.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.tol(c))


def test_adds_onto_the_accumulators():
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw, want = S.stage_args("bwd_intra", c)
  got = S.run(M, args, kw)
  for f in bwd_intra.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.large
def test_one_head_per_program():
  c = S.case(**S.LARGE_CASES["f32-K128"])
  args, kw, want = S.stage_args("bwd_intra", c, zero_acc=True)
  got = S.run(M, args, kw, config=M.Config(1))
  for f in bwd_intra.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("BT", [16, 32, 64])
def test_lowers_for_tpu(dtype, BT):
  args, kw = S.specs("bwd_intra", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512, BT=BT)
  assert S.lower_tpu(functools.partial(M.apply, **kw), *args) == 1


def test_supports():
  args, kw = S.specs("bwd_intra", S.F32, HV=4, Ta=512)
  assert M.supports(*args, **kw) is None
  assert "dbeta" in M.supports(*args[:9], args[3], *args[10:], **kw)
  assert "chunk_size" in M.supports(*args, **dict(kw, chunk_size=128))
  big, kwb = S.specs("bwd_intra", S.F32, HV=1, Ta=512, K=16384)
  assert "VMEM" in M.supports(*big, **kwb)
