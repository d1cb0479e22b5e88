"""Shared setup of the backward stage tests: real forward records on a padded varlen case, random
cotangents, and a close() that scales the tolerance with the tensor's magnitude."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kda import padding, pipeline
from kda import plan as planning
from kda.stages.intra import from_chunks, to_chunks
from tests import cases

# Hand-derived backward vs jax.vjp of the forward references, both float32 at HIGHEST precision on
# the same inputs: they differ only in summation order. Measured <= 3.4e-7 of the tensor's max,
# except bwd_intra's dgc with gates of -5 per token: 6.2e-6 (each causal pair adds its term to row i
# and subtracts it from row j, and those cancel). 5e-5 keeps 8x there; a wrong or missing term is O(1).
TOL = 5e-5


class Setup(NamedTuple):
  plan: Any
  layout: Any
  rec: dict          # forward(..., record=True) records: stage outputs and "inputs"
  inp: cases.Inputs


# The configurations the stage tests share (one forward compile each per test session).
PLAIN = dict(chunk_size=32, K=32, V=16, gate="plain")
STRONG = dict(chunk_size=64, K=16, V=32, gate="strong")   # about -5 per token: gc reaches -320
RAW = dict(chunk_size=32, K=32, V=16, gate="raw")          # use_gate_in_kernel, softplus activation


@functools.lru_cache(maxsize=None)
def _records(seed, lens, H, HV, K, V, chunk_size, gate, lower_bound, extra_T):
  inp = cases.make_inputs(seed, lens=list(lens), H=H, HV=HV, K=K, V=V, gate=gate, extra_T=extra_T)
  layout = padding.layout_from_cu_seqlens(inp.cu_seqlens, inp.q.shape[1], chunk_size)
  plan = planning.make_plan(scale=K ** -0.5, chunk_size=chunk_size, use_gate_in_kernel=gate == "raw",
                            lower_bound=lower_bound, impl="reference")
  fwd = jax.jit(lambda *a: pipeline.forward(plan, layout, *a, record=True)[2])
  rec = fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state, inp.A_log, inp.dt_bias)
  return Setup(plan, layout, rec, inp)


def forward_records(seed=1, *, lens=(30, 50, 0, 17), H=2, HV=2, K=32, V=16, chunk_size=32, gate="plain",
                    lower_bound=None, extra_T=3):
  """Run the forward references on make_inputs data; its records feed the backward stages. The lens
  have partial chunks, an empty sequence and a tail past cu_seqlens[-1]."""
  return _records(seed, tuple(lens), H, HV, K, V, chunk_size, gate, lower_bound, extra_T)


def randn(seed, *shapes):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return [jax.random.normal(key, s, jnp.float32) for key, s in zip(keys, shapes)]


def chunk_mats(x, BT):
  """[1, Ta, HV, BT] row layout -> [NTa, HV, BT, BT] matrices."""
  return jnp.moveaxis(to_chunks(x, BT), 2, 1)


def row_layout(A):
  """[NTa, HV, BT, BT] -> [1, Ta, HV, BT]."""
  return from_chunks(jnp.moveaxis(A, 1, 2))


def causal(BT, strict):
  """[1, 1, 1, BT] mask broadcastable against a [1, Ta, HV, BT] row-layout matrix (row = token % BT)."""
  i = np.arange(BT)[:, None]
  j = np.arange(BT)[None, :]
  return (j < i) if strict else (j <= i)


def mask_rows(x, BT, strict):
  """Zero the entries of a [1, Ta, HV, BT] row-layout matrix outside the (strict) lower triangle."""
  m = causal(BT, strict)                                    # [BT(i), BT(j)]
  NTa = x.shape[1] // BT
  m = np.tile(m, (NTa, 1))[None, :, None, :]
  return jnp.where(m, x, 0.0)


def close(name, got, want, tol=TOL):
  """chex comparison with atol = tol * max|want| (gradients span several magnitudes)."""
  want = np.asarray(want, np.float32)
  scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
  try:
    chex.assert_trees_all_close(np.asarray(got, np.float32), want, atol=tol * scale, rtol=tol)
  except AssertionError as e:
    raise AssertionError(f"{name}: rel err {cases.rel_err(got, want):.2e} > {tol}\n{e}") from None


def blocks(x):
  """[1, Ta, HV(, K)] -> [NTa, HV, BT(*K)] with BT = 64: one row per (chunk, head)."""
  x = x[0]
  x = x.reshape((x.shape[0] // 64, 64) + x.shape[1:])
  x = np.moveaxis(x, 2, 1)
  return x.reshape(x.shape[0], x.shape[1], -1)


def block_errors(got, want, fields):
  """Per field of two NamedTuples, the kernel tests' metrics: the worst (chunk, head) block's
  max|d| / max|ref| (a block whose reference is all 0 must be exactly 0: ratio 0 or inf), and
  ||d|| / ||ref||."""
  out = {}
  for name in fields:
    a = np.asarray(getattr(got, name), np.float64)
    b = np.asarray(getattr(want, name), np.float64)
    d = np.abs(a - b)
    dm, bm = blocks(d).max(-1), blocks(np.abs(b)).max(-1)
    ratio = np.where(bm > 0, dm / np.where(bm > 0, bm, 1.0), np.where(dm > 0, np.inf, 0.0))
    out[name] = (float(ratio.max()), float(np.linalg.norm(d) / max(np.linalg.norm(b), 1e-30)))
  return out


def fmt(errs):
  """block_errors' result in one line."""
  return ", ".join(f"{n} {e[0]:.2e}/{e[1]:.2e}" for n, e in errs.items())


def packed_and_aligned(layout, xs, dtype=jnp.bfloat16):
  """Aligned [1, Ta, ...] arrays -> (packed [1, T, ...] with NaN at tokens of no sequence, and their
  aligned copies with 0 there): the inputs of a kernel's packed-read mode and of its aligned call."""
  from kda import padding
  owned = padding.packed_owned_mask(layout)[None, :, None, None]
  packed = [jnp.where(owned, padding.unalign_with(layout, x), jnp.nan).astype(dtype) for x in xs]
  return packed, [padding.align_with(layout, jnp.where(owned, x, 0)) for x in packed]
