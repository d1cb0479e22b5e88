"""bwd_dh (S2) against jax.vjp of the state and output stages' references.

dh0 and the total v_new cotangent (the cotangent of u, since v_new = u - w @ S) come straight from the
vjp of state -> output. dh, the cotangent of the state leaving each chunk, is checked one chunk at a
time: with every chunk made its own sequence (initial state h[c], final-state cotangent dh[c]), the vjp
in the initial states must give what S2 sent on to the previous chunk (dh[c-1], or dh0 at a
sequence's first chunk). The lens include an empty sequence (dh0 = dht there) and chunks past the last
sequence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda import padding, pipeline
from kda.stages import bwd_dav, bwd_dh, output, state
from tests.stages import bwd_setup


def test_bwd_dh_matches_vjp_of_state_and_output():
  s = bwd_setup.forward_records(**bwd_setup.PLAIN)
  BT, scale = s.plan.chunk_size, s.plan.scale
  kg, w, u, gc, h0, acu = s.rec["inputs"]["state"]
  qg, h, Aqk, _ = s.rec["inputs"]["output"]
  NTa = kg.shape[1] // BT
  do, dht = bwd_setup.randn(30, u.shape, h0.shape)
  split_cu = jnp.arange(NTa + 1, dtype=jnp.int32) * BT         # every chunk its own sequence

  def state_output(u, S0, cu):
    st = state.reference(kg, w, u, gc, S0, cu, chunk_size=BT)
    return output.reference(qg, st.h, Aqk, st.v_new, scale=scale, chunk_size=BT).o, st.final_state

  @jax.jit
  def run(do, dht):
    dv1 = bwd_dav.reference(s.rec["state"].v_new, Aqk, do, chunk_size=BT).dv
    got = bwd_dh.reference(qg, kg, w, gc, do, dv1, dht, acu, **pipeline.backward_kwargs(s.plan, "bwd_dh"))
    du, dh0 = jax.vjp(lambda u, S0: state_output(u, S0, acu), u, h0)[1]((do, dht))
    h_split = h[0]                                            # [NTa, HV, K, V]: state entering each chunk
    (dS_in,) = jax.vjp(lambda S: state_output(u, S, split_cu), h_split)[1]((do, got.dh[0]))
    return got, du, dh0, dS_in

  got, du, dh0, dS_in = run(do, dht)
  bwd_setup.close("dv", got.dv, du)
  bwd_setup.close("dh0", got.dh0, dh0)

  table = padding.chunk_table(acu, NTa, BT)
  seq, first, last = (np.asarray(x) for x in (table.seq, table.first, table.last))
  dh, dS_in, dh0_got = np.asarray(got.dh[0]), np.asarray(dS_in), np.asarray(got.dh0)
  for c in range(NTa):
    if seq[c] < 0:
      assert np.all(dh[c] == 0), f"dh of tail chunk {c} is not 0"
      continue
    if last[c]:
      np.testing.assert_array_equal(dh[c], np.asarray(dht)[seq[c]], err_msg=f"chunk {c}: dh != dht")
    sent = dh0_got[seq[c]] if first[c] else dh[c - 1]
    bwd_setup.close(f"dS entering chunk {c}", sent, dS_in[c])
  empty = np.asarray(s.layout.lens) == 0
  assert empty.any()
  np.testing.assert_array_equal(dh0_got[empty], np.asarray(dht)[empty], err_msg="empty sequence: dh0 != dht")
