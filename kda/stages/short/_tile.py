"""What the short stage's kernels share: one step on a state tile, forward and backward (the math of
kda.stages.short, on S [K, BV] with q, k, g as [K, 1] columns, v, do as [1, BV] rows and beta
[1, 1]), the zeros past a sequence's steps, and the custom VJP that pairs a forward launcher with a
backward one."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def step(S, q, k, v, g, b, scale):
  """-> (S', Sd, v - Sd^T k, e, o) of one step."""
  Sd = S * jnp.exp(g)
  r = v - jnp.sum(k * Sd, axis=0, keepdims=True)
  e = b * r
  S1 = Sd + k * e
  return S1, Sd, r, e, scale * jnp.sum(q * S1, axis=0, keepdims=True)


def step_back(S, q, k, v, g, b, do, dS, scale, rowsum):
  """The step's backward, dS the cotangent of S' before o's share: -> (the cotangent of S, and of
  q, k, g as rowsum makes them, of v [1, BV], of beta [1, 1]). rowsum: [K, BV] -> the kernel's row
  of its sums over BV."""
  S1, Sd, res, e, _ = step(S, q, k, v, g, b, scale)
  dS = dS + scale * q * do
  de = jnp.sum(dS * k, axis=0, keepdims=True)
  dp = -b * de
  dSd = dS + k * dp
  return (dSd * jnp.exp(g), scale * rowsum(S1 * do), rowsum(dS * e + Sd * dp), rowsum(dSd * Sd), b * de,
          jnp.sum(res * de, axis=1, keepdims=True))


def step_count(lens, N, S):
  """Each sequence's steps, [N] int32 (None: all S)."""
  return jnp.full((N,), S, jnp.int32) if lens is None else jnp.minimum(lens.astype(jnp.int32), S)


def with_vjp(forward, backward):
  """fn(q, k, v, g, beta, h0, lens, scale, interpret, config) -> (o, final_state), differentiable:
  forward(the same) -> (o, final_state); backward(scale, interpret, config, (q, k, v, g, beta, h0,
  lens), (do, dht)) -> the cotangents of q, k, v, g, beta, h0. lens, an int array, travels as a
  primal argument and gets no cotangent."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
  def fn(q, k, v, g, beta, h0, lens, scale, interpret, config):
    return forward(q, k, v, g, beta, h0, lens, scale, interpret, config)

  def fwd(q, k, v, g, beta, h0, lens, scale, interpret, config):
    return forward(q, k, v, g, beta, h0, lens, scale, interpret, config), (q, k, v, g, beta, h0, lens)

  def bwd(scale, interpret, config, res, cts):
    return (*backward(scale, interpret, config, res, cts), None)

  fn.defvjp(fwd, bwd)
  return fn


def zero_rows(first, end, refs):
  """Rows first..end of each [rows, D] ref to 0 (the steps past a sequence's own)."""
  def zero(r, carry):
    for ref in refs:
      ref[pl.ds(r, 1), :] = jnp.zeros((1, ref.shape[1]), ref.dtype)
    return carry
  lax.fori_loop(first, end, zero, 0)
