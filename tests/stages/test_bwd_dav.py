"""bwd_dav (S1) against jax.vjp of the output stage's reference in (Aqk, v_new)."""
from __future__ import annotations

import jax
import numpy as np

from kda.stages import bwd_dav, output
from tests.stages import bwd_setup


def test_bwd_dav_matches_vjp_of_output():
  s = bwd_setup.forward_records(**bwd_setup.PLAIN)
  BT = s.plan.chunk_size
  qg, h, Aqk, v_new = s.rec["inputs"]["output"]
  (do,) = bwd_setup.randn(20, v_new.shape)     # random everywhere: the formula must hold row by row

  @jax.jit
  def both(Aqk, v_new, do):
    fwd = lambda A, vn: output.reference.apply(qg, h, A, vn, scale=s.plan.scale, chunk_size=BT).o
    _, vjp = jax.vjp(fwd, Aqk, v_new)
    return vjp(do), bwd_dav.reference.apply(v_new, Aqk, do, chunk_size=BT)

  (dAqk, dv), got = both(Aqk, v_new, do)
  bwd_setup.close("dAqk", got.dAqk, bwd_setup.mask_rows(dAqk, BT, strict=False))
  bwd_setup.close("dv", got.dv, dv)
  np.testing.assert_array_equal(got.dAqk, bwd_setup.mask_rows(got.dAqk, BT, strict=False),
                                err_msg="dAqk is not 0 above the diagonal")
