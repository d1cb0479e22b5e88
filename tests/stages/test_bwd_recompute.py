"""bwd_recompute (S0): from the saved inputs and Ainv it rebuilds exactly what the forward stages
computed (gc, w, u, qg, kg, h, v_new), padding tokens included."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from kda.stages import bwd_recompute
from tests.stages import bwd_setup

CASES = {"BT32-softplus-gate": bwd_setup.RAW, "BT64-strong-gate": bwd_setup.STRONG}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bwd_recompute_matches_forward_stages(case):
  s = bwd_setup.forward_records(**CASES[case])
  r = s.rec
  gate_in, intra_out, state_out = r["inputs"]["gate"], r["intra"], r["state"]
  q, k, v, beta = r["inputs"]["intra"][:4]
  g, valid, A_log, dt_bias = gate_in
  h0, acu = r["inputs"]["state"][5:7]
  kw = s.plan.stage_kwargs("bwd_recompute")
  rc = jax.jit(lambda *a: bwd_recompute.reference.apply(*a, **kw))(
      q, k, v, g, beta, valid, A_log, dt_bias, intra_out.Ainv, h0, acu)
  want = dict(gc_int=r["gate"].gc_int, gc_frac=r["gate"].gc_frac, w=intra_out.w, u=intra_out.u, qg=intra_out.qg, kg=intra_out.kg,
              h=state_out.h, v_new=state_out.v_new)
  for name, x in want.items():
    bwd_setup.close(name, getattr(rc, name), x)
  pad = ~np.asarray(valid[0])
  for name in ("w", "u", "qg", "kg", "v_new"):
    assert np.all(np.asarray(getattr(rc, name))[0, pad] == 0), f"{name} is not 0 at padding tokens"
