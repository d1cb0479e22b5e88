"""bwd_wy (S3): through everything of a chunk that touches the state, and the WY representation.

Per chunk and value head, with S = h[c] (entering), dS = dh[c] (cotangent of the state leaving),
dv_new (S2's total) and the forward

    qg = q * exp(gc),  kg = k * exp(gc_last - gc),  kb = beta * k * exp(gc),  vb = beta * v
    w = Ainv @ kb,  u = Ainv @ vb,  Ainv = (I + Akk)^-1
    o += scale * qg @ S,  v_new = u - w @ S,  S_next = exp(gc_last)[:, None] * S + kg^T @ v_new

the cotangents are

    dqg = scale * do @ S^T,   dkg = v_new @ dS^T,   dw = -dv_new @ S^T,   du = dv_new
    dkb = Ainv^T @ dw,        dvb = Ainv^T @ du
    dAinv = dw @ kb^T + du @ vb^T,   dAkk = strict_tril(-Ainv^T @ dAinv @ Ainv^T)
    dq = dqg * exp(gc)
    dk = dkg * exp(gc_last - gc) + dkb * beta * exp(gc)
    dv = dvb * beta,   dbeta = sum_K(dkb * k * exp(gc)) + sum_V(dvb * v)
    dgc = dqg * qg - dkg * kg + dkb * kb,  plus at the chunk's last row
          dgc_last = exp(gc_last) * sum_V(S * dS) + sum_t(dkg * kg)

Every exponent is gc (<= 0) or gc_last - gc (<= 0): nothing overflows however strong the gates.
The Akk and Aqk paths (bwd_intra) and the cumsum / activation (bwd_gate) come later.

In:  q, k [1, Ta, HV, K], v [1, Ta, HV, V], beta [1, Ta, HV], gc [1, Ta, HV, K] f32,
     Ainv [1, Ta, HV, BT] f32, h, dh [1, NTa, HV, K, V] f32, v_new [1, Ta, HV, V] f32, do [1, Ta, HV, V],
     dv [1, Ta, HV, V] f32 (S2's dv_new).
Out: dq, dk, dgc [1, Ta, HV, K], dv [1, Ta, HV, V], dbeta [1, Ta, HV], dAkk [1, Ta, HV, BT]; float32.
Padding: q = k = v = beta = 0, do = dv_new = 0 at padding tokens, so dq, dk's WY part, dv, dbeta are
0 there; dgc at a chunk's last row carries dgc_last even when that row is padding (gc_last is read
there), which the reverse cumsum of bwd_gate hands to the chunk's real tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.base import Stage
from kda.stages.intra import from_chunks, to_chunks

NAME = "bwd_wy"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  dq: jax.Array     # [1, Ta, HV, K] float32
  dk: jax.Array     # [1, Ta, HV, K] float32
  dv: jax.Array     # [1, Ta, HV, V] float32
  dbeta: jax.Array  # [1, Ta, HV] float32
  dgc: jax.Array    # [1, Ta, HV, K] float32, cotangent of the chunk-local cumsum gc
  dAkk: jax.Array   # [1, Ta, HV, BT] float32, strictly lower (row i of chunk c at token c*BT + i)


def reference(q, k, v, beta, gc, Ainv, h, dh, v_new, do, dv, *, scale, chunk_size):
  f32 = jnp.float32
  BT = chunk_size
  q, k, v, beta, gc, Ainv, v_new, do, dv = (
      to_chunks(x.astype(f32), BT) for x in (q, k, v, beta, gc, Ainv, v_new, do, dv))
  S, dS = h[0].astype(f32), dh[0].astype(f32)                   # [NTa, HV, K, V]
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)
  b = beta[..., None]
  eg = jnp.exp(gc)
  g_last = gc[:, -1:]                                            # [NTa, 1, HV, K]
  qg, kg, kb, vb = q * eg, k * jnp.exp(g_last - gc), b * k * eg, b * v

  dqg = scale * ein("cthv,chkv->cthk", do, S)
  dkg = ein("cthv,chkv->cthk", v_new, dS)
  dw = -ein("cthv,chkv->cthk", dv, S)
  dkb = ein("cihj,cihk->cjhk", Ainv, dw)                         # Ainv^T @ dw
  dvb = ein("cihj,cihv->cjhv", Ainv, dv)                         # Ainv^T @ du
  dAinv = ein("cihk,cjhk->cihj", dw, kb) + ein("cihv,cjhv->cihj", dv, vb)
  M = ein("ciha,cihb->cahb", Ainv, ein("cihj,cbhj->cihb", dAinv, Ainv))   # Ainv^T dAinv Ainv^T
  strict = jnp.arange(BT)[None, :, None, None] > jnp.arange(BT)[None, None, None, :]
  dAkk = jnp.where(strict, -M, 0.0)

  dq = dqg * eg
  dk = dkg * jnp.exp(g_last - gc) + dkb * b * eg
  dv_out = dvb * b
  dbeta = jnp.sum(dkb * k * eg, -1) + jnp.sum(dvb * v, -1)
  dgc = dqg * qg - dkg * kg + dkb * kb
  dgc_last = jnp.exp(g_last[:, 0]) * jnp.sum(S * dS, -1) + jnp.sum(dkg * kg, 1)   # [NTa, HV, K]
  dgc = dgc.at[:, -1].add(dgc_last)
  return Out(*(from_chunks(x) for x in (dq, dk, dv_out, dbeta, dgc, dAkk)))


STAGE = Stage(NAME, reference=reference)
