"""output: o = scale * qg @ h[c] + Aqk @ v_new, per chunk and value head.

In:  qg [1, Ta, HV, K], h [1, NTa, HV, K, V], Aqk [1, Ta, HV, BT], v_new [1, Ta, HV, V].
Out: o [1, Ta, HV, V] float32.
Padding: qg = 0 and Aqk's row is 0 at a padding token, so o = 0 there.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.intra import from_chunks, to_chunks
from kda.stages.base import Stage

NAME = "output"
HI = lax.Precision.HIGHEST


class Out(NamedTuple):
  o: jax.Array  # [1, Ta, HV, V] float32


def reference(qg, h, Aqk, v_new, *, scale, chunk_size):
  f32 = jnp.float32
  qg, Aqk, v_new = (to_chunks(x.astype(f32), chunk_size) for x in (qg, Aqk, v_new))
  o = scale * jnp.einsum("cthk,chkv->cthv", qg, h[0].astype(f32), precision=HI)
  o = o + jnp.einsum("cthj,cjhv->cthv", Aqk, v_new, precision=HI)
  return Out(from_chunks(o))


STAGE = Stage(NAME, reference=reference)
