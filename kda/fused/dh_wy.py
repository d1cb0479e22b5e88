"""bwd_dh -> bwd_wy fused: the state-cotangent walk (S2) hands its per-chunk state cotangent to the
WY kernel (S3), which forms S2's terms itself (the math is in kda.stages.bwd_dh and
kda.stages.bwd_wy).

Unfused, bwd_dh's terms kernel reads h, dh, v_new, do, du per (head, chunk) and writes dqg, dkg,
dw ([Ta, HV, K] float32 each) and dgc_last, which the bwd_wy kernel reads back. Fused, the bwd_wy
kernel takes h, dh, v_new, bf16(scale * do) by TMA (bf16 tiles, all in flight together) and forms
dqg, dkg, dw with wgmmas and dgc_last as a product with a ones tile (decay * h * dh split hi + lo):
no terms kernel, three [Ta, HV, K] float32 arrays fewer in memory and none of their traffic. SMEM of
the bwd_wy kernel grows to 27 [64, 64] bf16 tiles at K = V = 128 (one CTA per SM instead of two).

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
  if aligned_cu.shape[0] == 1:       # no sequence: no walk to launch, every chunk is tail
    ds = dh_mgpu.apply(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, scale=scale,
                       chunk_size=chunk_size, interpret=interpret)
    return ds.dh0, wy_mgpu.apply(q, k, v, beta, gc_int, gc_frac, Ainv, ds.dqg, ds.dkg, ds.dw, ds.du,
                                 ds.dgc_last, chunk_size=chunk_size, interpret=interpret)
  wk = dh_mgpu.walk(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, scale=scale,
                    chunk_size=chunk_size, interpret=interpret)
  wy = wy_mgpu.with_state_terms(q, k, v, beta, gc_int, gc_frac, Ainv, wk.h, wk.dh, wk.v_new, wk.sdo,
                                wk.du, wk.decay, interpret=interpret)
  return wk.dh0, wy
