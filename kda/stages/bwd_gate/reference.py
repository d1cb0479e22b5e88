"""bwd_gate: the jnp reference; the math is in kda.stages.bwd_gate."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kda.stages import gate
from kda.stages.bwd_gate import Out


def reverse_chunk_cumsum(x, chunk_size):
  """y[t] = x[t] + ... + x[last token of t's chunk], for x [B, Ta, ...]."""
  B, T = x.shape[:2]
  xc = x.reshape((B, T // chunk_size, chunk_size) + x.shape[2:])
  return jnp.flip(jnp.cumsum(jnp.flip(xc, 2), axis=2), 2).reshape(x.shape)


def apply(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound):
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
    dA = jnp.where(live & (dz != 0.0), z * dz, 0.0)   # z = +-inf has s (1 - s) = 0: the limit is 0, not inf * 0
  dA_log = None if A_log is None else jnp.sum(dA, axis=(0, 1, 3))
  ddt_bias = None if dt_bias is None else jnp.sum(dx, axis=(0, 1)).reshape(HV * K)
  return Out(dx, dA_log, ddt_bias)
