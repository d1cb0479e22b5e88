"""gate: the jnp reference; the math is in kda.stages.gate."""
from __future__ import annotations

import jax.numpy as jnp

from kda.stages.gate import Out, activate, chunk_cumsum, floor, split


def apply(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound):
  g_act = activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  g_act = jnp.where(valid[:, :, None, None], floor(g_act), 0.0)
  whole, frac = split(g_act)
  return Out(g_act, chunk_cumsum(whole, chunk_size), chunk_cumsum(frac, chunk_size))
