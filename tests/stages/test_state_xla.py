"""state's xla implementation and the fused state -> output scan (kda.fused.state_output.xla) against
the references, on the stages' inputs as the reference pipeline hands them over (varlen with empty
and 1-token sequences, initial states, a tail of chunks no sequence owns)."""
from __future__ import annotations

import jax
import pytest

from kda.fused.state_output import xla as state_output_xla
from tests.stages import xla_setup


@pytest.mark.parametrize("case", list(xla_setup.CASES))
def test_matches_reference(case):
  xla_setup.check_stage("state", case)


@pytest.mark.parametrize("case", ["f32-BT64", "extreme-BT16"])
def test_fused_matches_composed_references(case):
  """o and the final state of the one scan equal the state reference feeding the output reference."""
  rec = xla_setup.records(case)
  kg, w, u, gc_int, gc_frac, h0, acu = rec.inputs["state"]
  qg, _, Aqk, _ = rec.inputs["output"]
  fn = jax.jit(lambda *a: state_output_xla.apply(*a, scale=rec.plan.scale, chunk_size=rec.plan.chunk_size))
  o, final = fn(kg, w, u, qg, Aqk, gc_int, gc_frac, h0, acu)
  tol = xla_setup.TOL[rec.dtype]
  xla_setup.close("o", o, rec.outputs["output"].o, tol)
  xla_setup.close("final_state", final, rec.outputs["state"].final_state, tol)
