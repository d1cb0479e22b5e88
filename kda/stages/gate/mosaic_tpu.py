"""gate: the Pallas Mosaic TPU kernel; the math is in kda.stages.gate.

Kernel: grid (HV / MB, NTa), both "parallel"; program (p, c) takes value heads [p MB, (p+1) MB) of
chunk c, head-first (kda._mosaic_tpu): g (MB, BT, Kp) in g's dtype, valid (BT, 1) f32, A_log
(MB, 1, 1) f32, dt_bias (MB, 1, Kp) f32 -> g_act, gc_int, gc_frac (MB, BT, Kp) float32. In VMEM it
activates (the reference's own f32 formula, `gate_chunk`), floors, masks with valid, splits into
ceil and rest, and takes both chunk cumsums as tril(ones) [BT, BT] @ part, batched over the MB heads
at HIGHEST (no cumsum lowers on TPU). The integer part stays exact on the MXU: ceil(g) in
[-128, 0] is exact in bf16, so every pass of the f32 contraction multiplies exactly and the sums
(< 2^24) accumulate exactly in f32. No scratch, nothing carried between programs.

A NaN gate poisons its whole chunk here (0 * NaN in the tril dot), not only the rows after it as
the reference's cumsum does; the chunk belongs to one sequence, so nothing leaks past it.

VMEM (BT = 64, K = 128; kda._mosaic_tpu.budget): MB = 8 heads per program on v5e, v6e and v7x,
3.4 MiB (bf16 g) / 3.7 MiB (f32) by the budget, under every default scoped limit (16 MiB v5e,
32 MiB v6e / v7x), which it keeps.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu as tpu
from kda.stages.gate import NAME, Out, floor, split

F32 = tpu.F32


@dataclasses.dataclass(frozen=True)
class Config:
  """MB value heads per program (rounded down to a divisor of HV)."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)

  def __post_init__(self):
    tpu.check_config(self)


def tiles(MB, BT, Kp, dtype, has_a, has_bias):
  """(blocks, scratch, temps) of one program as (shape, dtype) pairs."""
  blocks = [((MB, BT, Kp), dtype), ((BT, 1), F32)] + [((MB, 1, 1), F32)] * has_a
  blocks += [((MB, 1, Kp), F32)] * has_bias + [((MB, BT, Kp), F32)] * 3
  temps = [((MB, BT, Kp), F32)] * 5 + [((MB, BT, BT), F32)]
  return blocks, [], temps


def default_config(K, chunk_size, dtype, gen: Optional[tpu.Generation] = None) -> Config:
  """Heads per program for this generation (kda._mosaic_tpu.default_heads)."""
  gen = gen or tpu.generation()
  return Config(heads=tpu.default_heads(lambda mb: tiles(mb, chunk_size, tpu.lanes(K), dtype, True, True), gen))


def gate_chunk(g, valid, a_log, bias, *, use_gate_in_kernel, lower_bound):
  """One chunk of MB heads: g [MB, BT, Kp] raw, valid [BT, 1] f32 (1 at real tokens), a_log
  [MB, 1, 1] f32 or None, bias [MB, 1, Kp] f32 or None -> (g_act, gc_int, gc_frac) [MB, BT, Kp] f32."""
  x = g.astype(F32)
  if use_gate_in_kernel:
    if bias is not None:
      x = x + bias
    a = None if a_log is None else jnp.exp(a_log)
    if lower_bound is None:
      x = -a * jax.nn.softplus(x)
    else:
      x = lower_bound * jax.nn.sigmoid(x if a is None else a * x)
  x = jnp.where(valid > 0, floor(x), 0.0)
  whole, frac = split(x)
  MB, BT, _ = x.shape
  ones = jnp.broadcast_to(tpu.tril(BT), (MB, BT, BT))
  return x, tpu.dot(ones, whole, tpu.NN), tpu.dot(ones, frac, tpu.NN)


