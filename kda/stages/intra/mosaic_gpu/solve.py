"""intra's solve kernel (Pallas Mosaic GPU): Ainv = (I + Akk)^-1 and w, u per (value head, chunk).

Grid (HV, NTa), one warpgroup per program. TMA brings Akk's hi + lo bf16 split (the scores
kernel's), kd and v [64, V] (bf16) and beta into SMEM. (I + Akk)^-1 by block doubling:

    X_1 = I - (Akk's 2x2 diagonal blocks),   X_2s = X_s - X_s T_s,   T_s = L_2s X_s

where L_2s holds Akk's pairs of level 2s (i in a 2s-block's second half, j in its first), for
s = 2, 4, ..., 32. Akk's split stays in SMEM for the whole doubling and T_s is the level's mask of
Akk @ X_s (X_s is block-diagonal, so Akk's other entries meet exact zeros); X lives in SMEM only,
as its bf16 split, and each level reads X_s back as hi + lo (X to ~2^-18 relative), so no X is
held in registers across the wgmmas. Each product takes hi + lo bf16 splits of both operands
(three wgmmas, ~2^-16 relative). Then w = X kd and u = X (beta v) take X's split (two wgmmas each)
and bf16 right-hand sides; Ainv is X's high part. SMEM: 82952 bytes at K = V = 128, two CTAs per SM.

defer (kda.fused.state_output's inverse mode): no kd in, no w, u out; X's low part and beta v are
stored instead (the state + output kernel applies X): 66568 bytes, and 168 registers (H200
ptxas), so three CTAs per SM.

Packed inputs: v and beta stay packed; v lands by TMA at its packed row in a plain tile that X's
split takes over once it has been read (a RefUnion: no extra SMEM), rows past the chunk's count
are masked by a select; beta is read from GMEM. Chunks at or past aligned_cu[-1] are only written
(Ainv = I, w = u = 0).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32, ROW, WG, live_chunk
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda._mosaic_gpu import params as _params, smem_bytes as _smem_bytes
from kda.stages.intra.mosaic_gpu.scores import beta_rows

BT = 64


def _log2(n):
  return n.bit_length() - 1


def _body(cu_g, *refs, packed, tail_zeros=True, defer=False):
  """Per (head, chunk): X = (I + Akk)^-1 by block doubling, w = X kd, u = X (beta v).
  packed: v and beta come packed, v lands in plain SMEM (`vl_s`) at the chunk's packed row.
  defer (kda.fused.state_output's inverse mode): no kd, w, u; X's split (hi, lo) and beta v (bf16)
  are stored instead, and the state + output kernel applies X: v_new = X (beta v - kd S)."""
  if packed:
    src_g, cnt_g, *refs = refs
  if defer:
    akh_g, akl_g, v_g, b_g, ainv_g, ainvl_g, bv_g, a_u, v_s, x_u, b_s, bar = refs
    kd_g = kd_s = None
  else:
    akh_g, akl_g, kd_g, v_g, b_g, ainv_g, w_g, u_g, a_u, kd_s, v_s, x_u, b_s, bar = refs
  (ah_s, al_s), (th_s, tl_s) = a_u      # Akk's split, T's
  if packed:
    (vl_s,), (xh_s, xl_s) = x_u         # v's landing zone is read once, then X's split takes it
  else:
    xh_s, xl_s = x_u
  V = v_g.shape[2]
  i_h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)

  def compute():
    plgpu.copy_gmem_to_smem(akh_g.at[rows, i_h, :], ah_s, bar)
    plgpu.copy_gmem_to_smem(akl_g.at[rows, i_h, :], al_s, bar)
    if not defer:
      plgpu.copy_gmem_to_smem(kd_g.at[rows, i_h, :], kd_s, bar)
    if packed:
      src, cnt = src_g[c], cnt_g[c]
      plgpu.copy_gmem_to_smem(v_g.at[pl.ds(src, BT), i_h, :], vl_s, bar)
      beta = beta_rows(b_g, i_h, rows, src, cnt)((BT, V))
    else:
      plgpu.copy_gmem_to_smem(v_g.at[rows, i_h, :], v_s, bar)
      plgpu.copy_gmem_to_smem(b_g.at[i_h, rows], b_s, bar)
    plgpu.barrier_wait(bar)
    row, col = _iota(0, (BT, BT)), _iota(1, (BT, BT))
    a_kk = _load(ah_s).astype(F32) + _load(al_s).astype(F32)
    if packed:      # rows past cnt: beta is 0 there, and a select keeps their v (maybe NaN) out
      real = _iota(0, (BT, V)) < cnt
      v_s[...] = jnp.where(real, beta * _load(vl_s).astype(F32), 0.0).astype(BF16)
    else:
      beta = lax.broadcast_in_dim(_load(b_s, ROW), (BT, V), [0])
      v_s[...] = (beta * _load(v_s).astype(F32)).astype(BF16)
    plgpu.commit_smem()   # also a warpgroup barrier: vl is read before X's split takes its bytes
    if defer:       # beta v leaves now: its store runs under the doubling
      plgpu.copy_smem_to_gmem(v_s, bv_g.at[rows, i_h, :])

    def x_times(T):
      """X_s @ T from X's split in xh_s, xl_s and T's, written to th_s, tl_s."""
      th_s[...], tl_s[...] = _split(T)
      plgpu.commit_smem()
      return _acc([(xh_s, th_s), (xh_s, tl_s), (xl_s, th_s)], (BT, BT))

    eye = jnp.where(row == col, 1.0, 0.0).astype(F32)
    X = eye - jnp.where((row >> 1) == (col >> 1), a_kk, 0.0)
    xh_s[...], xl_s[...] = _split(X)
    plgpu.commit_smem()
    for s in (2, 4, 8, 16, 32):
      half = _log2(s)
      level = (((row >> (half + 1)) == (col >> (half + 1))) & (((row >> half) & 1) == 1)
               & (((col >> half) & 1) == 0))                  # (i, j): i in a 2s-block's second half, j in its first
      T = jnp.where(level, _acc([(ah_s, xh_s), (ah_s, xl_s), (al_s, xh_s)], (BT, BT)), 0.0)  # L @ X
      XT = x_times(T)
      X = _load(xh_s).astype(F32) + _load(xl_s).astype(F32) - XT
      xh_s[...], xl_s[...] = _split(X)
      plgpu.commit_smem()
    if not defer:
      w = _acc([(xh_s, kd_s), (xl_s, kd_s)], (BT, kd_s.shape[1]))
      u = _acc([(xh_s, v_s), (xl_s, v_s)], (BT, V))
      kd_s[...] = w.astype(BF16)
      v_s[...] = u.astype(BF16)
      plgpu.commit_smem()
  live = live_chunk(cu_g, c, BT)
  pl.when(live)(compute)

  @pl.when(jnp.logical_not(live))
  def _():                                      # tail: Ainv = I, w = u = 0
    row, col = _iota(0, (BT, BT)), _iota(1, (BT, BT))
    xh_s[...] = jnp.where(row == col, 1.0, 0.0).astype(BF16)
    if defer:
      xl_s[...] = plgpu.layout_cast(jnp.zeros((BT, BT), BF16), WG)
    if tail_zeros:
      if not defer:
        kd_s[...] = plgpu.layout_cast(jnp.zeros(kd_s.shape, BF16), WG)
      v_s[...] = plgpu.layout_cast(jnp.zeros((BT, V), BF16), WG)
    plgpu.commit_smem()

  def store_wu():
    if defer:
      plgpu.copy_smem_to_gmem(xl_s, ainvl_g.at[rows, i_h, :])
      pl.when(jnp.logical_not(live))(lambda: plgpu.copy_smem_to_gmem(v_s, bv_g.at[rows, i_h, :]))
      return
    plgpu.copy_smem_to_gmem(kd_s, w_g.at[rows, i_h, :])
    plgpu.copy_smem_to_gmem(v_s, u_g.at[rows, i_h, :])

  plgpu.copy_smem_to_gmem(xh_s, ainv_g.at[rows, i_h, :])   # Ainv, a residual: I at the tail always
  if tail_zeros:
    store_wu()
  else:           # the tail's w, u left unwritten: only the state kernel reads them, never there
    pl.when(live)(store_wu)
  plgpu.wait_smem_to_gmem(0)


def scratch(K, V, *, packed, defer):
  """The kernel's scratch_types: Akk's split and T's [64, 64] (swizzled), kd [64, K] (not defer),
  v [64, V], X's split (packed: in a RefUnion with v's plain landing tile), beta [64] f32, the
  barrier of the loads."""
  x = [_swz((BT, BT)), _swz((BT, BT))]
  return [
      [[_swz((BT, BT)), _swz((BT, BT))], [_swz((BT, BT)), _swz((BT, BT))]],   # Akk's split, T's
      *([] if defer else [_swz((BT, K))]), _swz((BT, V)),
      plgpu.RefUnion([plgpu.SMEM((BT, V), BF16)], x) if packed else x,       # v landing | X
      plgpu.SMEM((BT,), F32),
      plgpu.Barrier(num_arrivals=(4 if packed else 5) - defer),
  ]


def smem_bytes(K, V, *, packed=False, defer=False):
  """The SMEM the kernel asks for (as lowered for CUDA)."""
  return _smem_bytes(scratch(K, V, packed=packed, defer=defer))


def launch(cu, rows, akh, akl, kd, v, beta_t, *, approx_math, interpret, tail_zeros=True, defer=False):
  """akh, akl [Ta, HV, 64], kd [Ta, HV, K], v [Ta or T, HV, V] bf16, beta_t [HV, Ta] (packed:
  [HV, T + BT]) float32 -> (Ainv, w, u) [Ta, HV, *] bf16; defer (kd None): (Ainv, Ainv's low bf16
  part, beta v)."""
  HV, V = v.shape[1], v.shape[-1]
  Ta = akh.shape[0]
  packed = rows is not None
  K = None if defer else kd.shape[-1]
  shape = lambda d: jax.ShapeDtypeStruct((Ta, HV, d), BF16)
  outs = (shape(BT), shape(BT), shape(V)) if defer else (shape(BT), shape(K), shape(V))
  f = plgpu.kernel(
      functools.partial(_body, packed=packed, tail_zeros=tail_zeros, defer=defer),
      out_type=outs,
      grid=(HV, Ta // BT), grid_names=("h", "c"),
      scratch_types=scratch(K, V, packed=packed, defer=defer),
      compiler_params=_params(False, approx_math=approx_math),
      kernel_name="kda_intra_solve_x" if defer else "kda_intra_solve",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return f(cu, *(() if rows is None else rows), akh, akl, *(() if defer else (kd,)), v, beta_t)
