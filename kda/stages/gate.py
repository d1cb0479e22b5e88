"""gate: gate activation (optional) and the chunk-local cumulative sum of log-gates.

    g_act = g                                          use_gate_in_kernel=False
    g_act = -exp(A_log[h]) * softplus(g + dt_bias)     lower_bound unset
    g_act = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))   (A_log None: sigmoid(g + dt_bias))
    g_act = max(g_act, GATE_FLOOR)                     GATE_FLOOR = -128
    gc[t] = g_act[c*BT] + ... + g_act[t]               within chunk c, carried in two parts:
    gc_int  = chunk cumsum of ceil(g_act)              integers: exact (|gc_int| <= 128 * BT < 2**24)
    gc_frac = chunk cumsum of g_act - ceil(g_act)      parts in (-1, 0]: |gc_frac| <= BT
    gc = gc_int + gc_frac

Why two parts: every decay the chunk math needs is exp(gc_i - gc_j) for j <= i (or against the chunk
start or the chunk's last row). One float32 gc holding a large value (one gate of -1e4, or many
strong gates) keeps only ulp(|gc|) of the small differences that follow it, so the decays of the
tokens after it lose float32 accuracy (3e-4 relative at -1e4). Split, the difference is
(gc_int_i - gc_int_j) + (gc_frac_i - gc_frac_j): the first exact, the second as accurate as for
ordinary gates, however large the gates (`exponent`). The floor is exact too: exp(-128) is 0 in
float32 (below the smallest denormal, exp(-103.3)), so a gate at or below it, -inf included, is a
full reset of its channel, as in the recurrence; its gradient is 0 (bwd_gate) and no -inf or NaN
ever reaches the other stages.

In:  g [1, Ta, HV, K] raw, valid [1, Ta] bool, A_log [HV] or None, dt_bias [HV*K] or None.
Out: g [1, Ta, HV, K] float32 activated (floored), gc_int, gc_frac [1, Ta, HV, K] float32.
Padding: g_act is exactly 0 where valid is False (on top of the -1e4 neutralisation, which leaves
lower_bound * sigmoid(eps * -1e4) != 0 for a tiny exp(A_log)), so gc is flat after a sequence's last
real token and the chunk's decay is exactly that of its real tokens.
Positive gates are outside the contract: they pass through unchanged (gc_int then counts up).

Kernel: grid (NTa, HV), one program per (chunk, head) reads its [BT, K] tile straight from the
[1, Ta, HV, K] layout, activates, masks and takes the chunk-local cumsum in one pass. K that is not a
power of two is zero-padded in the launcher and cut off afterwards.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _pallas
from kda.stages.base import Stage

NAME = "gate"
GATE_FLOOR = -128.0   # exp(GATE_FLOOR) == 0 in float32: flooring there changes no decay


class Out(NamedTuple):
  g: jax.Array        # [1, Ta, HV, K] float32, activated log-gate, floored at GATE_FLOOR
  gc_int: jax.Array   # [1, Ta, HV, K] float32, chunk-local cumsum of ceil(g) (integers, exact)
  gc_frac: jax.Array  # [1, Ta, HV, K] float32, chunk-local cumsum of g - ceil(g)


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch parameters of the gate kernel (the tile is one whole chunk by K)."""
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _pallas.check_config(self)


def activate(g, A_log, dt_bias, *, use_gate_in_kernel, lower_bound):
  """Activated log-gate in float32 ([..., HV, K] raw -> same shape)."""
  g = g.astype(jnp.float32)
  if not use_gate_in_kernel:
    return g
  HV, K = g.shape[-2:]
  if dt_bias is not None:
    g = g + dt_bias.astype(jnp.float32).reshape(HV, K)
  a = None if A_log is None else jnp.exp(A_log.astype(jnp.float32))[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(g)
  return lower_bound * jax.nn.sigmoid(g if a is None else a * g)


def floor(g_act):
  """Gates at or below GATE_FLOOR (-inf included) -> GATE_FLOOR; NaN stays NaN."""
  return jnp.where(g_act < GATE_FLOOR, GATE_FLOOR, g_act)


def passes_floor(g_act):
  """Where the floor is not active: the gradient of floor() is 1 there and 0 elsewhere."""
  return g_act >= GATE_FLOOR


def split(g):
  """g -> (ceil(g), g - ceil(g)): an integer and a part in (-1, 0], both exact in float32."""
  whole = jnp.ceil(g)
  return whole, g - whole


def exponent(int_a, frac_a, int_b=0.0, frac_b=0.0):
  """gc_a - gc_b from the two parts: the integer difference is exact, the fractional one small."""
  return (int_a - int_b) + (frac_a - frac_b)


def chunk_cumsum(g, chunk_size):
  B, T = g.shape[:2]
  gc = jnp.cumsum(g.reshape((B, T // chunk_size, chunk_size) + g.shape[2:]), axis=2)
  return gc.reshape(g.shape)


def reference(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound):
  g_act = activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  g_act = jnp.where(valid[:, :, None, None], floor(g_act), 0.0)
  whole, frac = split(g_act)
  return Out(g_act, chunk_cumsum(whole, chunk_size), chunk_cumsum(frac, chunk_size))


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


def pallas(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, interpret=False,
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
  shape = jax.ShapeDtypeStruct((1, Ta, HV, Kp), f32)
  outs = pl.pallas_call(
      kernel, grid=(Ta // BT, HV), in_specs=in_specs, out_specs=[tile] * 3, out_shape=[shape] * 3,
      compiler_params=None if interpret else _pallas.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret, name=f"kda_{NAME}")(*args)
  return Out(*(x[..., :K] if Kp != K else x for x in outs))


STAGE = Stage(NAME, reference=reference, pallas=pallas)
