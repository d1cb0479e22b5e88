"""bwd_dh (S2) against jax.vjp of the state and output stages' references.

S2 is the vjp of state -> output in (qg, kg, w, u, gc, initial_state) with Aqk held fixed (gc's
cotangent is that of its fractional part, gc_int + gc_frac being all the stages read), S1's
Aqk^T @ do being its dv input: du, dqg, dkg, dw and dh0 are that vjp's, and the vjp in gc is 0 but
at each chunk's last row (the state stage reads gc only through the decay exp(gc_last)), where it
is dgc_last. Every chunk's state cotangent shows in dkg = v_new @ dS_next^T and dgc_last. The lens
include an empty sequence (dh0 = dht there) and chunks past the last sequence.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kda.stages import bwd_dav, bwd_dh, output, state
from kda.stages.intra import from_chunks, to_chunks
from tests.stages import bwd_setup


def test_bwd_dh_matches_vjp_of_state_and_output():
  s = bwd_setup.forward_records(**bwd_setup.PLAIN)
  BT, scale = s.plan.chunk_size, s.plan.scale
  kg, w, u, gi, gc, h0, acu = s.rec["inputs"]["state"]
  qg, h, Aqk, v_new = s.rec["inputs"]["output"]
  do, dht = bwd_setup.randn(30, u.shape, h0.shape)   # random everywhere, padding and tail included

  def state_output(qg, kg, w, u, gc, S0):
    st = state.reference.apply(kg, w, u, gi, gc, S0, acu, chunk_size=BT)
    return output.reference.apply(qg, st.h, Aqk, st.v_new, scale=scale, chunk_size=BT).o, st.final_state

  @jax.jit
  def run(do, dht):
    dv1 = bwd_dav.reference.apply(v_new, Aqk, do, chunk_size=BT).dv
    got = bwd_dh.reference.apply(qg, kg, w, gi, gc, h, v_new, do, dv1, dht, acu,
                                 **s.plan.stage_kwargs("bwd_dh"))
    want = jax.vjp(state_output, qg, kg, w, u, gc, h0)[1]((do, dht))
    return got, want

  got, (dqg, dkg, dw, du, dgc, dh0) = run(do, dht)
  chex.assert_shape((got.du, got.dqg, got.dkg, got.dw, got.dh0, got.dgc_last),
                    (u.shape, qg.shape, kg.shape, w.shape, h0.shape, (1, h.shape[1]) + gc.shape[2:]))
  for name, want in dict(du=du, dqg=dqg, dkg=dkg, dw=dw, dh0=dh0).items():
    bwd_setup.close(name, getattr(got, name), want)
  dgc_got = from_chunks(to_chunks(jnp.zeros_like(gc), BT).at[:, -1].set(got.dgc_last[0]))
  bwd_setup.close("dgc (dgc_last at each chunk's last row, 0 elsewhere)", dgc_got, dgc)
  assert float(jnp.max(jnp.abs(got.dgc_last))) > 0 and float(jnp.max(jnp.abs(got.dkg))) > 0

  empty = np.asarray(s.layout.lens) == 0
  assert empty.any()
  np.testing.assert_array_equal(np.asarray(got.dh0)[empty], np.asarray(dht)[empty],
                                err_msg="empty sequence: dh0 != dht")
