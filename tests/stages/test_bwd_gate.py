"""bwd_gate (S5) against jax.vjp of the gate stage's reference (cotangent on gc), for every gate
activation; the raw gate's gradient is exactly 0 at padding tokens."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from kda.stages import bwd_gate, gate
from tests.stages import bwd_setup

# (records, gate keywords, inputs dropped); the raw-gate cases share one set of records
CASES = {
    "plain": (bwd_setup.PLAIN, dict(use_gate_in_kernel=False, lower_bound=None), ()),
    "softplus-Alog-dtbias": (bwd_setup.RAW, dict(use_gate_in_kernel=True, lower_bound=None), ()),
    "softplus-Alog": (bwd_setup.RAW, dict(use_gate_in_kernel=True, lower_bound=None), ("dt_bias",)),
    "sigmoid-lb5-Alog-dtbias": (bwd_setup.RAW, dict(use_gate_in_kernel=True, lower_bound=-5.0), ()),
    "sigmoid-lb1": (bwd_setup.RAW, dict(use_gate_in_kernel=True, lower_bound=-1.0), ("A_log", "dt_bias")),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bwd_gate_matches_vjp_of_gate(case):
  config, gate_kw, drop = CASES[case]
  s = bwd_setup.forward_records(**config)
  g, valid, A_log, dt_bias = s.rec["inputs"]["gate"]
  A_log = None if "A_log" in drop else A_log
  dt_bias = None if "dt_bias" in drop else dt_bias
  dgc, dg_state = bwd_setup.randn(60, g.shape, g.shape)
  fkw = dict(chunk_size=s.plan.chunk_size, **gate_kw)

  @jax.jit
  def run(g, A_log, dt_bias, dgc, dg_state):
    def fwd(g, A_log, dt_bias):   # (gc, activated gate): dg_state is a cotangent of the latter
      out = gate.reference.apply(g, valid, A_log, dt_bias, **fkw)
      return out.gc_int + out.gc_frac, out.g
    want = jax.vjp(fwd, g, A_log, dt_bias)[1]((dgc, dg_state))
    got = bwd_gate.reference.apply(g, valid, A_log, dt_bias, dgc, dg_state, **fkw)
    return got, want

  got, (dg, dA_log, ddt_bias) = run(g, A_log, dt_bias, dgc, dg_state)
  bwd_setup.close("dg", got.dg, dg)
  for name, want in (("dA_log", dA_log), ("ddt_bias", ddt_bias)):
    if want is None:
      assert getattr(got, name) is None, f"{name} should be None"
    else:
      bwd_setup.close(name, getattr(got, name), want)
  pad = ~np.asarray(valid[0])
  assert pad.any() and np.all(np.asarray(got.dg)[0, pad] == 0), "raw-gate gradient is not 0 at padding"
