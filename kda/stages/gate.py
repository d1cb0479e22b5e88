"""gate: gate activation (optional) and the chunk-local cumulative sum of log-gates.

    g_act = g                                          use_gate_in_kernel=False
    g_act = -exp(A_log[h]) * softplus(g + dt_bias)     lower_bound unset
    g_act = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))   (A_log None: sigmoid(g + dt_bias))
    gc[t] = g_act[c*BT] + ... + g_act[t]               within chunk c

In:  g [1, Ta, HV, K] raw, valid [1, Ta] bool, A_log [HV] or None, dt_bias [HV*K] or None.
Out: g [1, Ta, HV, K] float32 activated, gc [1, Ta, HV, K] float32.
Padding: g_act is exactly 0 where valid is False (on top of the -1e4 neutralisation, which leaves
lower_bound * sigmoid(eps * -1e4) != 0 for a tiny exp(A_log)), so gc is flat after a sequence's last
real token and the chunk's decay is exactly that of its real tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda.stages.base import Stage

NAME = "gate"


class Out(NamedTuple):
  g: jax.Array   # [1, Ta, HV, K] float32, activated log-gate
  gc: jax.Array  # [1, Ta, HV, K] float32, chunk-local cumsum of g


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


def chunk_cumsum(g, chunk_size):
  B, T = g.shape[:2]
  gc = jnp.cumsum(g.reshape((B, T // chunk_size, chunk_size) + g.shape[2:]), axis=2)
  return gc.reshape(g.shape)


def reference(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound):
  g_act = activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  g_act = jnp.where(valid[:, :, None, None], g_act, 0.0)
  return Out(g_act, chunk_cumsum(g_act, chunk_size))


STAGE = Stage(NAME, reference=reference)
