"""output: the Pallas Mosaic TPU kernel; the math is in kda.stages.output.

Kernel: grid (HV / MB, NTa), both "parallel"; program (p, c) takes value heads [p MB, (p+1) MB) of
chunk c, head-first (kda._mosaic_tpu): qg (MB, BT, Kp), h (MB, Vp, Kp) (the state entering the chunk,
transposed as the state kernel stores it), Aqk (MB, BT, BT), v_new (MB, BT, Vp) ->
o (MB, BT, Vp) = scale * qg @ h + Aqk @ v_new (`output_chunk`, which kda.fused.state_output.mosaic_tpu
calls too): an NT dot [BT, Kp] x [Vp, Kp] and an NN dot [BT, BT] x [BT, Vp], bf16 operands (one MXU
pass, f32 accumulation) where qg is bf16, f32 at HIGHEST otherwise. o is stored float32
(Config.out_dtype overrides). No scratch.

VMEM (BT = 64, K = V = 128; kda._mosaic_tpu.budget): MB = 8 on every generation, 2.5 MiB (bf16) /
3.8 MiB (f32), under the default scoped limits.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu as tpu
from kda.stages.output import NAME, Out

F32 = tpu.F32


@dataclasses.dataclass(frozen=True)
class Config:
  """MB value heads per program (rounded down to a divisor of HV); out_dtype: o as stored."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)
  out_dtype: str = "float32"

  def __post_init__(self):
    tpu.check_config(self)
    if self.out_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"out_dtype must be 'float32' or 'bfloat16', got {self.out_dtype!r}")


def tiles(MB, BT, Kp, Vp, dtype, h_dtype, out_dtype=F32):
  blocks = [((MB, BT, Kp), dtype), ((MB, Vp, Kp), h_dtype), ((MB, BT, BT), dtype), ((MB, BT, Vp), dtype),
            ((MB, BT, Vp), out_dtype)]
  return blocks, [], [((MB, BT, Vp), F32)] * 3


def default_config(K, V, chunk_size, dtype, gen: Optional[tpu.Generation] = None) -> Config:
  """Heads per program for this generation (kda._mosaic_tpu.default_heads)."""
  gen = gen or tpu.generation()
  return Config(heads=tpu.default_heads(lambda mb: tiles(mb, chunk_size, tpu.lanes(K), tpu.lanes(V), dtype, F32), gen))


def output_chunk(qg, St, Aqk, v_new, *, scale, mm_dtype):
  """qg [MB, BT, Kp], St [MB, Vp, Kp] (S^T), Aqk [MB, BT, BT], v_new [MB, BT, Vp] -> o [MB, BT, Vp] f32."""
  m = lambda x: x.astype(mm_dtype)
  return scale * tpu.dot(m(qg), m(St), tpu.NT) + tpu.dot(m(Aqk), m(v_new), tpu.NN)


def supports(qg, h, Aqk, v_new, *, scale=None, chunk_size, config=None) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if qg.ndim != 4 or qg.shape[0] != 1 or v_new.ndim != 4:
    return f"qg, v_new must be [1, Ta, HV, D], got qg {qg.shape}, v_new {v_new.shape}"
  _, Ta, HV, K = qg.shape
  V = v_new.shape[-1]
  reason = tpu.chunk_reason(chunk_size, Ta)
  for name, x, shape in (("h", h, (1, Ta // chunk_size, HV, K, V)), ("Aqk", Aqk, (1, Ta, HV, chunk_size)),
                         ("v_new", v_new, (1, Ta, HV, V))):
    reason = reason or (None if x.shape == shape else f"{name} must have shape {shape}, got {x.shape}")
  for name, x in (("qg", qg), ("h", h), ("Aqk", Aqk), ("v_new", v_new)):
    reason = reason or tpu.float_reason(name, x)
  if reason:
    return reason
  gen = tpu.generation()
  dt = tpu.matmul_dtype(qg.dtype, Aqk.dtype, v_new.dtype)
  MB = tpu.heads_per_program(HV, (config or default_config(K, V, chunk_size, dt, gen)).heads)
  b = tpu.budget(*tiles(MB, chunk_size, tpu.lanes(K), tpu.lanes(V), dt, dt), gen)
  return tpu.budget_reason(NAME, b, gen)


def _kernel(qg_ref, h_ref, a_ref, vn_ref, o_ref, *, scale, mm_dtype):
  o_ref[...] = output_chunk(qg_ref[...], h_ref[...], a_ref[...], vn_ref[...], scale=scale,
                            mm_dtype=mm_dtype).astype(o_ref.dtype)


def launch(qg, h, Aqk, v_new, *, scale, chunk_size, config, interpret=False):
  """The kernel on head-first arrays: qg [HV, Ta, Kp], h [HV, NTa, Vp, Kp], Aqk [HV, Ta, BT],
  v_new [HV, Ta, Vp] -> o [HV, Ta, Vp] in config.out_dtype."""
  HV, Ta, Kp = qg.shape
  Vp = v_new.shape[-1]
  BT, gen = chunk_size, tpu.generation()
  MB = tpu.heads_per_program(HV, config.heads)
  out_dtype = jnp.dtype(config.out_dtype)
  row = lambda D: pl.BlockSpec((MB, BT, D), lambda p, c: (p, c, 0))
  hspec = pl.BlockSpec((MB, None, Vp, Kp), lambda p, c: (p, c, 0, 0))
  out = tpu.struct((HV, Ta, Vp), out_dtype, qg, h, Aqk, v_new)
  b = tpu.budget(*tiles(MB, BT, Kp, Vp, qg.dtype, h.dtype, out_dtype), gen)
  kernel = functools.partial(_kernel, scale=float(scale), mm_dtype=tpu.matmul_dtype(qg.dtype))
  return pl.pallas_call(
      kernel, grid=(HV // MB, Ta // BT), in_specs=[row(Kp), hspec, row(BT), row(Vp)], out_specs=row(Vp),
      out_shape=out, compiler_params=tpu.compiler_params(("parallel", "parallel"), b, config.vmem_limit),
      cost_estimate=tpu.cost(2 * HV * Ta * Vp * (Kp + BT), 0, tpu.nbytes(qg, h, Aqk, v_new, out)),
      interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}_tpu")(qg, h, Aqk, v_new)


def apply(qg, h, Aqk, v_new, *, scale, chunk_size, interpret=False, config=None):
  reason = supports(qg, h, Aqk, v_new, chunk_size=chunk_size, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_tpu output kernel: {reason}")
  K, V = qg.shape[-1], v_new.shape[-1]
  dt = tpu.matmul_dtype(qg.dtype, Aqk.dtype, v_new.dtype)
  config = config or default_config(K, V, chunk_size, dt)
  o = launch(tpu.to_heads(qg, dt), tpu.h_to_heads(h, dt), tpu.square_to_heads(Aqk.astype(dt)),
             tpu.to_heads(v_new, dt), scale=scale, chunk_size=chunk_size, config=config,
             interpret=interpret)
  return Out(tpu.from_heads(o, V))
