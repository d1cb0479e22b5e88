"""output: the XLA implementation; the math is in kda.stages.output.

The reference's two products per chunk, taken one chunk at a time in a scan with the chunk's tiles
head-major ([HV, BT, D]): batched matmuls over the heads that stay in cache, and no whole-array
transposed copy of qg, Aqk, v_new (on a CPU every fresh MiB of temporaries costs page faults).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._xla import compiled
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.output import Out

HI = lax.Precision.HIGHEST


@compiled
def apply(qg, h, Aqk, v_new, *, scale, chunk_size):
  f32 = jnp.float32
  qg, Aqk, v_new = (to_chunks(x.astype(f32), chunk_size) for x in (qg, Aqk, v_new))
  hm = lambda x: jnp.swapaxes(x, 0, 1)                          # [BT, HV, D] -> [HV, BT, D]

  def step(_, x):
    qg_c, S, A_c, vn_c = x
    o = scale * jnp.einsum("htk,hkv->htv", hm(qg_c), S, precision=HI)
    o = o + jnp.einsum("htj,hjv->htv", hm(A_c), hm(vn_c), precision=HI)
    return None, hm(o)

  _, o = lax.scan(step, None, (qg, h[0].astype(f32), Aqk, v_new))
  return Out(from_chunks(o))
