"""short: the Pallas Mosaic TPU kernels; the math is in kda.stages.short.

Grid (HV, N / BN), both parallel: a program takes BN sequences of one head and, one sequence after
the other, keeps its [K, V] float32 state in vregs for its lens[n] steps (scalar prefetch, SMEM),
writing zeros at the steps past them; the state is read and written once per call. The backward walks
a sequence's steps in reverse, recomputing the state entering step t from h0 (n(n+1)/2 steps, n a
few tokens) rather than storing n states.

Layout. States keep the stage's [N, HV, K, V] (blocks (BN, None, K, V): no transpose of the large
arrays); the per-step vectors travel head-first, [HV, N * S, D] (blocks (None, BN * S, D), beta as
[HV, N * S, 1]), and a step loads one row. The state update wants q, k, g as [K, 1] columns: a row
becomes one by a select against the identity and a lane sum (no transpose in the kernel), and the
backward's dq, dk, dg columns become rows the same way, by a sublane sum.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda import _mosaic_tpu as tpu
from kda._vma import unchecked
from kda.stages.short import NAME, Out, _tile

F32 = tpu.F32


@dataclasses.dataclass(frozen=True)
class Config:
  """heads: BN, sequences per program (the largest divisor of N at most this whose BN * S rows are
  a multiple of 8; else N is padded to a multiple of 8)."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)

  def __post_init__(self):
    tpu.check_config(self)


