"""bwd_dh -> bwd_wy fused: the state-cotangent walk (S2) hands its per-V-tile partial sums straight
to the WY kernel (S3), which adds them as it loads them (the math is in kda.stages.bwd_dh and
kda.stages.bwd_wy).

Unfused, the bwd_dh kernel writes dqg, dkg, dw and dgc_last once per 64-column V tile
([V // 64, Ta, HV, K] float32 each) and its launcher sums the tiles in XLA, a pass that reads them
all and writes the sums, which bwd_wy then reads again. Fused, that pass and the summed arrays are
gone: at V = 128 three [Ta, HV, K] float32 arrays fewer in memory and about 9 such arrays less
traffic. The arithmetic is the two kernels' (kda.stages.bwd_dh.mosaic_gpu.partials, then
kda.stages.bwd_wy.mosaic_gpu.from_partials), the sums only in another float32 order.

`mosaic_gpu(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, q, k, v, beta, Ainv, *,
scale, chunk_size)` -> (dh0 [N, HV, K, V] float32, bwd_wy.Out): S2's arguments, then the ones S3
reads besides S2's outputs. `takes` is both kernels' predicates.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kda.stages.bwd_dh import mosaic_gpu as dh_mgpu
from kda.stages.bwd_wy import mosaic_gpu as wy_mgpu


def _wy_args(qg, gc_int, gc_frac, v_new, q, k, v, beta, Ainv, chunk_size):
  """S3's arguments as the unfused pipeline would hand them (S2's outputs as shapes only)."""
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  _, Ta, HV, K = qg.shape
  s2 = (f32(qg.shape), f32(qg.shape), f32(qg.shape), f32(v_new.shape), f32((1, Ta // chunk_size, HV, K)))
  return (q, k, v, beta, gc_int, gc_frac, Ainv) + s2


def takes(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, q, k, v, beta, Ainv, *,
          chunk_size, **_) -> Optional[str]:
  """The group's predicate: the bwd_dh kernel's and the bwd_wy kernel's."""
  return (dh_mgpu.takes(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, chunk_size=chunk_size)
          or wy_mgpu.takes(*_wy_args(qg, gc_int, gc_frac, v_new, q, k, v, beta, Ainv, chunk_size),
                           chunk_size=chunk_size))


def mosaic_gpu(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, q, k, v, beta, Ainv, *,
               scale, chunk_size, interpret=False):
  ds = dh_mgpu.partials(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, scale=scale,
                        chunk_size=chunk_size, interpret=interpret)
  wy = wy_mgpu.from_partials(q, k, v, beta, gc_int, gc_frac, Ainv, ds.dqg, ds.dkg, ds.dw, ds.du, ds.dgc_last,
                             chunk_size=chunk_size, interpret=interpret)
  return ds.dh0, wy
