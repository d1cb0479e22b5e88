"""bwd_wy (S3): through the WY representation and the gates of the chunk's state-side inputs.

Per chunk and value head, the forward

    qg = q * exp(gc),  kg = k * exp(gc_last - gc),  kb = beta * k * exp(gc),  vb = beta * v
    w = Ainv @ kb,  u = Ainv @ vb,  Ainv = (I + Akk)^-1

feeds (qg, kg, w, u, gc_last) to the state recurrence and the inter-chunk output term, whose vjp is
S2's (dqg, dkg, dw, du, dgc_last). From those:

    dkb = Ainv^T @ dw,        dvb = Ainv^T @ du
    dAinv = dw @ kb^T + du @ vb^T,   dAkk = strict_tril(-Ainv^T @ dAinv @ Ainv^T)
    dq = dqg * exp(gc)
    dk = dkg * exp(gc_last - gc) + dkb * beta * exp(gc)
    dv = dvb * beta,   dbeta = sum_K(dkb * k * exp(gc)) + sum_V(dvb * v)
    dgc = dqg * qg + dkb * kb                                  the gates of rows t' >= t
    dg_state[t] = dgc_last + sum_{s < t} dkg_s * kg_s            the gates of the chunk's tail

kg_s = k_s exp(gc_last - gc_s) decays through the gates after s, and the state decay exp(gc_last)
through all of them, so their gate gradients are the sums above, formed directly: as a cotangent of
gc (+sum_s dkg * kg at the last row, -dkg * kg at row s) bwd_gate's reverse cumsum would subtract
nearly equal sums, losing float32 accuracy when strong gates make the true gradient small. bwd_gate
adds dg_state to the reverse cumsum of dgc.

Every exponent is gc (<= 0) or gc_last - gc (<= 0): nothing overflows however strong the gates.
Nothing here reads a state or its cotangent: every input and output is O(T) or O(NTa) times K, V or
BT. The Akk and Aqk paths (bwd_intra) and the cumsum / activation (bwd_gate) come later.

In:  q, k [1, Ta, HV, K], v [1, Ta, HV, V], beta [1, Ta, HV], gc_int, gc_frac [1, Ta, HV, K] f32,
     Ainv [1, Ta, HV, BT] f32, and S2's dqg, dkg, dw [1, Ta, HV, K] f32, du [1, Ta, HV, V] f32,
     dgc_last [1, NTa, HV, K] f32.
Out: dq, dk, dgc, dg_state [1, Ta, HV, K], dv [1, Ta, HV, V], dbeta [1, Ta, HV], dAkk [1, Ta, HV, BT];
     float32.
Padding: q = k = v = beta = 0 and du = 0 at padding tokens (do = 0 there), so dq, dk's WY part, dv,
dbeta are 0 there; dg_state is nonzero at padding rows (bwd_gate drops it there).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.base import Stage
from kda.stages.intra import chunk_decays, from_chunks, to_chunks

NAME = "bwd_wy"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  dq: jax.Array     # [1, Ta, HV, K] float32
  dk: jax.Array     # [1, Ta, HV, K] float32
  dv: jax.Array     # [1, Ta, HV, V] float32
  dbeta: jax.Array  # [1, Ta, HV] float32
  dgc: jax.Array    # [1, Ta, HV, K] float32, cotangent of gc through qg and kb (reverse-cumsummed later)
  dg_state: jax.Array  # [1, Ta, HV, K] float32, gate gradient through kg and the decay (summed)
  dAkk: jax.Array   # [1, Ta, HV, BT] float32, strictly lower (row i of chunk c at token c*BT + i)


def reference(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, *, chunk_size):
  f32 = jnp.float32
  BT = chunk_size
  q, k, v, beta, gi, gf, Ainv, dqg, dkg, dw, du = (
      to_chunks(x.astype(f32), BT) for x in (q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du))
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)
  b = beta[..., None]
  eg, el = chunk_decays(gi, gf)                                  # exp(gc), exp(gc_last - gc)
  qg, kg, kb, vb = q * eg, k * el, b * k * eg, b * v

  dkb = ein("cihj,cihk->cjhk", Ainv, dw)                         # Ainv^T @ dw
  dvb = ein("cihj,cihv->cjhv", Ainv, du)                         # Ainv^T @ du
  dAinv = ein("cihk,cjhk->cihj", dw, kb) + ein("cihv,cjhv->cihj", du, vb)
  M = ein("ciha,cihb->cahb", Ainv, ein("cihj,cbhj->cihb", dAinv, Ainv))   # Ainv^T dAinv Ainv^T
  strict = jnp.arange(BT)[None, :, None, None] > jnp.arange(BT)[None, None, None, :]
  dAkk = jnp.where(strict, -M, 0.0)

  dq = dqg * eg
  dk = dkg * el + dkb * b * eg
  dv = dvb * b
  dbeta = jnp.sum(dkb * k * eg, -1) + jnp.sum(dvb * v, -1)
  dgc = dqg * qg + dkb * kb
  x = dkg * kg
  before = jnp.cumsum(jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1), axis=1)   # s < t
  dg_state = before + dgc_last[0].astype(f32)[:, None]
  return Out(*(from_chunks(x) for x in (dq, dk, dv, dbeta, dgc, dg_state, dAkk)))


STAGE = Stage(NAME, reference=reference)