def _per_program(N, S, most):
  for bn in range(min(most, N), 0, -1):
    if N % bn == 0 and (bn * S) % 8 == 0:
      return bn, N
  bn = max(8 // _gcd8(S), 1)
  return bn, -(-N // bn) * bn


def _gcd8(S):
  g = 8
  while S % g:
    g //= 2
  return g


def _budget(BN, S, K, V, backward, gen):
  rows = lambda D: ((None, BN * S, D), F32)
  states = ((BN, None, K, V), F32)
  blocks = [rows(K)] * 3 + [rows(V), rows(1), states] + [states]
  if backward:
    blocks += [rows(V), states, rows(K), rows(K), rows(V), rows(K), rows(1)]
  temps = [((K, V), F32)] * 6 + [((K, K), F32)] * 2
  return tpu.budget(blocks, [], temps, gen)


def supports(q, k, v, g, beta, h0, lens=None, *, scale, skip=False, config=None):
  config = config or Config()
  N, S, HV, K = q.shape
  V = v.shape[-1]
  gen = tpu.generation()
  BN, _ = _per_program(N, S, config.heads)
  return tpu.budget_reason(f"kda_{NAME}", _budget(BN, S, K, V, True, gen), gen)


def _eye(K):
  return tpu.iota((K, K), 0) == tpu.iota((K, K), 1)


def _col(row, eye):
  """[1, K] -> [K, 1]."""
  return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def _row(col, eye):
  """[K, 1] -> [1, K]."""
  return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def _token(r, refs, eye):
  """Row r's inputs: q, k, g as [K, 1] columns, v [1, V], beta [1, 1]."""
  q_ref, k_ref, v_ref, g_ref, b_ref = refs
  at = pl.ds(r, 1)
  return (_col(q_ref[at, :], eye), _col(k_ref[at, :], eye), v_ref[at, :], _col(g_ref[at, :], eye),
          b_ref[at, :])


def _fwd_kernel(lens_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, ht_ref, *, scale, steps):
  refs = (q_ref, k_ref, v_ref, g_ref, b_ref)
  BN, K = h0_ref.shape[0], h0_ref.shape[1]
  eye = _eye(K)
  for j in range(BN):
    n = lens_ref[pl.program_id(1) * BN + j]
    base = j * steps

    def body(i, S, base=base):
      S, *_, o = _tile.step(S, *_token(base + i, refs, eye), scale)
      o_ref[pl.ds(base + i, 1), :] = o
      return S

    ht_ref[j] = lax.fori_loop(0, n, body, h0_ref[j])
    _tile.zero_rows(base + n, base + steps, (o_ref,))


def _bwd_kernel(lens_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, do_ref, dht_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, *, scale, steps):
  refs = (q_ref, k_ref, v_ref, g_ref, b_ref)
  BN, K = h0_ref.shape[0], h0_ref.shape[1]
  eye = _eye(K)
  rowsum = lambda x: _row(jnp.sum(x, axis=1, keepdims=True), eye)      # [K, V] -> [1, K]
  for j in range(BN):
    n = lens_ref[pl.program_id(1) * BN + j]
    base = j * steps

    def back(r, dS, j=j, n=n, base=base):
      i = n - 1 - r
      at = pl.ds(base + i, 1)
      S = lax.fori_loop(0, i, lambda t, S: _tile.step(S, *_token(base + t, refs, eye), scale)[0], h0_ref[j])
      dS, dq, dk, dg, dv, db = _tile.step_back(S, *_token(base + i, refs, eye), do_ref[at, :], dS, scale, rowsum)
      dq_ref[at, :], dk_ref[at, :], dg_ref[at, :], dv_ref[at, :], db_ref[at, :] = dq, dk, dg, dv, db
      return dS

    dh0_ref[j] = lax.fori_loop(0, n, back, dht_ref[j])
    _tile.zero_rows(base + n, base + steps, (dq_ref, dk_ref, dv_ref, dg_ref, db_ref))


def apply(q, k, v, g, beta, h0, lens=None, *, scale, skip=False, interpret=False, config=None):
  lens = _tile.step_count(lens, *q.shape[:2])
  return Out(*_short(q, k, v, g, beta, h0, lens, float(scale), interpret, config or Config()))


def _heads_first(x, Np):
  """[N, S, HV, D] -> [HV, Np * S, D] float32 (sequences N.. of zeros)."""
  x = jnp.pad(x.astype(F32), [(0, Np - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return jnp.transpose(x, (2, 0, 1, 3)).reshape(x.shape[2], -1, x.shape[3])


def _from_heads(x, N, S):
  """[HV, Np * S, D] -> [N, S, HV, D]."""
  HV, _, D = x.shape
  return jnp.transpose(x.reshape(HV, -1, S, D), (1, 2, 0, 3))[:N]


def _padded_states(x, Np):
  return x.astype(F32) if Np == x.shape[0] else jnp.pad(x.astype(F32), [(0, Np - x.shape[0])] + [(0, 0)] * 3)


def _call(kernel, backward, ins, N, S, HV, K, V, scale, interpret, config):
  """Launches `kernel` over (HV, Np / BN); ins: lens [Np] then the head-first rows and states."""
  BN, Np = _per_program(N, S, config.heads)
  gen = tpu.generation()
  rows = lambda D: pl.BlockSpec((None, BN * S, D), lambda h, p, lens: (h, p, 0))
  states = pl.BlockSpec((BN, None, K, V), lambda h, p, lens: (p, h, 0, 0))
  spec = {"K": rows(K), "V": rows(V), "1": rows(1), "S": states}
  in_kinds = "KKVK1S" + ("VS" if backward else "")
  out_kinds = "KKVK1S" if backward else "VS"
  shapes = {"K": (HV, Np * S, K), "V": (HV, Np * S, V), "1": (HV, Np * S, 1), "S": (Np, HV, K, V)}

  def run(*a):
    return pl.pallas_call(
        functools.partial(kernel, scale=scale, steps=S),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(HV, Np // BN), in_specs=[spec[c] for c in in_kinds],
            out_specs=[spec[c] for c in out_kinds]),
        out_shape=[tpu.struct(shapes[c], F32, *a) for c in out_kinds],
        compiler_params=tpu.compiler_params(("parallel", "parallel"), _budget(BN, S, K, V, backward, gen),
                                            config.vmem_limit),
        interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}")(*a)
  return unchecked(run, *ins) if interpret else run(*ins)


def _forward(q, k, v, g, beta, h0, lens, scale, interpret, config):
  N, S, HV, K = q.shape
  V = v.shape[-1]
  _, Np = _per_program(N, S, config.heads)
  lens_p = jnp.pad(lens, (0, Np - N))
  rows = [_heads_first(x, Np) for x in (q, k, v, g, beta[..., None])]
  o, ht = _call(_fwd_kernel, False, (lens_p, *rows, _padded_states(h0, Np)), N, S, HV, K, V, scale,
                interpret, config)
  return _from_heads(o, N, S), ht[:N]


def _backward(scale, interpret, config, res, cts):
  q, k, v, g, beta, h0, lens = res
  do, dht = cts
  N, S, HV, K = q.shape
  V = v.shape[-1]
  _, Np = _per_program(N, S, config.heads)
  rows = [_heads_first(x, Np) for x in (q, k, v, g, beta[..., None])]
  ins = (jnp.pad(lens, (0, Np - N)), *rows, _padded_states(h0, Np), _heads_first(do, Np),
         _padded_states(dht, Np))
  dq, dk, dv, dg, db, dh0 = _call(_bwd_kernel, True, ins, N, S, HV, K, V, scale, interpret, config)
  back = lambda x, like: _from_heads(x, N, S).astype(like.dtype)
  return (back(dq, q), back(dk, k), back(dv, v), back(dg, g), back(db, beta)[..., 0],
          dh0[:N].astype(h0.dtype))


_short = _tile.with_vjp(_forward, _backward)
