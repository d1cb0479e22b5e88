"""bwd_dav: the jnp reference; the math is in kda.stages.bwd_dav."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda.stages.bwd_dav import Out
from kda.stages.intra import from_chunks, to_chunks

HI = lax.Precision.HIGHEST


def apply(v_new, Aqk, do, aligned_cu=None, *, chunk_size):
  """aligned_cu is not used: every chunk is computed (the tail's inputs are zeros, so its outputs are)."""
  del aligned_cu
  f32 = jnp.float32
  v_new, Aqk, do = (to_chunks(x.astype(f32), chunk_size) for x in (v_new, Aqk, do))
  causal = jnp.arange(chunk_size)[None, :, None, None] >= jnp.arange(chunk_size)[None, None, None, :]
  dAqk = jnp.where(causal, jnp.einsum("cihv,cjhv->cihj", do, v_new, precision=HI), 0.0)
  dv = jnp.einsum("cihj,cihv->cjhv", Aqk, do, precision=HI)
  return Out(from_chunks(dAqk), from_chunks(dv))
