"""short: the Pallas kernels, Triton lowering (any CUDA GPU); the math is in kda.stages.short.

Grid (N, HV, V tiles): one program per sequence, head and tile of BV state columns keeps its
[K, BV] float32 state on chip for the sequence's lens[n] steps (the others are identities it skips,
writing zeros), so the state is read and written once per call. The forward stores o and the final
state. The backward walks the steps in reverse, recomputing the state entering step t from h0
(n(n+1)/2 steps: n is a few tokens) rather than storing n states. The
columns of a state are independent in every step (the reductions over K), the rows are not (dq, dk,
dg, dbeta sum over V), so with several V tiles those four are per-tile sums added after the kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kda import _pallas
from kda._vma import out_struct, unchecked
from kda.stages.short import NAME, Out, _tile

# A program's tile: K x BV float32 state; the backward holds four such tiles (the state, Sd, S' and
# the cotangent), so 4096 elements keep them in 128 registers a thread at four warps.
TILE = 4096


@dataclasses.dataclass(frozen=True)
class Config:
  block_v: int | None = None   # BV: state columns per program; None: TILE // K (a power of two)
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    _pallas.check_config(self)


def _block_v(config, Kp, Vp):
  return min(Vp, config.block_v or max(1, TILE // Kp))


def supports(q, k, v, g, beta, h0, lens=None, *, scale, skip=False, config=None):
  config = config or Config()
  Kp, Vp = _pallas.next_pow2(q.shape[-1]), _pallas.next_pow2(v.shape[-1])
  BV = _block_v(config, Kp, Vp)
  regs = 4 * Kp * BV // (32 * config.num_warps)
  if regs > 255:
    return (f"short's pallas kernel holds four [K, BV] = [{Kp}, {BV}] float32 tiles: {regs} registers a "
            f"thread at {config.num_warps} warps, over 255")
  return None


def _token(i, q_ref, k_ref, v_ref, g_ref, b_ref):
  """Step i's inputs: q, k, g as [K, 1] columns, v [1, BV], beta [1, 1]."""
  row = pl.ds(i, 1)
  col = lambda ref: jnp.transpose(ref[row, :])
  return col(q_ref), col(k_ref), v_ref[row, :], col(g_ref), b_ref[row, :]


def _fwd_kernel(lens_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, ht_ref, *, scale):
  refs = (q_ref, k_ref, v_ref, g_ref, b_ref)
  n = lens_ref[pl.program_id(0)]

  def body(i, S):
    S, *_, o = _tile.step(S, *_token(i, *refs), scale)
    o_ref[pl.ds(i, 1), :] = o
    return S

  ht_ref[...] = lax.fori_loop(0, n, body, h0_ref[...])
  _tile.zero_rows(n, o_ref.shape[0], (o_ref,))


def _bwd_kernel(lens_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, do_ref, dht_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, *, scale):
  refs = (q_ref, k_ref, v_ref, g_ref, b_ref)
  n = lens_ref[pl.program_id(0)]
  rowsum = lambda x: jnp.transpose(jnp.sum(x, axis=1, keepdims=True))     # [K, BV] -> [1, K]

  def back(r, dS):
    i = n - 1 - r
    row = pl.ds(i, 1)
    S = lax.fori_loop(0, i, lambda j, S: _tile.step(S, *_token(j, *refs), scale)[0], h0_ref[...])
    dS, dq, dk, dg, dv, db = _tile.step_back(S, *_token(i, *refs), do_ref[row, :], dS, scale, rowsum)
    dq_ref[row, :], dk_ref[row, :], dg_ref[row, :], dv_ref[row, :], db_ref[row, :] = dq, dk, dg, dv, db
    return dS

  dh0_ref[...] = lax.fori_loop(0, n, back, dht_ref[...])
  _tile.zero_rows(n, dq_ref.shape[0], (dq_ref, dk_ref, dv_ref, dg_ref, db_ref))


def apply(q, k, v, g, beta, h0, lens=None, *, scale, skip=False, interpret=False, config=None):
  lens = _tile.step_count(lens, *q.shape[:2])
  return Out(*_short(q, k, v, g, beta, h0, lens, float(scale), bool(interpret), config or Config()))


