"""bwd_wy (S3): the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.bwd_wy.

One kernel, one program (one warpgroup) per (value head h, chunk c), grid (HV, NTa) with the chunks
on CUDA's grid x (no 65535 limit there). Nothing crosses chunks: every output of chunk c needs chunk
c's rows only. Per program, with a = Ainv's [64, 64] block (bf16, the dtype policy's residual):

- TMA: q, k (per 64-column slab of K), v (per slab of V) and a into swizzled bf16 tiles. The
  float32 operands (gc's two parts, S2's dqg, dkg, dw, du, dgc_last) are read from GMEM straight
  into registers (WGMMA layout), a slab at a time, and every result leaves from registers to GMEM.
- Per V slab: dvb = a^T @ du (a .T view of the a tile; du as a hi + lo split), dv = beta dvb,
  dbeta += sum(dvb v), and dAinv += du @ vb^T, vb = beta v (hi + lo splits, .T view).
- Per K slab: dkb = a^T @ dw, then eg = exp(gc), el = exp(gc_last - gc) (two-part exponents, both
  <= 0), dq = dqg eg, dk = dkg el + beta eg dkb, dgc = dqg q eg + dkb kb, dbeta += sum(dkb k eg),
  dAinv += dw @ kb^T, kb = beta k eg; and dg_state = L @ (dkg kg) + dgc_last with L the strictly
  lower [64, 64] ones matrix (the exclusive cumsum over the chunk's rows as one product; its
  operand split in three bf16 terms, ~2^-24 relative, so the gate gradient keeps float32 accuracy).
- Last: P = dAinv @ a^T, M = a^T @ P (each operand split, a exact), dAkk = strict_tril(-M).
The dAinv sum [64, 64] float32 stays in registers across the slabs, whose K part runs as a loop (not
unrolled: one slab's arrays live at a time; unrolled, ptxas spills four times the bytes at K = V =
128); the four work tiles that hold the split operands are reused by every product (reading an
accumulator waits for its wgmma). One warpgroup issues every load and wgmma in order: S2's float32
cotangents are read straight into registers, with no TMA prefetch. The next V slab's du, a K slab's
gc and dgc_last are issued while the tensor cores run the products before them
(kda._mosaic_gpu.acc's `during`), which costs no registers beyond what is live there;
Config.overlap_loads issues dqg, dkg and the next slab's dw that way too (more live registers).

In place: dq, dk, dgc (and dg_state where K == V and du is float32) are written into S2's dqg, dkg,
dw (du) buffers, which the kernel takes as mutable refs (aliased in and out): each program reads
those tiles of its chunk before it writes the same rows, and the backward's peak (S2's four terms
and S3's float32 results live together in this launch) loses four [Ta, HV, K] float32 buffers.
Where nothing else reads S2's terms, XLA writes the results into their buffers. A bf16 du (S2's
du_dtype, what the pipeline asks for with cotangent_terms=1, which rounds du to bf16 anyway) is read
as is: the same bits, half the bytes; dg_state then has a buffer of its own. With `pairs` dqg, dkg
come as S2's bf16 pairs (hi + lo per chunk and head, kda._mosaic_gpu.pair_load) and dq, dk leave as
theirs over them: float32 hi + lo in registers, the same arithmetic.

qg's cotangent deferred (`apply(..., defer_qg=True)`, where S4 runs its kernel: kda.steps.defer_qg_kw):
dq = dqg exp(gc) and dgc's term dqg q exp(gc) need nothing of this stage but gc, so S4's kernel
forms them (it has gc's tile in SMEM); this kernel then reads neither q nor dqg, stores no dq, and
each K slab holds one [64, 64] float32 array fewer in registers.

SMEM per program (`smem_bytes`): q, k (K / 64 tiles each), v (V / 64), a, four work tiles and L,
[64, 64] bf16 tiles of 8 KiB, the reduction scratch of dbeta's row sums and a barrier: 100360 bytes
at K = V = 128, two CTAs per SM.

Config.split (K == V): the split kernel (`split`, its own module): one program per (64-column slab,
head, chunk), each operand of its slab by TMA up front in three groups awaited in order of first
use, dbeta and dAkk stored per slab and added by the launcher; one CTA per SM.

Config.terms (K == V, the packed backward): the terms kernel (`fused`, its own module) forms S2's
terms in the split kernel's programs from the walk's dh and bf16 du, h, do and v_new, so S2's terms
kernel does not run (kda.fused.packed_backward.mosaic_gpu calls the two).

Precision: every float32 wgmma operand is a hi + lo bf16 split (three wgmmas: hi hi, hi lo, lo hi,
~2^-16 relative; one term less where a side is bf16-exact: a, L) but du and dw, which enter as one
bf16 term (2^-9) unless Config.cotangent_terms=2; float32 accumulation; the exponentials and sums
outside the tensor cores are float32 (Config.approx_math: ex2.approx, ~2^-22 relative). q, k, v and
Ainv enter as bf16 (`apply` rounds float32 ones; the predicate refuses them: their float32 accuracy
needs the reference). Padding and tail rows go through the same formulas as the reference.

Packed dv (`apply(..., rows=, pieces=, T=)`, what the pipeline's packed backward calls): the unalign
folds into dv's store. dv goes from registers to a plain [64, 64] SMEM stage in dv's dtype (8 KiB
more in bf16: still two CTAs per SM) and from there by TMA to packed rows src[c] + r, r < count[c]
(kda._mosaic_gpu.store_rows: one store per set bit of the count, so no row of another sequence is
written); program (h, c) then zeroes the gap pieces c, c + NTa, ... (padding.gap_pieces) of head h.
The other outputs, and the arithmetic, are the aligned kernel's.

The stage's predicate `supports` refuses what the kernel cannot run (chunk_size != 64, K or V not
64 / 128, shapes, non-float dtypes, HV > 65535, SMEM) with the reason, and float32 q, k, v, Ainv.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, COL, F32, MAX_GRID_YZ, ROW, aligned_cu_reason, last_row, skipping_tail
from kda._mosaic_gpu import clean_flag, packed_chunk, packed_tile, term_load, term_store, tile_shapes, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, params as _params, split as _split, swz as _swz
from kda._mosaic_gpu import smem_bytes as _smem_bytes, smem_reason
from kda.stages.bwd_wy import Out
from kda.stages.bwd_wy.mosaic_gpu import split
from kda.stages.gate import exponent

BT = 64
SLAB = 64                  # columns per tile


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the bwd_wy kernel."""
  approx_math: bool = True   # Mosaic GPU's fast exp (ex2.approx): ~2^-22 relative
  # with aligned_cu: the chunks at or past aligned_cu[-1] store zeros and read nothing
  skip_tail: bool = True
  # bf16 terms of the cotangent operands du, dw: 1 (rounded to bf16 once, 2^-9, as FLA rounds
  # them: one wgmma fewer in dvb, dkb and in each of their dAinv products) or 2 (hi + lo, ~2^-16).
  # 1 by default: on the H200 the gradients stay within 1.1x FLA's errors on identical inputs (dv,
  # dbeta move by a bf16 rounding) and shape B's forward + backward takes 0.965x the time of 2.
  # dAinv's own chain (dAkk) and dg_state keep their splits.
  cotangent_terms: int = 1
  # issue the loads of dqg, dkg and the next slab's dw too while the tensor cores run the products
  # before them, instead of after: the same bits, more registers live through the products (ptxas
  # spills more); off until timed on an H200 (tools.gpu_check_bwd times it beside the default)
  overlap_loads: bool = False
  # K == V: one program per (64-column slab, head, chunk), every operand of the slab by TMA up front
  # in three groups (kda.stages.bwd_wy.mosaic_gpu.split), dbeta summed over the slabs by XLA, dAkk
  # too unless `apply`'s dAkk_parts; one CTA per SM. overlap_loads does not apply there; K != V
  # runs the kernel above
  split: bool = False
  # K == V, in the packed backward where S2 runs its kernels: S3's program per (slab, head, chunk)
  # forms S2's terms itself from the walk's dh and bf16 du, h, do and v_new
  # (kda.stages.bwd_wy.mosaic_gpu.fused), and S2's terms kernel does not run; one CTA per SM
  terms: bool = False

  def __post_init__(self):
    if self.cotangent_terms not in (1, 2):
      raise ValueError(f"cotangent_terms must be 1 or 2, got {self.cotangent_terms!r}")


