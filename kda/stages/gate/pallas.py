"""gate: the Pallas kernel, Triton lowering (any CUDA GPU); the math is in kda.stages.gate.

Kernel: grid (NTa, HV), one program per (chunk, head) reads its [BT, K] tile straight from the
[1, Ta, HV, K] layout, activates, masks and takes the chunk-local cumsum in one pass. K that is not a
power of two is zero-padded in the launcher and cut off afterwards.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _pallas
from kda._vma import out_struct
from kda.stages.gate import NAME, Out, floor, split


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch parameters of the gate kernel (the tile is one whole chunk by K)."""
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _pallas.check_config(self)


def _kernel(*refs, use_gate_in_kernel, lower_bound, has_a, has_bias):
  # refs: g [BT, K], valid [BT, 1] f32, (A_log [1, K]), (dt_bias [1, K]) -> g_act, gc_int, gc_frac
  # [BT, K] f32
  refs = list(refs)
  g_ref, valid_ref = refs.pop(0), refs.pop(0)
  a_ref = refs.pop(0) if has_a else None
  bias_ref = refs.pop(0) if has_bias else None
  go_ref, gi_ref, gf_ref = refs
  f32 = jnp.float32
  b_g = g_ref[...].astype(f32)
  if use_gate_in_kernel:
    if has_bias:
      b_g = b_g + bias_ref[...]
    b_a = jnp.exp(a_ref[...]) if has_a else None
    if lower_bound is None:
      b_g = -b_a * jax.nn.softplus(b_g)
    else:
      b_g = lower_bound * jax.nn.sigmoid(b_g if b_a is None else b_a * b_g)
  b_g = jnp.where(valid_ref[...] > 0, floor(b_g), 0.0)
  go_ref[...] = b_g
  b_whole, b_frac = split(b_g)
  gi_ref[...] = jnp.cumsum(b_whole, axis=0)
  gf_ref[...] = jnp.cumsum(b_frac, axis=0)


def apply(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, interpret=False,
          config=None):
  config = config or Config()
  BT = chunk_size
  _, Ta, HV, K = g.shape
  f32 = jnp.float32
  if use_gate_in_kernel and lower_bound is None and A_log is None:
    raise ValueError("gate activation without lower_bound requires A_log [HV], got None")
  Kp = max(_pallas.next_pow2(K), 16)
  has_a = use_gate_in_kernel and A_log is not None
  has_bias = use_gate_in_kernel and dt_bias is not None
  tile = pl.BlockSpec((None, BT, None, Kp), lambda c, h: (0, c, h, 0))
  head = pl.BlockSpec((1, Kp), lambda c, h: (h, 0))
  args = [_pallas.pad_dim(g, 3, Kp), valid.astype(f32)[:, :, None]]
  in_specs = [tile, pl.BlockSpec((None, BT, 1), lambda c, h: (0, c, 0))]
  if has_a:                                   # one row per head, broadcast over K
    args.append(jnp.broadcast_to(A_log.astype(f32)[:, None], (HV, Kp)))
    in_specs.append(head)
  if has_bias:
    args.append(_pallas.pad_dim(dt_bias.astype(f32).reshape(HV, K), 1, Kp))
    in_specs.append(head)
  kernel = functools.partial(_kernel, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                             has_a=has_a, has_bias=has_bias)
  shape = out_struct((1, Ta, HV, Kp), f32, args)
  outs = pl.pallas_call(
      kernel, grid=(Ta // BT, HV), in_specs=in_specs, out_specs=[tile] * 3, out_shape=[shape] * 3,
      compiler_params=None if interpret else _pallas.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret, name=f"kda_{NAME}")(*args)
  return Out(*(x[..., :K] if Kp != K else x for x in outs))
