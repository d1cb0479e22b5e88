"""bwd_recompute's xla implementation (through the gate and state xla paths) against the reference,
on the stage's inputs as the reference pipeline's backward hands them over."""
from __future__ import annotations

import pytest

from tests.stages import xla_setup


@pytest.mark.parametrize("case", list(xla_setup.CASES))
def test_matches_reference(case):
  xla_setup.check_stage("bwd_recompute", case)
