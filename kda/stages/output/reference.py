"""output: the jnp reference; the math is in kda.stages.output."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda.stages.intra import from_chunks, to_chunks
from kda.stages.output import Out

HI = lax.Precision.HIGHEST


def apply(qg, h, Aqk, v_new, *, scale, chunk_size):
  f32 = jnp.float32
  qg, Aqk, v_new = (to_chunks(x.astype(f32), chunk_size) for x in (qg, Aqk, v_new))
  o = scale * jnp.einsum("cthk,chkv->cthv", qg, h[0].astype(f32), precision=HI)
  o = o + jnp.einsum("cthj,cjhv->cthv", Aqk, v_new, precision=HI)
  return Out(from_chunks(o))
