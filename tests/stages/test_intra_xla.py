"""intra's xla implementation (the recursive halving with factorised decays, kda.stages.intra.xla)
against the reference, on the stage's inputs as the reference pipeline hands them over: float32 and
bf16 inputs, varlen with an empty and a 1-token sequence and partial chunks, extreme gates (-inf,
-1e30, -1e4, around the -128 floor) and chunk sizes 16, 32, 64."""
from __future__ import annotations

import numpy as np
import pytest

from kda.stages.intra import xla
from tests.stages import xla_setup


@pytest.mark.parametrize("case", list(xla_setup.CASES))
def test_matches_reference(case):
  got = xla_setup.check_stage("intra", case)
  want = xla_setup.records(case).outputs["intra"]
  # qg and kg are the reference's elementwise formulas
  for name in ("qg", "kg"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))


@pytest.mark.parametrize("BT", [16, 64])
def test_block_map_covers_each_lower_entry_once(BT):
  """Every lower-triangle entry of every (head, matrix) has its own slot, the upper ones the zero
  slot, and `blocks` reads back what `scores` would place (a permutation on the strict entries)."""
  H, X = 3, 2
  index, source, offsets = xla.block_map(BT, H, X)
  i, j = np.meshgrid(np.arange(BT), np.arange(BT), indexing="ij")
  lower = np.broadcast_to(j <= i, (H, X, BT, BT)).reshape(-1)
  zero = source.size
  assert np.all(index[~lower] == zero)
  assert sorted(index[lower]) == list(range(zero))
  np.testing.assert_array_equal(source[index[lower]], np.flatnonzero(lower))
  assert list(offsets) == list(xla.levels(BT)) and offsets[BT // 2] == 0
