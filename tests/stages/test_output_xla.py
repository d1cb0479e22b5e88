"""output's xla implementation against the reference, on the stage's inputs as the reference
pipeline hands them over."""
from __future__ import annotations

import pytest

from tests.stages import xla_setup


@pytest.mark.parametrize("case", ["f32-BT64", "bf16-BT32"])
def test_matches_reference(case):
  xla_setup.check_stage("output", case)
