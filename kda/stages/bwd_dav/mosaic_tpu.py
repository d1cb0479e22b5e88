"""bwd_dav (S1): the Mosaic TPU kernel; the math is in kda.stages.bwd_dav.

Per chunk and value head: dAqk = tril(do @ v_new^T) [BT, BT], dv = Aqk^T @ do [BT, V]; every chunk
is independent. Grid (HV / MB, NTa), both axes "parallel"; one program takes MB heads of one chunk
as head-first blocks v_new, do (MB, BT, V), Aqk (MB, BT, BT) and writes dAqk (MB, BT, BT), dv
(MB, BT, V) float32, looping over its heads (one head's values live at a time). Chunks past
aligned_cu[-1] hold zeros (the padding layer's), so they give zeros and need no skipping.

Precision: bf16 inputs (any of the three) -> bf16 MXU operands, float32 accumulation; float32 inputs
-> HIGHEST. VMEM: MB x (v_new, do, Aqk, dAqk, dv) double-buffered, MB from `default_config` (the most
heads, <= 16, within 0.9 x VMEM): at K = V = 128, BT = 64, MB = 16 needs 3.6 MiB (bf16) / 5.1 MiB.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_dav import Out


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1   # MB: value heads per program (a divisor of HV)


def _low(*xs):
  return any(jnp.dtype(x.dtype) == jnp.dtype(T.BF16) for x in xs)


def vmem_need(MB, V, BT, v_dtype, a_dtype, do_dtype) -> int:
  blocks = (T.block_bytes((MB, BT, V), v_dtype) + T.block_bytes((MB, BT, BT), a_dtype)
            + T.block_bytes((MB, BT, V), do_dtype) + T.block_bytes((MB, BT, BT), T.F32)
            + T.block_bytes((MB, BT, V), T.F32))
  work = 4 * T.block_bytes((BT, max(V, BT)), T.F32)   # one head's products and operand casts
  return 2 * blocks + work


def default_config(HV, V, BT, v_dtype=T.F32, a_dtype=T.F32, do_dtype=T.F32) -> Config:
  """The most heads per program (<= 16) that fit the generation's VMEM budget."""
  per = vmem_need(1, V, BT, v_dtype, a_dtype, do_dtype)
  mb = T.heads_per_program(HV, per)
  return Config(max(mb, 1))


def supports(v_new, Aqk, do, aligned_cu=None, *, chunk_size, config=None, **_) -> Optional[str]:
  if v_new.ndim != 4 or v_new.shape[0] != 1:
    return f"v_new must be [1, Ta, HV, V], got {v_new.shape}"
  _, Ta, HV, V = v_new.shape
  if (r := T.chunk_reason(Ta, chunk_size)) is not None:
    return r
  if Aqk.shape != (1, Ta, HV, chunk_size) or do.shape != v_new.shape:
    return f"Aqk must be {(1, Ta, HV, chunk_size)} and do {v_new.shape}, got {Aqk.shape}, {do.shape}"
  if (r := T.dtype_reason((("v_new", v_new), ("Aqk", Aqk), ("do", do)))) is not None:
    return r
  cfg = config or default_config(HV, V, chunk_size, v_new.dtype, Aqk.dtype, do.dtype)
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  need = vmem_need(cfg.heads_per_program, V, chunk_size, v_new.dtype, Aqk.dtype, do.dtype)
  return T.budget_reason("bwd_dav", need)


def _kernel(v_ref, a_ref, do_ref, dA_ref, dv_ref, *, MB, BT, low):
  causal = T.tri(BT, lambda r, c: r >= c) > 0

  def head(m):
    do = do_ref[m]
    dA_ref[m] = jnp.where(causal, T.mm(do, v_ref[m], T.NT, low), 0.0)
    dv_ref[m] = T.mm(a_ref[m], do, T.TN, low)
  T.head_loop(MB, head)


def apply(v_new, Aqk, do, aligned_cu=None, *, chunk_size, interpret=False, config=None) -> Out:
  T.refuse("bwd_dav", supports(v_new, Aqk, do, aligned_cu, chunk_size=chunk_size, config=config))
  del aligned_cu   # the tail's chunks hold zeros: computed like the others
  BT = chunk_size
  _, Ta, HV, V = v_new.shape
  NTa = Ta // BT
  cfg = config or default_config(HV, V, BT, v_new.dtype, Aqk.dtype, do.dtype)
  MB = cfg.heads_per_program
  low = _low(v_new, Aqk, do)
  vh, ah, doh = (T.head_first(x) for x in (v_new, Aqk, do))
  blk = lambda D: pl.BlockSpec((MB, BT, D), lambda h, c: (h, c, 0))
  nbytes = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)
  dA, dv = pl.pallas_call(
      functools.partial(_kernel, MB=MB, BT=BT, low=low),
      grid=(HV // MB, NTa),
      in_specs=[blk(V), blk(BT), blk(V)],
      out_specs=[blk(BT), blk(V)],
      out_shape=[jax.ShapeDtypeStruct((HV, Ta, BT), T.F32), jax.ShapeDtypeStruct((HV, Ta, V), T.F32)],
      compiler_params=T.compiler_params(
          ("parallel", "parallel"), vmem_need(MB, V, BT, v_new.dtype, Aqk.dtype, do.dtype)),
      cost_estimate=pl.CostEstimate(flops=4 * HV * Ta * BT * V, transcendentals=0,
                                    bytes_accessed=nbytes(v_new, Aqk, do) + 4 * HV * Ta * (BT + V)),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_dav",
  )(vh, ah, doh)
  return Out(T.token_major(dA), T.token_major(dv))
