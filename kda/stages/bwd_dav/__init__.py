"""bwd_dav (S1): the gradient of the intra-chunk half of the output, o += Aqk @ v_new.

Per chunk and value head, with do the output cotangent (aligned like the forward's inputs):

    dAqk = tril(do @ v_new^T)      j <= i only: Aqk is causal, its upper part is no variable
    dv   = Aqk^T @ do              the v_new cotangent through o; bwd_dh adds the state's part

In:  v_new [1, Ta, HV, V], Aqk [1, Ta, HV, BT] (row i of chunk c at token c*BT + i; both bf16 from
     the kernels, float32 from the references), do [1, Ta, HV, V] (o's dtype), aligned_cu [N+1]
     int32 (optional: an implementation may skip the chunks at or past aligned_cu[-1], whose
     outputs are 0).
Out: dAqk [1, Ta, HV, BT] float32 (same row layout as Aqk), dv [1, Ta, HV, V] float32.
Padding: do = 0 at padding tokens (aligned) and v_new = 0 there, so padding rows and columns of dAqk
are 0; Aqk's padding rows and columns are 0, so dv = 0 at padding tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "bwd_dav"


class Out(NamedTuple):
  dAqk: jax.Array  # [1, Ta, HV, BT] float32, lower with diagonal
  dv: jax.Array    # [1, Ta, HV, V] float32


from kda.stages.bwd_dav import mosaic_gpu, mosaic_tpu, reference  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