def _scratch(K, V, stage_dtype=None, packed_qkv=False, defer_qg=False):
  """The kernel's scratch types; stage_dtype: packed dv's plain stage in dv's dtype (None: aligned);
  packed_qkv: plain q, k, v tiles (TMA lands packed rows there; they are only read into registers);
  defer_qg: no q tiles (nothing reads q)."""
  nk, nv = K // SLAB, V // SLAB
  tile = (lambda n: plgpu.SMEM((n, BT, SLAB), BF16)) if packed_qkv else (lambda n: _swz((n, BT, SLAB)))
  return [
      _swz((BT, BT)),                                                     # Ainv
      *[_swz((BT, SLAB)) for _ in range(4)],                              # work tiles
      _swz((BT, BT)),                                                     # L
      plgpu.Barrier(num_arrivals=(1 if defer_qg else 2) * nk + nv + 1),
      tile(nk), tile(nv), *([] if defer_qg else [tile(nk)]),              # k, v, q
      *([] if stage_dtype is None else [plgpu.SMEM((BT, SLAB), stage_dtype)]),
  ]


def smem_bytes(K, V, stage_dtype=None, packed_qkv=False, defer_qg=False):
  """Shared memory per program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates; the
  body's dbeta row sums reserve the reduction scratch)."""
  return _smem_bytes(_scratch(K, V, stage_dtype, packed_qkv, defer_qg), reduction=True)


