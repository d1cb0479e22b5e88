"""bwd_gate (S5): reverse chunk-local cumsum of dgc, then the gate activation's backward.

gc[t] = g_act[c*BT] + ... + g_act[t] within chunk c, so dg_act[t] = dgc[t] + ... + dgc[c*BT + BT-1]
(a reverse cumsum inside the chunk), plus S3's dg_state. The forward zeroes g_act where valid is False and floors it at
gate.GATE_FLOOR (exp of it is 0: a full reset), so dg_act is zeroed there too: the raw gate's
gradient at padding, and at gates at or below the floor (-inf included), is exactly 0. Then, with x = g + dt_bias, a =
exp(A_log) and the sums over every token (and channel for dA_log):

    use_gate_in_kernel=False:  dg = dg_act
    lower_bound unset:  g_act = -a * softplus(x)   dx = -a * sigmoid(x) * dg_act,  dA_log = sum(g_act * dg_act)
    lower_bound set:    g_act = lb * sigmoid(z), z = a * x (x if A_log is None)
                        dz = lb * s * (1 - s) * dg_act (s = sigmoid(z)),  dx = a * dz,  dA_log = sum(z * dz)
    dg = dx,  ddt_bias[h*K + c] = sum_t dx[t, h, c]

In:  g [1, Ta, HV, K] raw (prepared: aligned, gate-neutralised), valid [1, Ta] bool, A_log [HV] or None,
     dt_bias [HV*K] or None, dgc [1, Ta, HV, K] f32 (S3 + S4), dg_state [1, Ta, HV, K] f32 (S3: the
     gradient through kg and the chunk decay, already summed over the gates it passes).
Out: dg [1, Ta, HV, K] float32 (raw-gate cotangent, 0 where valid is False), dA_log [HV] float32 or
     None (None unless use_gate_in_kernel and A_log is given), ddt_bias [HV*K] float32 or None.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda.stages import gate
from kda.stages.base import Stage

NAME = "bwd_gate"


class Out(NamedTuple):
  dg: jax.Array              # [1, Ta, HV, K] float32
  dA_log: jax.Array | None   # [HV] float32
  ddt_bias: jax.Array | None  # [HV * K] float32


def reverse_chunk_cumsum(x, chunk_size):
  """y[t] = x[t] + ... + x[last token of t's chunk], for x [B, Ta, ...]."""
  B, T = x.shape[:2]
  xc = x.reshape((B, T // chunk_size, chunk_size) + x.shape[2:])
  return jnp.flip(jnp.cumsum(jnp.flip(xc, 2), axis=2), 2).reshape(x.shape)


def reference(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound):
  f32 = jnp.float32
  g_act = gate.activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  live = valid[:, :, None, None] & gate.passes_floor(g_act)
  dg_act = reverse_chunk_cumsum(dgc.astype(f32), chunk_size) + dg_state.astype(f32)
  dg_act = jnp.where(live, dg_act, 0.0)
  if not use_gate_in_kernel:
    return Out(dg_act, None, None)
  HV, K = g.shape[-2:]
  x = g.astype(f32)
  if dt_bias is not None:
    x = x + dt_bias.astype(f32).reshape(HV, K)
  a = None if A_log is None else jnp.exp(A_log.astype(f32))[:, None]
  # where(live, ...) after the products: a floored gate (softplus(x) = inf) gives 0, not inf * 0
  if lower_bound is None:
    dx = jnp.where(live, -a * jax.nn.sigmoid(x) * dg_act, 0.0)
    dA = jnp.where(live, -a * jax.nn.softplus(x) * dg_act, 0.0)
  else:
    z = x if a is None else a * x
    s = jax.nn.sigmoid(z)
    dz = jnp.where(live, lower_bound * s * (1.0 - s) * dg_act, 0.0)
    dx = dz if a is None else a * dz
    dA = jnp.where(live, z * dz, 0.0)
  dA_log = None if A_log is None else jnp.sum(dA, axis=(0, 1, 3))
  ddt_bias = None if dt_bias is None else jnp.sum(dx, axis=(0, 1)).reshape(HV * K)
  return Out(dx, dA_log, ddt_bias)


STAGE = Stage(NAME, reference=reference)
