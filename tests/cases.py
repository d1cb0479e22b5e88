"""Named shapes, sequence-length profiles and random inputs shared by tests and tools.

Inputs follow the project's testing rules: a fresh key per tensor, log-gates drawn negative with
some pushed to extremes, beta in (0, 1), unit-norm q and k, a random initial_state; tokens of no
sequence are poisoned (large values and NaN) so a leak shows.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# name -> sequence lengths (the reference matrix plus the chunk-boundary cases)
SEQ_LENS = {
    "30_50": [30, 50],
    "45_80_20": [45, 80, 20],
    "100": [100],
    "100_50": [100, 50],
    "boundaries": [1, 63, 64, 65, 127, 129],
    "with_empty": [17, 0, 40],
    "trailing_empty": [30, 50, 0, 0, 0],
    "long_short": [150, 3, 5, 2, 7],
}


class Inputs(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array
  initial_state: jax.Array | None
  cu_seqlens: jax.Array | None
  A_log: jax.Array | None = None
  dt_bias: jax.Array | None = None


def cu_from_lens(lens):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def make_inputs(seed, *, lens=None, B=1, T=None, H=2, HV=None, K=32, V=32, dtype=jnp.float32,
                initial_state=True, gate="plain", extra_T=0, poison=True) -> Inputs:
  """Random inputs. lens: varlen sequence lengths (B = 1, T = sum(lens) + extra_T); else B rows of T.

  gate: "plain" (log-space gates, some strong), "raw" (pre-activation gates for use_gate_in_kernel,
  with A_log and dt_bias), "strong" (about -5 per token: the worst case of safe_gate).
  """
  HV = HV or H
  if lens is not None:
    B, T = 1, int(sum(lens)) + extra_T
    N = len(lens)
  else:
    N = B
  keys = jax.random.split(jax.random.PRNGKey(seed), 9)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(keys[0], (B, T, H, K)))
  k = unit(jax.random.normal(keys[1], (B, T, H, K)))
  v = jax.random.normal(keys[2], (B, T, HV, V))
  z = jax.random.normal(keys[3], (B, T, HV, K))
  A_log = dt_bias = None
  if gate == "plain":
    g = jax.nn.log_sigmoid(2.0 * z) / 2.0
    strong = jax.random.uniform(keys[4], (B, T, HV, 1)) < 0.05
    g = jnp.where(strong, g * 8.0 - 1.0, g)              # a few tokens with decay ~exp(-5)
  elif gate == "raw":
    g = 2.0 * z
    A_log = jax.random.uniform(keys[4], (HV,), minval=-1.0, maxval=1.0)
    dt_bias = 0.5 * jax.random.normal(keys[8], (HV * K,))
  elif gate == "strong":
    g = -5.0 + 0.05 * jax.nn.sigmoid(z)                  # in [-5, -4.95]
  else:
    raise ValueError(gate)
  beta = jax.nn.sigmoid(jax.random.normal(keys[5], (B, T, HV)))
  h0 = 0.5 * jax.random.normal(keys[6], (N, HV, K, V)) if initial_state else None
  cu = cu_from_lens(lens) if lens is not None else None
  q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
  if poison and lens is not None and extra_T:
    tail = jnp.arange(T) >= int(sum(lens))
    bad = lambda x: jnp.where(tail.reshape((1, T) + (1,) * (x.ndim - 2)), jnp.asarray(jnp.nan, x.dtype), x)
    q, k, v, g, beta = (bad(x) for x in (q, k, v, g, beta))
  return Inputs(q, k, v, g, beta, h0, cu, A_log, dt_bias)


def recurrence_gate(inp: Inputs, *, lower_bound=None):
  """The activated gate the recurrence needs for inputs made with gate="raw"."""
  from kda.stages.gate import activate
  return activate(inp.g, inp.A_log, inp.dt_bias, use_gate_in_kernel=True, lower_bound=lower_bound)


def report_close(name, got, want, *, atol, rtol):
  """assert_allclose that names the worst element (index, both values, error ratio)."""
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
  err = np.abs(got - want)
  bound = atol + rtol * np.abs(want)
  ratio = np.where(np.isnan(err), np.inf, err / bound)
  if ratio.size and not np.all(ratio <= 1.0):
    i = np.unravel_index(np.argmax(ratio), ratio.shape)
    raise AssertionError(f"{name}: worst at index {tuple(int(x) for x in i)}: got {got[i]!r}, want {want[i]!r}, "
                         f"|err| {err[i]:.3e} is {ratio[i]:.2f}x the bound (atol {atol}, rtol {rtol}); "
                         f"{int(np.sum(ratio > 1))} of {ratio.size} elements off")
  return float(np.max(err)) if err.size else 0.0


def rel_err(got, want):
  """max |got - want| / max |want| (the figure the closing notes quote)."""
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def aligned_layout(lens, chunk_size, tail_chunks=0):
  """The aligned layout of `lens` in numpy, as align makes it: sequence n at [acu[n], acu[n] + len_n),
  zeros up to acu[n+1], then `tail_chunks` chunks nobody owns -> (acu [N+1] int32, Ta, valid [Ta],
  tail [Ta] bool)."""
  alens = [-(-L // chunk_size) * chunk_size for L in lens]
  acu = np.concatenate([[0], np.cumsum(alens)]).astype(np.int32)
  Ta = int(acu[-1]) + tail_chunks * chunk_size
  valid = np.zeros(Ta, bool)
  for n, L in enumerate(lens):
    valid[acu[n]:acu[n] + L] = True
  return acu, Ta, valid, np.arange(Ta) >= acu[-1]
