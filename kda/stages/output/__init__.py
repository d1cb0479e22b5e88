"""output: o = scale * qg @ h[c] + Aqk @ v_new, per chunk and value head.

In:  qg [1, Ta, HV, K], h [1, NTa, HV, K, V], Aqk [1, Ta, HV, BT], v_new [1, Ta, HV, V].
Out: o [1, Ta, HV, V] float32 (the mosaic_gpu kernel may store it bf16: Config.out_dtype).
Padding: qg = 0 and Aqk's row is 0 at a padding token, so o = 0 there.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "output"


class Out(NamedTuple):
  o: jax.Array  # [1, Ta, HV, V] float32


from kda.stages.output import mosaic_gpu, mosaic_tpu, pallas, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, pallas=pallas, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
