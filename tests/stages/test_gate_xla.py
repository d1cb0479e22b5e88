"""gate's xla implementation (its two-level chunk cumsum) against the reference: on the stage's
inputs as the reference pipeline hands them over (tests.stages.xla_setup), and on raw gates through
each activation."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kda.stages import gate
from tests.stages import xla_setup
from tests.stages.test_gate import FORMS, check_padding, check_parts, form_args, pooled_inputs


@pytest.mark.parametrize("case", list(xla_setup.CASES))
def test_matches_reference(case):
  got = xla_setup.check_stage("gate", case)
  want = xla_setup.records(case).outputs["gate"]
  # gc_int sums integers (exact in any order); g is the same elementwise formula
  np.testing.assert_array_equal(np.asarray(got.gc_int), np.asarray(want.gc_int))
  np.testing.assert_array_equal(np.asarray(got.g), np.asarray(want.g))
  check_parts(got)


@pytest.mark.parametrize("form", ["softplus", "sigmoid"])
def test_raw_gates(form):
  """Activated in the stage (use_gate_in_kernel), varlen with an empty sequence, chunk 16: the
  padding tokens' g is exactly 0 and gc flat there, as in the reference."""
  BT = 16
  _, _, _, g, _, valid, A_log, dt_bias = pooled_inputs(lens=[20, 0, 7], HV=2, K=8, BT=BT, gate_kind="raw")
  args, kw = form_args(form, g, valid, A_log, dt_bias)
  got, want = (jax.jit(functools.partial(f, chunk_size=BT, **kw))(*args)
               for f in (gate.xla.apply, gate.reference.apply))
  np.testing.assert_array_equal(np.asarray(got.gc_int), np.asarray(want.gc_int))
  for name in ("g", "gc_frac"):
    xla_setup.close(name, getattr(got, name), getattr(want, name), xla_setup.TOL["float32"])
  check_padding(got, valid, BT)
  assert FORMS[form][0]
