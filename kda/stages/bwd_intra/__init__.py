"""bwd_intra (S4): through the intra-chunk matrices Akk and Aqk, accumulated onto S3's gradients.

Per chunk and value head, with E[i, j, c] = exp(gc_i[c] - gc_j[c]) on the causal pairs (masked before
exp, so <= 1; E[i, i] = 1, so only the strict pairs are formed) and the forward

    Aqk[i, j] = scale * sum_c q_i[c] k_j[c] E[i, j, c]            j <= i
    Akk[i, j] = beta_i * sum_c k_i[c] k_j[c] E[i, j, c]           j < i

the cotangents dAqk (S1) and dAkk (S3) give, with G_i = sum_{j<i} dAkk[i, j] k_j E[i, j]:

    dq_i  += scale * sum_{j<=i} dAqk[i, j] k_j E[i, j]                          (=: dqA_i)
    dk_j  += scale * sum_{i>=j} dAqk[i, j] q_i E[i, j]                          (=: dkA_j)
           + beta_i G_i  (at row i)  +  sum_{i>j} beta_i dAkk[i, j] k_i E[i, j]  (=: dkK1_i, dkK2_j)
    dbeta_i += sum_c k_i[c] G_i[c]
    dgc   += q * dqA' - k * dkA' + k * dkK1 - k * dkK2       (' : the sums over j < i only)

(d/dgc_i of E[i, j] is +E, d/dgc_j is -E: so each pair sends its term to row i and minus it to j.
The diagonal E[i, i] = 1 has no gate derivative: its two terms would cancel only up to rounding, and
bwd_gate's reverse cumsum would carry that rounding of the largest terms to every earlier token, so
the gate terms take the strict pairs alone.)
Nothing is divided by beta (0 at padding) and no exp(-gc) is formed alone.

In:  q, k [1, Ta, HV, K], beta [1, Ta, HV], gc_int, gc_frac [1, Ta, HV, K] f32 (gate.Out),
     dAqk [1, Ta, HV, BT] f32, dAkk [P, Ta, HV, BT] f32 (the cotangent is the sum of its P >= 1
     parts: S3's split kernel gives one per slab, and the Mosaic GPU kernel adds them as it loads
     them), S3's dq, dk, dgc [1, Ta, HV, K], dbeta [1, Ta, HV] (the accumulators), aligned_cu [N+1]
     int32 (optional: an implementation may skip the chunks at or past aligned_cu[-1], where this
     stage adds nothing).
Out: dq, dk, dgc [1, Ta, HV, K], dbeta [1, Ta, HV]: the accumulators plus this stage's terms; float32,
     dq and dk in `grad_dtype` where given (the pipeline passes q's: the final gradients, rounded once).
Padding: q = k = beta = 0 at padding tokens, so every term that carries a padding token's q or k is 0;
what lands on padding rows (dk, dbeta) is dropped by the padding layer.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda.stages.base import Stage

NAME = "bwd_intra"


class Out(NamedTuple):
  dq: jax.Array     # [1, Ta, HV, K] float32 (or grad_dtype)
  dk: jax.Array     # [1, Ta, HV, K] float32 (or grad_dtype)
  dbeta: jax.Array  # [1, Ta, HV] float32
  dgc: jax.Array    # [1, Ta, HV, K] float32


def summed(dAkk):
  """dAkk's parts summed: [1, Ta, HV, BT] float32."""
  return jnp.sum(dAkk.astype(jnp.float32), 0, keepdims=True)


from kda.stages.bwd_intra import mosaic_gpu, mosaic_tpu, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
