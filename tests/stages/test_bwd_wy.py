"""bwd_wy (S3) against jax.vjp of the forward references around the WY representation.

The forward piece

    Akk -> Ainv = (I + Akk)^-1 -> w, u, qg, kg (the intra stage's formulas), and gc_last

is a function of (q, k, v, beta, gc, Akk); it produces exactly what the state recurrence and the
inter-chunk output term read, so its vjp with random cotangents (dw, du, dqg, dkg on its outputs,
dgc_last on gc at each chunk's last row) is what S3 must return from S2's terms.
"""
from __future__ import annotations

import jax
import pytest

from kda.stages import bwd_recompute, bwd_wy, intra
from kda.stages.bwd_gate.reference import reverse_chunk_cumsum
from kda.stages.intra import to_chunks
from tests.stages import bwd_setup

CASES = {"BT32-K32-V16": bwd_setup.PLAIN, "BT64-K16-V32-strong-gate": bwd_setup.STRONG}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bwd_wy_matches_vjp_of_wy(case):
  s = bwd_setup.forward_records(**CASES[case])
  BT = s.plan.chunk_size
  q, k, v, beta, gi, gc = s.rec["inputs"]["intra"][:6]
  Akk = s.rec["intra"].Akk
  NTa = q.shape[1] // BT
  dqg, dkg, dw, du, dgc_last = bwd_setup.randn(40, q.shape, k.shape, k.shape, v.shape,
                                               (1, NTa) + gc.shape[2:])

  def piece(q, k, v, beta, gc, Akk):
    Ainv = bwd_setup.row_layout(intra.reference.unit_lower_inverse(bwd_setup.chunk_mats(Akk, BT)))
    w, u, qg, kg = bwd_recompute.reference.wy_from_inverse(q, k, v, beta, gi, gc, Ainv, chunk_size=BT)
    return (w, u, qg, kg, to_chunks(gi + gc, BT)[None, :, -1]), Ainv

  @jax.jit
  def run(dqg, dkg, dw, du, dgc_last):
    _, vjp, Ainv = jax.vjp(piece, q, k, v, beta, gc, Akk, has_aux=True)
    want = vjp((dw, du, dqg, dkg, dgc_last))
    got = bwd_wy.reference.apply(q, k, v, beta, gi, gc, Ainv, dqg, dkg, dw, du, dgc_last,
                                 **s.plan.stage_kwargs("bwd_wy"))
    return got, want

  got, (dq, dk, dv, dbeta, dgc, dAkk) = run(dqg, dkg, dw, du, dgc_last)
  for name, want in dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta).items():
    bwd_setup.close(name, getattr(got, name), want)
  # gc's cotangent, as the gate gradient bwd_gate makes of it: the reverse cumsum plus dg_state
  dg = reverse_chunk_cumsum(got.dgc, BT) + got.dg_state
  bwd_setup.close("dg (reverse cumsum of dgc + dg_state)", dg, reverse_chunk_cumsum(dgc, BT))
  bwd_setup.close("dAkk", got.dAkk, bwd_setup.mask_rows(dAkk, BT, strict=True))
