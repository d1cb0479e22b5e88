"""bwd_wy (S3) against jax.vjp of the forward references around the WY representation.

With every chunk made its own sequence entering with h[c], the forward piece

    Akk -> Ainv = (I + Akk)^-1 -> w, u, qg, kg -> state (v_new, S_next) -> output with Aqk = 0

is a function of (q, k, v, beta, gc, Akk) with h held fixed; its vjp with cotangents (do on o, dv on
v_new, dh on S_next), all random, is what S3 must return (dv_new = dv + kg @ dh is S3's input).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kda import pipeline
from kda.stages import bwd_recompute, bwd_wy, intra, output, state
from tests.stages import bwd_setup

CASES = {"BT32-K32-V16": bwd_setup.PLAIN, "BT64-K16-V32-strong-gate": bwd_setup.STRONG}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bwd_wy_matches_vjp_of_wy_state_output(case):
  s = bwd_setup.forward_records(**CASES[case])
  BT, scale = s.plan.chunk_size, s.plan.scale
  q, k, v, beta, gc = s.rec["inputs"]["intra"]
  Akk, h = s.rec["intra"].Akk, s.rec["state"].h
  NTa = q.shape[1] // BT
  split_cu = jnp.arange(NTa + 1, dtype=jnp.int32) * BT
  do, dv1, dh = bwd_setup.randn(40, v.shape, v.shape, h.shape)

  def piece(q, k, v, beta, gc, Akk):
    Ainv = bwd_setup.row_layout(intra.unit_lower_inverse(bwd_setup.chunk_mats(Akk, BT)))
    w, u, qg, kg = bwd_recompute.wy_from_inverse(q, k, v, beta, gc, Ainv, chunk_size=BT)
    st = state.reference(kg, w, u, gc, h[0], split_cu, chunk_size=BT)
    o = output.reference(qg, h, jnp.zeros_like(Akk), st.v_new, scale=scale, chunk_size=BT).o
    return (o, st.v_new, st.final_state), (Ainv, st.v_new, kg)

  @jax.jit
  def run(do, dv1, dh):
    (_, vjp, (Ainv, v_new, kg)) = jax.vjp(piece, q, k, v, beta, gc, Akk, has_aux=True)
    want = vjp((do, dv1, dh[0]))
    dv_new = dv1 + jnp.einsum("cthk,chkv->cthv", kg.reshape(NTa, BT, *kg.shape[2:]), dh[0],
                              precision="highest").reshape(dv1.shape)
    got = bwd_wy.reference(q, k, v, beta, gc, Ainv, h, dh, v_new, do, dv_new,
                           **pipeline.backward_kwargs(s.plan, "bwd_wy"))
    return got, want

  got, (dq, dk, dv, dbeta, dgc, dAkk) = run(do, dv1, dh)
  for name, want in dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dgc=dgc).items():
    bwd_setup.close(name, getattr(got, name), want)
  bwd_setup.close("dAkk", got.dAkk, bwd_setup.mask_rows(dAkk, BT, strict=True))