def supports(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound,
             config=None) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if g.ndim != 4 or g.shape[0] != 1:
    return f"g must be [1, Ta, HV, K], got shape {g.shape}"
  _, Ta, HV, K = g.shape
  reason = tpu.chunk_reason(chunk_size, Ta) or tpu.float_reason("g", g)
  if reason:
    return reason
  if valid.shape != (1, Ta):
    return f"valid must have shape {(1, Ta)}, got {valid.shape}"
  if use_gate_in_kernel and lower_bound is None and A_log is None:
    return "the softplus gate activation (lower_bound None) needs A_log [HV], got None"
  if use_gate_in_kernel and A_log is not None and A_log.shape != (HV,):
    return f"A_log must have shape {(HV,)}, got {A_log.shape}"
  if use_gate_in_kernel and dt_bias is not None and dt_bias.shape != (HV * K,):
    return f"dt_bias must have shape {(HV * K,)}, got {dt_bias.shape}"
  gen = tpu.generation()
  MB = tpu.heads_per_program(HV, (config or default_config(K, chunk_size, g.dtype, gen)).heads)
  b = tpu.budget(*tiles(MB, chunk_size, tpu.lanes(K), g.dtype, True, True), gen)
  return tpu.budget_reason(NAME, b, gen)


def _kernel(*refs, has_a, has_bias, **kw):
  refs = list(refs)
  g_ref, valid_ref = refs.pop(0), refs.pop(0)
  a_ref = refs.pop(0) if has_a else None
  bias_ref = refs.pop(0) if has_bias else None
  go_ref, gi_ref, gf_ref = refs
  a = None if a_ref is None else a_ref[...]
  bias = None if bias_ref is None else bias_ref[...]
  g_act, gi, gf = gate_chunk(g_ref[...], valid_ref[...], a, bias, **kw)
  go_ref[...], gi_ref[...], gf_ref[...] = g_act, gi, gf


def launch(g, valid, a_log, bias, *, chunk_size, use_gate_in_kernel, lower_bound, config, interpret=False):
  """The kernel on head-first arrays: g [HV, Ta, Kp], valid [Ta, 1] f32, a_log [HV, 1, 1] f32 or None,
  bias [HV, 1, Kp] f32 or None -> (g_act, gc_int, gc_frac) [HV, Ta, Kp] float32."""
  HV, Ta, Kp = g.shape
  BT, gen = chunk_size, tpu.generation()
  MB = tpu.heads_per_program(HV, config.heads)
  has_a, has_bias = a_log is not None, bias is not None
  tile = pl.BlockSpec((MB, BT, Kp), lambda p, c: (p, c, 0))
  in_specs = [tile, pl.BlockSpec((BT, 1), lambda p, c: (c, 0))]
  in_specs += [pl.BlockSpec((MB, 1, 1), lambda p, c: (p, 0, 0))] * has_a
  in_specs += [pl.BlockSpec((MB, 1, Kp), lambda p, c: (p, 0, 0))] * has_bias
  args = [x for x in (g, valid, a_log, bias) if x is not None]
  b = tpu.budget(*tiles(MB, BT, Kp, g.dtype, has_a, has_bias), gen)
  n = HV * Ta * Kp
  kernel = functools.partial(_kernel, has_a=has_a, has_bias=has_bias, use_gate_in_kernel=use_gate_in_kernel,
                             lower_bound=lower_bound)
  out = tpu.struct((HV, Ta, Kp), F32, *args)
  return pl.pallas_call(
      kernel, grid=(HV // MB, Ta // BT), in_specs=in_specs, out_specs=[tile] * 3, out_shape=[out] * 3,
      compiler_params=tpu.compiler_params(("parallel", "parallel"), b, config.vmem_limit),
      cost_estimate=tpu.cost(4 * n * BT + 10 * n, 3 * n * use_gate_in_kernel, tpu.nbytes(*args) + 3 * 4 * n),
      interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}_tpu")(*args)


def head_params(A_log, dt_bias, HV, K, *, use_gate_in_kernel):
  """A_log [HV], dt_bias [HV * K] -> the kernel's a_log [HV, 1, 1], bias [HV, 1, Kp] (None where unused)."""
  if not use_gate_in_kernel:
    return None, None
  a = None if A_log is None else A_log.astype(F32).reshape(HV, 1, 1)
  bias = None if dt_bias is None else tpu.to_heads(dt_bias.astype(F32).reshape(1, 1, HV, K))
  return a, bias


def apply(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, interpret=False,
          config=None):
  reason = supports(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                    lower_bound=lower_bound, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_tpu gate kernel: {reason}")
  _, Ta, HV, K = g.shape
  config = config or default_config(K, chunk_size, g.dtype)
  a, bias = head_params(A_log, dt_bias, HV, K, use_gate_in_kernel=use_gate_in_kernel)
  outs = launch(tpu.to_heads(g), valid[0].astype(F32)[:, None], a, bias, chunk_size=chunk_size,
                use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, config=config,
                interpret=interpret)
  return Out(*(tpu.from_heads(x, K) for x in outs))
