"""bwd_intra (S4) against jax.vjp of the intra stage's reference through its Akk and Aqk outputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kda.stages import bwd_intra, intra
from tests.stages import bwd_setup

CASES = {"BT32-K32": bwd_setup.PLAIN, "BT64-K16-strong-gate": bwd_setup.STRONG}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bwd_intra_matches_vjp_of_intra(case):
  s = bwd_setup.forward_records(**CASES[case])
  BT, scale = s.plan.chunk_size, s.plan.scale
  q, k, v, beta, gi, gc = s.rec["inputs"]["intra"][:6]
  Akk, Aqk = s.rec["intra"].Akk, s.rec["intra"].Aqk
  dAqk, dAkk, aq, ak, ag = bwd_setup.randn(50, Aqk.shape, Akk.shape, q.shape, k.shape, gc.shape)
  (ab,) = bwd_setup.randn(51, beta.shape)
  dAqk = bwd_setup.mask_rows(dAqk, BT, strict=False)            # what S1 and S3 hand over
  dAkk = bwd_setup.mask_rows(dAkk, BT, strict=True)

  @jax.jit
  def run(dAqk, dAkk, aq, ak, ab, ag):
    fwd = lambda q, k, beta, gc: intra.reference.apply(q, k, v, beta, gi, gc, scale=scale, chunk_size=BT)[:2]
    want = jax.vjp(fwd, q, k, beta, gc)[1]((dAkk, dAqk))
    got = bwd_intra.reference.apply(q, k, beta, gi, gc, dAqk, dAkk, aq, ak, ab, ag,
                                    **s.plan.stage_kwargs("bwd_intra"))
    return got, want

  zeros = [jnp.zeros_like(x) for x in (aq, ak, ab, ag)]
  got, want = run(dAqk, dAkk, *zeros)
  for name, x in zip(("dq", "dk", "dbeta", "dgc"), want):
    bwd_setup.close(name, getattr(got, name), x)
  # it adds its terms onto the accumulators it receives (S3's gradients)
  acc, _ = run(dAqk, dAkk, aq, ak, ab, ag)
  for name, a in zip(("dq", "dk", "dbeta", "dgc"), (aq, ak, ab, ag)):
    bwd_setup.close(f"{name} accumulated", getattr(acc, name), a + getattr(got, name), tol=1e-6)
