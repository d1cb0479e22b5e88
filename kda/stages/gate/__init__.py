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
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda.stages.base import Stage

NAME = "gate"
GATE_FLOOR = -128.0   # exp(GATE_FLOOR) == 0 in float32: flooring there changes no decay


class Out(NamedTuple):
  g: jax.Array        # [1, Ta, HV, K] float32, activated log-gate, floored at GATE_FLOOR
  gc_int: jax.Array   # [1, Ta, HV, K] float32, chunk-local cumsum of ceil(g) (integers, exact)
  gc_frac: jax.Array  # [1, Ta, HV, K] float32, chunk-local cumsum of g - ceil(g)


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


from kda.stages.gate import mosaic_gpu, mosaic_tpu, pallas, reference, xla  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, xla=xla, pallas=pallas, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
