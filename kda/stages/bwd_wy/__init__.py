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
adds dg_state to the reverse cumsum of dgc, so only that sum is S3's contract: a backend may hand
dgc's reverse cumsum on inside dg_state and return dgc = 0 (the terms kernel does, which saves the
backward's peak one [Ta, HV, K] float32 buffer).

Every exponent is gc (<= 0) or gc_last - gc (<= 0): nothing overflows however strong the gates.
Nothing here reads a state or its cotangent: every input and output is O(T) or O(NTa) times K, V or
BT. The Akk and Aqk paths (bwd_intra) and the cumsum / activation (bwd_gate) come later.

In:  q, k [1, Ta, HV, K], v [1, Ta, HV, V], beta [1, Ta, HV], gc_int, gc_frac [1, Ta, HV, K] f32,
     Ainv [1, Ta, HV, BT] f32, and S2's dqg, dkg, dw [1, Ta, HV, K] f32, du [1, Ta, HV, V] f32,
     dgc_last [1, NTa, HV, K] f32, aligned_cu [N+1] int32 (optional: an implementation may skip
     the chunks at or past aligned_cu[-1], whose outputs are 0).
Out: dq, dk, dgc, dg_state [1, Ta, HV, K], dv [1, Ta, HV, V], dbeta [1, Ta, HV], dAkk [P, Ta, HV, BT]
     (P = 1 unless a backend is asked for its parts, whose sum is the cotangent: bwd_intra takes either);
     float32, dv in `dv_dtype` where given (the pipeline passes v's: the final gradient, rounded once).
Padding: q = k = v = beta = 0 and du = 0 at padding tokens (do = 0 there), so dq, dk's WY part, dv,
dbeta are 0 there; dg_state is nonzero at padding rows (bwd_gate drops it there).
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "bwd_wy"


class Out(NamedTuple):
  dq: jax.Array     # [1, Ta, HV, K] float32
  dk: jax.Array     # [1, Ta, HV, K] float32
  dv: jax.Array     # [1, Ta, HV, V] float32
  dbeta: jax.Array  # [1, Ta, HV] float32
  dgc: jax.Array    # [1, Ta, HV, K] float32, cotangent of gc through qg and kb (reverse-cumsummed later)
  dg_state: jax.Array  # [1, Ta, HV, K] float32, gate gradient through kg and the decay (summed)
  dAkk: jax.Array   # [P, Ta, HV, BT] float32, the sum of its P parts (P = 1 but where asked); strictly
                    # lower (row i of chunk c at token c*BT + i)


from kda.stages.bwd_wy import mosaic_gpu, mosaic_tpu, reference  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
