"""short: the reference, jnp; JAX differentiates it through a checkpoint per step (the backward
keeps the state entering each step)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kda._vma import vary_like
from kda.stages.short import Out

HI = lax.Precision.HIGHEST


def apply(q, k, v, g, beta, h0, lens=None, *, scale, skip=False):
  S = h0
  outs = []
  steps = q.shape[1]
  reached = None
  if lens is not None:            # the steps past a sequence's own are not taken: their inputs read 0
    on = lens[:, None] > jnp.arange(steps)[None]
    q, k, v, g, beta = (jnp.where(on.reshape(on.shape + (1,) * (x.ndim - 2)), x, 0.0) for x in (q, k, v, g, beta))
    reached = jnp.any(on, axis=0) if skip else None
  for i in range(steps):
    xs = (S, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
    if reached is None or i == 0:
      S, o_i = step(*xs, scale)
    else:                 # a step no sequence reaches is skipped at run time, forward and backward
      S, o_i = lax.cond(reached[i], lambda *a: step(*a, scale), _idle, *xs)
    outs.append(o_i)
  o = jnp.stack(outs, 1) if outs else jnp.zeros(v.shape, jnp.float32)
  return Out(o, S)


def _idle(S, q, k, v, g, beta):
  """A step no sequence reaches: S as it is, o = 0 (what `step` gives there; under shard_map both
  vary as step's results do)."""
  return vary_like((S, jnp.zeros(v.shape, S.dtype)), q, k, v, g, beta)


@jax.checkpoint      # the backward keeps the state entering each step, not the step's temporaries
def step(S, q, k, v, g, beta, scale):
  """One token of every sequence: S [N, HV, K, V], q, k, g [N, HV, K], v [N, HV, V], beta [N, HV]."""
  S = S * jnp.exp(g)[..., None]
  err = beta[..., None] * (v - jnp.einsum("nhk,nhkv->nhv", k, S, precision=HI))
  S = S + k[..., None] * err[:, :, None, :]
  return S, scale * jnp.einsum("nhk,nhkv->nhv", q, S, precision=HI)