def _specs(N, S, HV, Kp, Vp, BV):
  keys = pl.BlockSpec((None, S, None, Kp), lambda n, h, j: (n, 0, h, 0))
  vals = pl.BlockSpec((None, S, None, BV), lambda n, h, j: (n, 0, h, j))
  betas = pl.BlockSpec((None, S, None, 1), lambda n, h, j: (n, 0, h, 0))
  states = pl.BlockSpec((None, None, Kp, BV), lambda n, h, j: (n, h, 0, j))
  partial = lambda d: pl.BlockSpec((None, None, S, None, d), lambda n, h, j: (j, n, 0, h, 0))
  seqs = pl.BlockSpec((N,), lambda n, h, j: (0,))
  return seqs, keys, vals, betas, states, partial


def _padded(q, k, v, g, beta, h0):
  """Feature dims to powers of two (Triton tiles), beta as [N, S, HV, 1], all float32."""
  f32 = jnp.float32
  Kp, Vp = _pallas.next_pow2(q.shape[-1]), _pallas.next_pow2(v.shape[-1])
  q, k, g = (_pallas.pad_dim(x.astype(f32), 3, Kp) for x in (q, k, g))
  v = _pallas.pad_dim(v.astype(f32), 3, Vp)
  h0 = _pallas.pad_dim(_pallas.pad_dim(h0.astype(f32), 2, Kp), 3, Vp)
  return q, k, v, g, beta.astype(f32)[..., None], h0


def _launch(kernel, interpret, config, ins, out_specs, out_shapes, in_specs, grid):
  call = lambda *a: pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=[out_struct(s, jnp.float32, *a) for s in out_shapes],
      compiler_params=None if interpret else _pallas.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret, name=f"kda_{NAME}")(*a)
  return unchecked(call, *ins) if interpret else call(*ins)


def _forward(q, k, v, g, beta, h0, lens, scale, interpret, config):
  N, S, HV, K = q.shape
  V = v.shape[-1]
  ins = _padded(q, k, v, g, beta, h0)
  Kp, Vp = ins[0].shape[-1], ins[2].shape[-1]
  BV = _block_v(config, Kp, Vp)
  seqs, keys, vals, betas, states, _ = _specs(N, S, HV, Kp, Vp, BV)
  o, ht = _launch(functools.partial(_fwd_kernel, scale=scale), interpret, config, (lens,) + ins,
                  [vals, states], [(N, S, HV, Vp), (N, HV, Kp, Vp)],
                  [seqs, keys, keys, vals, keys, betas, states], (N, HV, Vp // BV))
  return o[..., :V], ht[..., :K, :V]


def _backward(scale, interpret, config, res, cts):
  q, k, v, g, beta, h0, lens = res
  do, dht = cts
  N, S, HV, K = q.shape
  V = v.shape[-1]
  ins = _padded(q, k, v, g, beta, h0)
  Kp, Vp = ins[0].shape[-1], ins[2].shape[-1]
  BV = _block_v(config, Kp, Vp)
  nV = Vp // BV
  ins += (_pallas.pad_dim(do.astype(jnp.float32), 3, Vp),
          _pallas.pad_dim(_pallas.pad_dim(dht.astype(jnp.float32), 2, Kp), 3, Vp))
  seqs, keys, vals, betas, states, partial = _specs(N, S, HV, Kp, Vp, BV)
  dq, dk, dv, dg, db, dh0 = _launch(
      functools.partial(_bwd_kernel, scale=scale), interpret, config, (lens,) + ins,
      [partial(Kp), partial(Kp), vals, partial(Kp), partial(1), states],
      [(nV, N, S, HV, Kp), (nV, N, S, HV, Kp), (N, S, HV, Vp), (nV, N, S, HV, Kp), (nV, N, S, HV, 1),
       (N, HV, Kp, Vp)],
      [seqs, keys, keys, vals, keys, betas, states, vals, states], (N, HV, nV))
  tiles = lambda x: jnp.sum(x, axis=0)     # the V tiles' partial sums
  cast = lambda x, like: x.astype(like.dtype)
  return (cast(tiles(dq)[..., :K], q), cast(tiles(dk)[..., :K], k), cast(dv[..., :V], v),
          cast(tiles(dg)[..., :K], g), cast(tiles(db)[..., 0], beta), cast(dh0[..., :K, :V], h0))


_short = _tile.with_vjp(_forward, _backward)
