"""bwd_wy's split kernel (Config.split, K == V): one program per (slab p, value head h, chunk c).

Program p takes the 64 columns p of K and of V (the in-order kernel's K slab p and V slab p), so
K / 64 programs share a chunk. Every operand of its slab arrives by TMA at the start, in three
groups on their own barriers in the order of first use, so the first products run while the later
operands are in flight:

    0: du (float32), Ainv, v             dvb = Ainv^T du, dv, vb = beta v, dAinv_p = du vb^T
    1: dw, gc_int, gc_frac (float32), k, q  dkb = Ainv^T dw, eg, kb = beta k eg, dAinv_p += dw kb^T,
                                         dAkk_p
    2: dqg, dkg (float32)                dq, dk, el, dgc, dg_state = L (dkg kg) + dgc_last

with the in-order kernel's formulas and operand splits (kda.stages.bwd_wy.mosaic_gpu). dAinv is a
sum over every slab and dAkk = strict_tril(-Ainv^T dAinv Ainv^T) is linear in it, so each program
stores its own part dAkk_p (and its part of dbeta) and the launcher adds the K / 64 parts (XLA):
the same math, float32 sums associated by slab. dAkk_p is formed before S2's terms are read, gc is
read again from its landing where el needs it and kb formed again (the same bits), so no dAinv,
gc or kb array is held across the products: ptxas (sm_90a, the pipeline's packed call) spills
nothing at 252-255 registers per thread. In place as the in-order kernel: each operand of
the slab has landed (its barrier waited) before the outputs that share its buffer are written.

SMEM per program (`smem_bytes`): q, k, v, Ainv, four work tiles and L ([64, 64] bf16, 8 KiB each),
six [64, 64] float32 landings (96 KiB), the reduction scratch and three barriers: 172168 bytes,
one CTA per SM.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, COL, F32, ROW, last_row, packed_tile, pair_tile, term_store, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda._mosaic_gpu import smem_bytes as _smem_bytes
from kda.stages.gate import exponent

BT = SLAB = 64
# TMA copies per barrier: (du, Ainv, v), (dw, gc_int, gc_frac, k, q), (dqg, dkg); defer_qg: no q, dqg
GROUPS = {False: (3, 5, 2), True: (3, 4, 1)}


def scratch(stage_dtype=None, du_bf16=False, packed_qkv=False, pairs=False, defer_qg=False):
  """The split kernel's scratch types; stage_dtype: packed dv's plain stage (None: aligned); du_bf16:
  du's landing in bf16; packed_qkv: plain q, k, v tiles (packed rows land there); pairs: dqg's and
  dkg's landings take their pairs (hi rows, then lo rows: the same bytes); defer_qg: no q tile and
  no dqg landing."""
  tile = (lambda: plgpu.SMEM((BT, SLAB), BF16)) if packed_qkv else (lambda: _swz((BT, SLAB)))
  term = lambda: plgpu.SMEM((2 * BT, SLAB), BF16) if pairs else plgpu.SMEM((BT, SLAB), F32)
  return [
      *([] if defer_qg else [tile()]), tile(), tile(),                    # q, k, v
      _swz((BT, BT)),                                                     # Ainv
      plgpu.SMEM((BT, SLAB), BF16 if du_bf16 else F32),                   # du
      *[plgpu.SMEM((BT, SLAB), F32) for _ in range(3)],                   # dw, gc_int, gc_frac
      *([] if defer_qg else [term()]), term(),                            # dqg, dkg
      *[_swz((BT, SLAB)) for _ in range(4)],                              # work tiles
      _swz((BT, BT)),                                                     # L
      *[plgpu.Barrier(num_arrivals=n) for n in GROUPS[defer_qg]],
      *([] if stage_dtype is None else [plgpu.SMEM((BT, SLAB), stage_dtype)]),
  ]


def smem_bytes(stage_dtype=None, du_bf16=False, packed_qkv=False, defer_qg=False):
  """Shared memory per program (the body's dbeta row sums reserve the reduction scratch; pairs
  take the float32 landings' bytes)."""
  return _smem_bytes(scratch(stage_dtype, du_bf16, packed_qkv, defer_qg=defer_qg), reduction=True)


def ainv_chain(put, dAinv, aT, tiles, shape):
  """Ainv^T (dAinv Ainv^T) on the tensor cores, each float32 operand put in two bf16 terms (`put`
  into two of the four work tiles); dAkk = strict_tril(-that)."""
  t0, t1, t2, t3 = tiles
  put(dAinv, t0, t1)
  pa = _acc([(t0, aT), (t1, aT)], shape)                     # dAinv @ Ainv^T
  put(pa, t2, t3)
  return _acc([(aT, t2), (aT, t3)], shape)                   # Ainv^T @ that


def body(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, dqg_g, dkg_g, dw_g, du_g, dgl_g,
         oq_g, ok_g, ov_g, odb_g, og_g, ogs_g, oa_g, *scratch,
         store_dv=None, ct=1, qkv_rows=None, pairs=False, defer_qg=False):
  """Program (p, h, c); odb_g [P, HV, Ta] and oa_g [P, Ta, HV, 64] take its parts of dbeta, dAkk.
  qkv_rows (src, count): q, k, v are packed (kda._mosaic_gpu.packed_tile); pairs: dqg, dkg (and dq,
  dk over them) are pair refs (kda._mosaic_gpu.pair_load); defer_qg: dqg_g and oq_g are None, q
  and dqg are not read and dq is not formed (the in-order kernel's `defer_qg`)."""
  if defer_qg:
    (k_s, v_s, a_s, du_s, dw_s, gi_s, gf_s, dkg_s, t0, t1, t2, t3, l_s, *bars) = scratch
    q_s = dqg_s = None
  else:
    (q_s, k_s, v_s, a_s, du_s, dw_s, gi_s, gf_s, dqg_s, dkg_s, t0, t1, t2, t3, l_s, *bars) = scratch
  p, h, c = lax.axis_index("p"), lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  cols = pl.ds(pl.multiple_of(p * SLAB, SLAB), SLAB)
  at = lambda ref: ref.at[rows, h, cols]
  pair_at = lambda ref: ref.at[c, h, :, cols]      # a pair's tile: hi rows, then lo rows
  qkv = (lambda ref: ref.at[pl.ds(qkv_rows[0], BT), h, cols]) if qkv_rows is not None else at
  term_at = pair_at if pairs else at
  rows_at = lambda ref: ref.at[rows, h, :]
  groups = (((at, du_g, du_s), (rows_at, a_g, a_s), (qkv, v_g, v_s)),
            ((at, dw_g, dw_s), (at, gi_g, gi_s), (at, gf_g, gf_s), (qkv, k_g, k_s), (qkv, q_g, q_s)),
            ((term_at, dqg_g, dqg_s), (term_at, dkg_g, dkg_s)))
  groups = tuple(tuple((src(ref), dst) for src, ref, dst in group if dst is not None) for group in groups)
  for bar, group in zip(bars, groups):
    for src, dst in group:
      plgpu.copy_gmem_to_smem(src, dst, bar)

  shape = (BT, SLAB)
  row, col = _iota(0, shape), _iota(1, shape)
  strict = col < row
  l_s[...] = jnp.where(strict, 1.0, 0.0).astype(BF16)       # L: the exclusive row cumsum
  beta = lax.broadcast_in_dim(_load(b_g.at[h, rows], ROW), shape, [0])

  def put(x, *tiles):
    for t, part in zip(tiles, _split(x, len(tiles))):
      t[...] = part
    plgpu.commit_smem()

  aT = a_s.T
  cts = (t0, t1)[:ct]                # the cotangent's bf16 terms
  cross = [(t0, t2.T), (t0, t3.T)] + ([(t1, t2.T)] if ct == 2 else [])   # (du or dw) @ (vb or kb)^T

  plgpu.barrier_wait(bars[0])
  put(_load(du_s), *cts)                                     # du
  dvb = _acc([(aT, t) for t in cts], shape)
  vx = packed_tile(v_s, row, qkv_rows)
  if store_dv is None:
    ov_g[rows, h, cols] = (dvb * beta).astype(ov_g.dtype)
  else:
    store_dv(dvb * beta)
  dbeta = jnp.sum(dvb * vx, axis=1)
  put(beta * vx, t2, t3)                                     # vb
  dAinv = _acc(cross, shape)
  plgpu.barrier_wait(bars[1])
  put(_load(dw_s), *cts)                                     # dw
  dkb = _acc([(aT, t) for t in cts], shape)
  eg = jnp.exp(exponent(_load(gi_s), _load(gf_s)))
  kx = packed_tile(k_s, row, qkv_rows)
  keg = kx * eg
  dbeta = dbeta + jnp.sum(dkb * keg, axis=1)
  put(beta * keg, t2, t3)                                    # kb
  dAinv = dAinv + _acc(cross, shape)
  # dAkk's part first, so dAinv and the products' arrays are gone before S2's terms are read
  oa_g[p, rows, h, :] = jnp.where(strict, -ainv_chain(put, dAinv, aT, (t0, t1, t2, t3), shape), 0.0)
  odb_g[p, h, rows] = dbeta
  plgpu.barrier_wait(bars[2])
  term = pair_tile if pairs else _load
  store = lambda o_g, x: term_store(o_g, c, h, rows, cols, x, pairs)
  kb = beta * (kx * eg)            # formed again (the same bits) rather than held through the products
  if defer_qg:                     # S4 forms dq = dqg eg and adds dqg q eg to dgc
    og_g[rows, h, cols] = dkb * kb
  else:
    dqg = term(dqg_s)
    store(oq_g, dqg * eg)
    og_g[rows, h, cols] = dqg * packed_tile(q_s, row, qkv_rows) * eg + dkb * kb
  dkg = term(dkg_s)
  el = jnp.exp(exponent(last_row(gi_g, c, h, cols, shape), last_row(gf_g, c, h, cols, shape),
                        _load(gi_s), _load(gf_s)))     # gc read again from its landing, not held
  store(ok_g, dkg * el + dkb * beta * eg)
  put(dkg * (kx * el), t0, t1, t2)                           # dkg kg, in three terms
  before = _acc([(l_s, t0), (l_s, t1), (l_s, t2)], shape)
  dgl = _load(dgl_g.at[c, h, cols], COL)
  ogs_g[rows, h, cols] = before + lax.broadcast_in_dim(dgl, shape, [1])


def zeros_body(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, dqg_g, dkg_g, dw_g, du_g, dgl_g,
               oq_g, ok_g, ov_g, odb_g, og_g, ogs_g, oa_g, *scratch, dv=True, pairs=False):
  """A tail chunk's zeros at program (p, h, c)'s slab (dv's too unless packed), nothing read."""
  p, h, c = lax.axis_index("p"), lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  cols = pl.ds(pl.multiple_of(p * SLAB, SLAB), SLAB)
  z = zeros((BT, SLAB))
  if dv:
    ov_g[rows, h, cols] = z.astype(ov_g.dtype)
  for o_g in (oq_g, ok_g, og_g, ogs_g):
    if o_g is None:                # defer_qg: no dq
      continue
    term_store(o_g, c, h, rows, cols, z, pairs and (o_g is oq_g or o_g is ok_g))
  oa_g[p, rows, h, :] = z
  odb_g[p, h, rows] = zeros((BT,), ROW)
