"""gate: the XLA implementation; the math is in kda.stages.gate.

The reference's chunk-local cumsum (jnp.cumsum along the chunk) lowers on a CPU to a windowed sum of
up to BT terms per element. Here in two levels: a cumsum inside blocks of 8 rows (windows of 8),
then each block's offset, the cumsum of the blocks' totals before it, added on (a third of the
time, and fewer temporaries than an associative scan's log2(BT) rounds). The integer part gc_int
is exact either way (integers below 2**24); gc_frac's sums associate differently, within float32
rounding of the reference's.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._xla import compiled
from kda.stages.gate import Out, activate, floor, split


BLOCK = 8   # rows of the inner cumsum (chunk sizes are multiples of 16)


def chunk_cumsum(g, chunk_size):
  """gc[t] = g[c*BT] + ... + g[t] within chunk c, for g [B, Ta, ...]."""
  B, T = g.shape[:2]
  x = g.reshape((B, T // chunk_size, chunk_size // BLOCK, BLOCK) + g.shape[2:])
  inner = jnp.cumsum(x, 3)
  total = inner[:, :, :, -1]
  offset = jnp.cumsum(total, 2) - total                         # the blocks before, in this chunk
  return (inner + offset[:, :, :, None]).reshape(g.shape)


@compiled
def apply(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound):
  g_act = activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  g_act = jnp.where(valid[:, :, None, None], floor(g_act), 0.0)
  whole, frac = split(g_act)
  # a barrier: the outputs are formed here, so no consumer refuses them from the cumsum's parts
  return Out(*lax.optimization_barrier((g_act, chunk_cumsum(whole, chunk_size), chunk_cumsum(frac, chunk_size))))
