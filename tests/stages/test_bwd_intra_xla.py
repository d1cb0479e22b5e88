"""bwd_intra's xla implementation (the recursive halving of kda.stages.intra.xla, backward) against
the reference, on the stage's inputs as the reference pipeline's backward hands them over: float32
and bf16 inputs, varlen with an empty and a 1-token sequence, extreme gates, chunks of 16, 32, 64."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kda.stages import bwd_intra
from tests.stages import xla_setup


@pytest.mark.parametrize("case", list(xla_setup.CASES))
def test_matches_reference(case):
  xla_setup.check_stage("bwd_intra", case)


def test_grad_dtype():
  """grad_dtype rounds dq and dk once, at the end, as the reference does."""
  rec = xla_setup.records("bf16-BT32")
  kw = dict(xla_setup.stage_kwargs(rec.plan, "bwd_intra"), grad_dtype=jnp.bfloat16)
  args = rec.inputs["bwd_intra"]
  got, want = (jax.jit(lambda *a, f=f: f(*a, **kw))(*args) for f in (bwd_intra.xla.apply, bwd_intra.reference.apply))
  for name in ("dq", "dk"):
    a, b = getattr(got, name), getattr(want, name)
    assert a.dtype == b.dtype == jnp.bfloat16
    xla_setup.close(name, a, b, 2.0 ** -7)   # two float32 values within 2e-5 round to bf16 within 2^-8 each