def _reason(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu,
            stage_dtype=None, config=None, qkv_T=None, pairs=False, defer_qg=False) -> Optional[str]:
  """What the kernel can run (any float dtypes); `apply` raises with it. qkv_T: q, k, v are packed
  [1, qkv_T, HV, D]; pairs: dqg, dkg are pairs (bf16 [1, NTa, HV, 2 * 64, K])."""
  # the aligned layout's shapes: k's, v's, or with packed q, k, v the terms'
  reason, dims = tile_shapes(BT, "k", k, "v", v) if qkv_T is None else tile_shapes(BT, "dw", dw, "du", du)
  if reason is not None:
    return reason
  Ta, HV, K, V = dims
  T = Ta if qkv_T is None else qkv_T
  for name, x, D in (("q", q, K), ("k", k, K), ("v", v, V)):
    if tuple(x.shape) != (1, T, HV, D):
      return f"{name} must have shape {(1, T, HV, D)}, got {tuple(x.shape)}"
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  dqk = (1, Ta // BT, HV, 2 * BT, K) if pairs else (1, Ta, HV, K)
  want = {"gc_int": (1, Ta, HV, K), "gc_frac": (1, Ta, HV, K), "dqg": dqk, "dkg": dqk,
          "dw": (1, Ta, HV, K), "du": (1, Ta, HV, V), "beta": (1, Ta, HV), "Ainv": (1, Ta, HV, BT),
          "dgc_last": (1, Ta // BT, HV, K)}
  given = dict(gc_int=gc_int, gc_frac=gc_frac, dqg=dqg, dkg=dkg, dw=dw, du=du, beta=beta, Ainv=Ainv,
               dgc_last=dgc_last)
  for name, shape in want.items():
    if tuple(given[name].shape) != tuple(shape):
      return f"{name} must have shape {tuple(shape)}, got {tuple(given[name].shape)}"
  for name, x in dict(given, q=q, k=k, v=v).items():
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return f"mosaic_gpu bwd_wy takes floating {name}, got {jnp.dtype(x.dtype).name}"
  if pairs and (bad := [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("dqg", dqg), ("dkg", dkg))
                        if jnp.dtype(x.dtype) != jnp.dtype(BF16)]):
    return f"pairs are bfloat16, got {', '.join(bad)}"
  if aligned_cu is not None and (reason := aligned_cu_reason(aligned_cu)):
    return reason
  config = config or Config()
  need = (split.smem_bytes(stage_dtype, packed_qkv=qkv_T is not None, defer_qg=defer_qg) if config.split and K == V
          else smem_bytes(K, V, stage_dtype, qkv_T is not None, defer_qg))
  return smem_reason(need, "bwd_wy")


def supports(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *,
             chunk_size, config=None, dv_dtype=None, rows=None, T=None, qkv_packed=False, pairs=False,
             defer_qg=False, **_) -> Optional[str]:
  """The stage's predicate: None if the kernel takes this call, else the reason in words. Beyond
  what the kernel can run (rows given: packed dv, its stage in dv_dtype counted), q, k, v and Ainv
  must be bfloat16 (the dtype policy: float32 inputs keep float32 gradients on the reference;
  `apply` itself rounds float32 ones to bf16)."""
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  stage = None if rows is None else jnp.dtype(dv_dtype or F32)
  if qkv_packed and (rows is None or not isinstance(T, int)):
    return "packed q, k, v need rows and a static int T"
  reason = _reason(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu, stage, config,
                   T if qkv_packed else None, pairs, defer_qg)
  if reason is not None:
    return reason
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("q", q), ("k", k), ("v", v), ("Ainv", Ainv))
         if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return ("mosaic_gpu bwd_wy takes bfloat16 q, k, v, Ainv (float32 would be rounded to bfloat16), "
            f"got {', '.join(bad)}")
  return None


takes = supports                  # the name kda.stages.bwd_wy registers


def _body(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, dqg_g, dkg_g, dw_g, du_g, dgl_g,
          oq_g, ok_g, ov_g, odb_g, og_g, ogs_g, oa_g,
          a_s, t0, t1, t2, t3, l_s, bar, k_s, v_s, *q_s, nk, nv, store_dv=None, ct=2, overlap=False,
          qkv_rows=None, pairs=False, defer_qg=False):
  """qkv_rows (src, count): q, k, v are packed, chunk c's row r < count at packed row src + r.
  pairs: dqg, dkg (and so dq, dk over them) are pair refs (kda._mosaic_gpu.pair_load). defer_qg:
  dqg_g, oq_g and q_s are None (q and dqg are not read, dq is not formed)."""
  h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  slab = lambda j: pl.ds(j * SLAB, SLAB)
  qkv = rows if qkv_rows is None else pl.ds(qkv_rows[0], BT)
  q_s = None if defer_qg else q_s[0]
  for j in range(nk):
    if not defer_qg:
      plgpu.copy_gmem_to_smem(q_g.at[qkv, h, slab(j)], q_s.at[j], bar)
    plgpu.copy_gmem_to_smem(k_g.at[qkv, h, slab(j)], k_s.at[j], bar)
  for j in range(nv):
    plgpu.copy_gmem_to_smem(v_g.at[qkv, h, slab(j)], v_s.at[j], bar)
  plgpu.copy_gmem_to_smem(a_g.at[rows, h, :], a_s, bar)

  shape = (BT, SLAB)
  row, col = _iota(0, shape), _iota(1, shape)
  tile = lambda x_s, j: packed_tile(x_s.at[j], row, qkv_rows)  # slab j of q, k or v, float32
  strict = col < row
  l_s[...] = jnp.where(strict, 1.0, 0.0).astype(BF16)       # L: the exclusive row cumsum
  beta = lax.broadcast_in_dim(_load(b_g.at[h, rows], ROW), shape, [0])
  at = lambda ref, j: ref.at[rows, h, slab(j)]
  last = lambda ref, j: last_row(ref, c, h, slab(j), shape)

  def put(x, *tiles):
    for t, part in zip(tiles, _split(x, len(tiles))):
      t[...] = part
    plgpu.commit_smem()

  aT = a_s.T
  cts = (t0, t1)[:ct]                # the cotangent's bf16 terms
  cross = [(t0, t2.T), (t0, t3.T)] + ([(t1, t2.T)] if ct == 2 else [])   # (du or dw) @ (vb or kb)^T

  def product(pairs, load, plus=None):
    """(plus +) _acc(pairs), and load()'s values, issued while the products run."""
    out, loaded = _acc(pairs, shape, during=load)
    return (out if plus is None else plus + out), loaded

  # the cotangent operands in the order they enter (du per V slab, then dw per K slab); with overlap
  # operand i + 1 is loaded while operand i's dAinv product runs
  operands = [(du_g, j) for j in range(nv)] + [(dw_g, j) for j in range(nk)]
  operand = lambda i: _load(at(*operands[i])) if i < len(operands) else None
  paired = lambda ref: pairs and (ref is dqg_g or ref is dkg_g)
  qk_terms = (dkg_g,) if defer_qg else (dqg_g, dkg_g)       # S2's terms of qg and kg that S3 reads
  loads = lambda *refs, j: tuple(term_load(r, c, h, rows, slab(j), paired(r)) for r in refs)
  store = lambda o_g, j, x: term_store(o_g, c, h, rows, slab(j), x, pairs)    # dq, dk as pairs where dqg, dkg are

  plgpu.barrier_wait(bar)
  dAinv = plgpu.layout_cast(jnp.zeros(shape, F32), plgpu.Layout.WGMMA)
  dbeta = []
  x = operand(0)
  for j in range(nv):
    put(x, *cts)                                             # du
    dvb = _acc([(aT, t) for t in cts], shape)
    vx = tile(v_s, j)
    if store_dv is None:
      ov_g[rows, h, slab(j)] = (dvb * beta).astype(ov_g.dtype)
    else:
      store_dv(j, dvb * beta)
    dbeta.append(jnp.sum(dvb * vx, axis=1))
    put(beta * vx, t2, t3)                                   # vb
    dAinv, x = product(cross, lambda: operand(j + 1) if overlap or j + 1 < nv else None, plus=dAinv)

  def k_slab(j, carry):
    # carry: dAinv, dbeta's sum and, with overlap, this slab's dw (loaded while the last products ran)
    dAinv, dsum, *x = carry
    put(x[0] if overlap else _load(at(dw_g, j)), *cts)       # dw
    # with overlap this slab's dqg, dkg too are loaded while dkb's products run
    dkb, (gi, gf, *early) = product([(aT, t) for t in cts],
                                    lambda: loads(gi_g, gf_g, *(qk_terms if overlap else ()), j=j))
    eg = jnp.exp(exponent(gi, gf))
    el = jnp.exp(exponent(last(gi_g, j), last(gf_g, j), gi, gf))
    kx, qx = tile(k_s, j), None if defer_qg else tile(q_s, j)
    *dqg, dkg = early if overlap else loads(*qk_terms, j=j)
    keg = kx * eg
    kb = beta * keg
    if not defer_qg:               # else S4 forms dq = dqg eg and adds dqg q eg to dgc
      store(oq_g, j, dqg[0] * eg)
    store(ok_g, j, dkg * el + dkb * beta * eg)
    og_g[rows, h, slab(j)] = dkb * kb if defer_qg else dqg[0] * qx * eg + dkb * kb
    dsum = dsum + jnp.sum(dkb * keg, axis=1)
    dkg_kg = dkg * (kx * el)       # one array, not three, through the products
    put(kb, t2, t3)
    # with overlap the next slab's dw (the last slab's again at the end) is loaded while they run
    dAinv, ahead = product(cross, lambda: _load(at(dw_g, jnp.minimum(j + 1, nk - 1))) if overlap else None,
                           plus=dAinv)
    put(dkg_kg, t0, t1, t2)                                  # dkg kg, in three terms
    before, dgl = product([(l_s, t0), (l_s, t1), (l_s, t2)], lambda: _load(dgl_g.at[c, h, slab(j)], COL))
    ogs_g[rows, h, slab(j)] = before + lax.broadcast_in_dim(dgl, shape, [1])
    return (dAinv, dsum, *([ahead] if overlap else []))

  # a loop, not unrolled: the slabs' arrays never pile up in registers
  carry = (dAinv, functools.reduce(jnp.add, dbeta), *([x] if overlap else []))
  dAinv, dsum, *_ = lax.fori_loop(0, nk, k_slab, carry)
  oa_g[rows, h, :] = jnp.where(strict, -split.ainv_chain(put, dAinv, aT, (t0, t1, t2, t3), shape), 0.0)
  odb_g[h, rows] = dsum


def _zeros(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, dqg_g, dkg_g, dw_g, du_g, dgl_g,
           oq_g, ok_g, ov_g, odb_g, og_g, ogs_g, oa_g, *scratch, nk, nv, dv=True, pairs=False):
  h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  slab = lambda j: pl.ds(j * SLAB, SLAB)
  z = zeros((BT, SLAB))
  for j in range(nv if dv else 0):
    ov_g[rows, h, slab(j)] = z.astype(ov_g.dtype)
  for j in range(nk):
    for o_g in (oq_g, ok_g, og_g, ogs_g):
      if o_g is None:              # defer_qg: no dq
        continue
      term_store(o_g, c, h, rows, slab(j), z, pairs and (o_g is oq_g or o_g is ok_g))
  oa_g[rows, h, :] = z
  odb_g[h, rows] = zeros((BT,), ROW)


def _packed_body(src_g, cnt_g, pieces_g, cu_g, *refs, nk, nv, tail_zeros=True, ct=2, overlap=False,
                 packed_qkv=False, pairs=False, defer_qg=False):
  """Packed dv (`packed_chunk`, the stage is the last scratch): program (h, c) stores its chunk's dv
  rows packed and zeroes the gap pieces c, c + NTa, ... of dv's head h; packed_qkv: q, k, v are
  read packed too, and the clean flag's ref [1] int32 comes after aligned_cu's."""
  qkv_rows = None
  if packed_qkv:
    clean_g, refs = refs[0], refs[1:]
  *refs, stage = refs
  ov_g = refs[14]
  h, c = lax.axis_index("h"), lax.axis_index("c")
  dst = lambda j: lambda ds: ov_g.at[ds, h, pl.ds(j * SLAB, SLAB)]
  if packed_qkv:
    qkv_rows = (src_g[c], cnt_g[c], clean_g[0])
  packed_chunk(stage, src_g, cnt_g, pieces_g, cu_g, c,
               lambda store: _body(*refs, nk=nk, nv=nv, ct=ct, overlap=overlap, qkv_rows=qkv_rows, pairs=pairs,
                                   defer_qg=defer_qg, store_dv=lambda j, x: store(dst(j), x)),
               (lambda: _zeros(*refs, nk=nk, nv=nv, dv=False, pairs=pairs)) if tail_zeros else None,
               [dst(j) for j in range(nv)], BT)


def _in_place(body, n_lead, alias_du, defer_qg=False):
  """The body on the in-place operands: refs = the n_lead leading refs, the 12 inputs (dqg, dkg, dw,
  du mutable; defer_qg: 11, no dqg), the fresh outputs dv, dbeta^T, dAkk (and dg_state unless
  alias_du), the scratch; it calls `body` with the outputs dq, dk, dgc (dg_state) on dqg's, dkg's,
  dw's (du's) refs (dqg's and dq's None with defer_qg)."""
  def wrapped(*refs):
    n_in = 11 if defer_qg else 12
    lead, ins, rest = refs[:n_lead], list(refs[n_lead:n_lead + n_in]), refs[n_lead + n_in:]
    if defer_qg:
      ins.insert(7, None)
    n_out = 3 if alias_du else 4
    (ov, odb, oa, *ogs), scratch = rest[:n_out], rest[n_out:]
    ogs = ins[10] if alias_du else ogs[0]
    return body(*lead, *ins, ins[7], ins[8], ov, odb, ins[9], ogs, oa, *scratch)
  return wrapped


def _split_packed_body(src_g, cnt_g, pieces_g, cu_g, *refs, tail_zeros=True, ct=2, packed_qkv=False, pairs=False,
                       defer_qg=False):
  """The split kernel's packed dv: program (p, h, c) stores its slab of its chunk's dv rows packed
  and zeroes the gap pieces c, c + NTa, ... of that slab; packed_qkv: q, k, v are read packed too
  (the clean flag's ref after aligned_cu's, as `_packed_body`)."""
  qkv_rows = None
  if packed_qkv:
    clean_g, refs = refs[0], refs[1:]
  *refs, stage = refs
  ov_g = refs[14]
  p, h, c = lax.axis_index("p"), lax.axis_index("h"), lax.axis_index("c")
  dst = lambda ds: ov_g.at[ds, h, pl.ds(pl.multiple_of(p * SLAB, SLAB), SLAB)]
  if packed_qkv:
    qkv_rows = (src_g[c], cnt_g[c], clean_g[0])
  packed_chunk(stage, src_g, cnt_g, pieces_g, cu_g, c,
               lambda store: split.body(*refs, ct=ct, qkv_rows=qkv_rows, pairs=pairs, defer_qg=defer_qg,
                                        store_dv=lambda x: store(dst, x)),
               (lambda: split.zeros_body(*refs, dv=False, pairs=pairs)) if tail_zeros else None, [dst], BT)


@functools.lru_cache(maxsize=None)
def _kernel(Ta, HV, K, V, *, interpret, approx_math, skip_tail=False, dv_dtype=F32, packed_T=None,
            tail_zeros=True, ct=2, overlap=False, split_slabs=False, du_bf16=False, packed_qkv=False, pairs=False,
            defer_qg=False):
  nk, nv = K // SLAB, V // SLAB
  out = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)
  stage_dtype = None if packed_T is None else dv_dtype
  lanes = dict(tail_zeros=False) if not tail_zeros else {}
  alias_du = K == V and not du_bf16          # dg_state over du (float32 only)
  if split_slabs:
    body = functools.partial(split.body, ct=ct, pairs=pairs, defer_qg=defer_qg)
    zeros_body = functools.partial(split.zeros_body, pairs=pairs)
    packed_body = functools.partial(_split_packed_body, ct=ct, packed_qkv=packed_qkv, pairs=pairs, defer_qg=defer_qg,
                                    **lanes)
  else:
    body = functools.partial(_body, nk=nk, nv=nv, ct=ct, overlap=overlap, pairs=pairs, defer_qg=defer_qg)
    zeros_body = functools.partial(_zeros, nk=nk, nv=nv, pairs=pairs)
    packed_body = functools.partial(_packed_body, nk=nk, nv=nv, ct=ct, overlap=overlap, packed_qkv=packed_qkv,
                                    pairs=pairs, defer_qg=defer_qg, **lanes)
  if packed_T is not None:
    body = packed_body
  elif skip_tail:
    body = skipping_tail(body, zeros_body if tail_zeros else None)
  # src, count, pieces, aligned_cu (and the clean flag with packed q, k, v)
  n_lead = 4 + bool(packed_qkv) if packed_T is not None else int(skip_tail)
  body = _in_place(body, n_lead, alias_du=alias_du, defer_qg=defer_qg)
  Tv = Ta if packed_T is None else packed_T
  # fresh outputs: dv, dbeta^T, dAkk (per slab where split; and dg_state where K != V); dq, dk, dgc
  # (dg_state) in place
  parts = (nk,) if split_slabs else ()
  out_type = ((out(Tv, HV, V, dtype=dv_dtype), out(*parts, HV, Ta), out(*parts, Ta, HV, BT))
              + (() if alias_du else (out(Ta, HV, K),)))
  grid = dict(grid=(nk, HV, Ta // BT), grid_names=("p", "h", "c")) if split_slabs else dict(
      grid=(HV, Ta // BT), grid_names=("h", "c"))
  return plgpu.kernel(
      body,
      out_type=out_type,
      **grid,
      scratch_types=(split.scratch(stage_dtype, du_bf16, packed_qkv, pairs, defer_qg) if split_slabs else
                     _scratch(K, V, stage_dtype, packed_qkv, defer_qg)),
      compiler_params=_params(lane=True, approx_math=approx_math),   # Lane: no layout inference
      kernel_name="kda_bwd_wy" if packed_T is None else "kda_bwd_wy_packed",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def apply(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *, chunk_size,
          dv_dtype=None, interpret=False, config=None, rows=None, pieces=None, T=None, tail_zeros=True,
          qkv_packed=False, pairs=False, clean=None, defer_qg=False, dAkk_parts=False):
  """The stage on the kernel; any float inputs (q, k, v, Ainv rounded to bf16; the predicate
  `supports` adds the dtype policy). aligned_cu (optional): with Config.skip_tail the chunks at or
  past aligned_cu[-1] get zeros without being read. dv_dtype: dv's dtype (float32 unless given; the
  kernel rounds it there, as the pipeline would right after).
  Packed dv (the unalign folded into its store): rows = padding.chunk_rows(layout), pieces =
  padding.gap_pieces(rows, aligned_cu, T, 64) and the packed length T (aligned_cu required): dv is
  [1, T, HV, V], chunk c's row r < count[c] at packed row src[c] + r, 0 at tokens of no sequence;
  the other outputs as without (the tail chunks' zeros included). tail_zeros=False (with the tail
  skipped): the outputs are left unwritten at the chunks at or past aligned_cu[-1] (for callers
  that never read them: the packed backward). qkv_packed (with packed dv): q, k, v are the packed
  [1, T, HV, D] arrays, chunk c's rows read from packed rows src[c] + r, r < count[c] (the rest of
  the landed tile, another sequence's tokens or the zero fill past T, taken as 0), so no aligned
  copy of them need exist; every output bit for bit the aligned call's. clean (with qkv_packed; a
  bool scalar, traced or not): where true, the non-finite values of q, k, v are read as 0 too (as
  kda.confine cleans its rerun's inputs), with no copy and the same kernel. pairs: dqg, dkg come as
  their pairs (S2's `pairs`: bf16 [1, NTa, HV, 2 * 64, K], kda._mosaic_gpu.pair_store) and dq, dk
  leave as theirs, over them. defer_qg: q and dqg are not read and Out.dq is None; dgc lacks its
  dqg q exp(gc) term: S4 (bwd_intra's `defer_qg`) forms dq = dqg exp(gc) and adds that term, so this
  stage neither reads dqg nor stores dq. dAkk_parts: with Config.split, Out.dAkk is the slabs' parts
  [K // 64, Ta, HV, BT] (bwd_intra adds them as it reads them: no summed copy is formed), else their
  sum [1, Ta, HV, BT]."""
  config = config or Config()
  packed = rows is not None
  dv_dtype = jnp.dtype(dv_dtype or F32)
  reason = (f"chunk_size must be {BT}, got {chunk_size}" if chunk_size != BT else
            "qkv_packed needs packed dv (rows, pieces, T)" if qkv_packed and not packed else
            _reason(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu,
                    dv_dtype if packed else None, config, T if qkv_packed else None, pairs, defer_qg))
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_wy kernel: {reason}")
  _, Ta, HV, K = dw.shape
  V = du.shape[-1]
  bf = lambda x: x[0].astype(BF16)
  f32 = lambda x: x[0].astype(F32)
  if packed and (aligned_cu is None or pieces is None or not isinstance(T, int)):
    raise ValueError(f"mosaic_gpu bwd_wy kernel: packed dv (rows given) needs aligned_cu, pieces and a static "
                     f"int T, got aligned_cu {aligned_cu is not None}, pieces {pieces is not None}, T {T!r}")
  skip = config.skip_tail and aligned_cu is not None
  split_slabs = config.split and K == V
  du_bf16 = du.dtype == BF16 and config.cotangent_terms == 1     # read as is: one bf16 term is all it gives
  f = _kernel(Ta, HV, K, V, interpret=interpret, approx_math=config.approx_math, skip_tail=skip,
              dv_dtype=dv_dtype, packed_T=T if packed else None, tail_zeros=bool(tail_zeros) or not (skip or packed),
              ct=config.cotangent_terms, overlap=config.overlap_loads, split_slabs=split_slabs, du_bf16=du_bf16,
              packed_qkv=bool(qkv_packed), pairs=bool(pairs), defer_qg=bool(defer_qg))
  cu = (aligned_cu.astype(jnp.int32),) if skip or packed else ()
  if packed:
    cu = (rows.src, rows.count, pieces) + cu
  if qkv_packed:
    cu += (clean_flag(clean),)
  ins = (*cu, bf(q), bf(k), bf(v), bf(Ainv), beta[0].astype(F32).T, f32(gc_int), f32(gc_frac))
  # S2's terms: dq, dk, dgc (dg_state where du is float32 and K == V) in place
  refs = ([jax.new_ref(x[0] if pairs else f32(x)) for x in ((dkg,) if defer_qg else (dqg, dkg))]
          + [jax.new_ref(f32(dw))] + [jax.new_ref(du[0] if du_bf16 else f32(du))])
  dv, dbeta, dAkk, *dg_state = f(*ins, *refs, f32(dgc_last))
  if split_slabs:                  # the slabs' parts
    dbeta, dAkk = jnp.sum(dbeta, 0), dAkk if dAkk_parts else jnp.sum(dAkk, 0)
  *dq, dk, dgc, du_out = (jax.ref.freeze(r) for r in refs)
  dq = dq[0][None] if dq else None
  dg_state = dg_state[0] if dg_state else du_out
  dAkk = dAkk if dAkk.ndim == 4 else dAkk[None]
  return Out(dq, dk[None], dv[None], dbeta.T[None], dgc[None], dg_state[None], dAkk)
