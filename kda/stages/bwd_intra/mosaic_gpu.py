"""bwd_intra (S4): the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.bwd_intra.

One kernel, one program (one warpgroup) per (64-column slab s of K, value head h, chunk c), grid
(K // 64, HV, NTa) (the chunks on CUDA's grid x, which has no 65535 limit). The outputs of a column
slab (dq, dk, dgc at those columns) need only that slab of q, k and gc, so the slabs are independent
programs; only dbeta sums over every column, and each program stores its slab's part of it
([K // 64, HV, Ta], summed onto the accumulator by the launcher, one XLA add). Per program:

- TMA: q, k [64, 64] bf16 into swizzled tiles, gc_int and gc_frac [64, 64] float32 into plain tiles
  (loaded whole, never as column slices). beta, dAqk, dAkk and the accumulators dq, dk, dgc are read
  from GMEM straight into registers (WGMMA layout) and the results leave from registers to GMEM.
  dAkk may come as parts (S3's split kernel: one per slab), added as they are loaded. A level reads
  dAkk while the tensor cores run its second product and the next level's dAqk during its last
  (`kda._mosaic_gpu.acc`'s `during`), so those loads wait on no product.
- Decays by levels, as the forward scores kernel (kda.stages.intra.mosaic_gpu): every strict pair
  (i, j) of the chunk lies in exactly one level s in 64, 32, ..., 2 (i in the second half of an
  s-token block, j in its first half); with r the gc row at the first token of that second half,
  E[i, j] = el_i * er_j, el_i = exp(gc_i - r) and er_j = exp(r - gc_j), both exponents <= 0 (gc is
  non-increasing: gates <= 0), so no factor exceeds 1 and one underflows only where E does (gc down
  to -8192, -inf gates floored at -128 by the gate stage, gives exact zeros, no inf, no NaN). With
  dA_L the dA tile masked to the level's pairs (same block, i second half, j first half):

      dqAs += el * (scale dAqk_L @ (k er))          G   += el * (dAkk_L @ (k er))
      W    += er * (scale dAqk_L^T @ (q el) + dAkk_L^T @ (beta k el))       (= dkAs + dkK2)

  four products per level (the transposes are .T views of the swizzled dA tiles), six levels in one
  fori_loop (one copy of the code). Bounded chunks take fewer levels: the chunk's bounded level
  lb (`bounded_levels`, one int per (head, chunk), computed by the launcher from a few gc rows
  per chunk) is 6 where both 32-token halves of the chunk span <= BOUNDED_SPAN = 40 of gc in every
  channel (ordinary gates: one level, the whole chunk), else 5 where every 16-token half of both
  32-token blocks does (two levels, the exact 64 and the 32-token blocks), else 4 where every
  8-token half of the 16-token blocks does (e.g. safe_gate's -5 per token: three levels), else 0
  (six exact levels). The level lb is factored through each block's middle row at
  every row (el, er in [e^-40, e^40]; dA_L masked to every strict pair of the block). The span is
  half the forward's 80: the dA operands are unbounded cotangents (e^80 times them may overflow),
  and the lo half of a split operand k e^-80 would be subnormal (bf16 precision only).
  Config(bounded="never"): six levels always.
  Then, with d = scale diag(dAqk) (the pairs j == i, E = 1, no gate term):

      dq  = dq_acc  + dqAs + d k                   dk  = dk_acc + W + d q + beta G
      dgc = dgc_acc + q dqAs - k W + k beta G      dbeta_part = sum_c k G

  gc is always taken in its two parts (exponent(): exact for any gate).

SMEM per program (`smem_bytes`, K-independent: one slab): q, k, the masked dA tile's split, the
right-hand operands k er and (q el, then beta k el), each split: 8 swizzled [64, 64] bf16 tiles
(64 KiB), gc's two parts (32 KiB), the reduction scratch (dbeta's row sums) and a barrier: 100360
bytes, two CTAs per SM. Warpgroup lowering semantics: the body stores many register arrays to SMEM
(the split operands), which Lane lowers through a swap that first loads the old value
(kda._mosaic_gpu.params), so Lane runs slower here.

Precision: every wgmma has hi + lo bf16 splits of both float32 operands (kda._mosaic_gpu.split,
three wgmmas: hi hi, hi lo, lo hi; ~2^-16 relative; Config.dA_terms=1 takes dA as one term, 2^-9,
two wgmmas), float32 accumulation; the decay factors and
all sums outside the tensor cores are float32 (Config.approx_math: Mosaic GPU's ex2.approx, ~2^-22
relative). q, k enter as bf16: `apply` rounds float32 q, k (their float32 accuracy needs the
reference stage; the predicate refuses them), everything else is float32.

Packed dq, dk (`apply(..., rows=, pieces=, T=)`, the pipeline's packed backward): the unalign folds
into their stores, through one plain [64, 64] SMEM stage (dq, then dk; 8 KiB more in bf16, two CTAs
per SM) and kda._mosaic_gpu.store_rows to packed rows src[c] + r, r < count[c]; program (s, h, c)
zeroes the gap pieces c, c + NTa, ... of its head and columns. dgc and dbeta stay aligned.

In place: dgc's result is written over its accumulator (S3's dgc, a mutable ref aliased in and
out): each program reads its tile before it stores the same rows and columns, so the backward's peak
(S4's launch) holds one [Ta, HV, K] float32 buffer for dgc, not two.

Deferred qg (`apply(..., defer_qg=True)`, S3's `defer_qg`): dq's accumulator is S2's dqg, and
`finish` adds S3's part of dq, dqg exp(gc) (gc from the program's SMEM tiles, with seg the resets'
steps put back), and dqg q exp(gc) to dgc.

Pairs (`apply(..., pairs=True)`): S3's dq, dk come as bf16 pairs (kda._mosaic_gpu.pair_load: hi +
lo in float32, ~2^-17 relative), read where S2 and S3 stored them, over S0's h and S2's dh.

The simulator's callbacks run jax ops, so eager jax ops dispatched while a simulated kernel is
still running can deadlock (block_until_ready first).

The stage's predicate `supports` refuses what the kernel cannot run (chunk_size != 64, K not 64 /
128, shapes, non-float dtypes, HV > 65535, SMEM) with the reason, and float32 q, k.
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

from kda._mosaic_gpu import BF16, COL, F32, HEAD_DIMS, MAX_GRID_YZ, ROW, aligned_cu_reason, packed_chunk
from kda._mosaic_gpu import clean_flag, packed_tile, skipping_tail, term_load, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, params as _params, split as _split, swz as _swz
from kda._mosaic_gpu import smem_bytes as _smem_bytes, smem_reason
from kda.stages.bwd_intra import Out
from kda.stages.gate import GATE_FLOOR, exponent
from kda.stages.intra import to_chunks
from kda.stages.intra.mosaic_gpu import reset_free

BT = 64
SLAB = 64                 # columns of K per program
LEVELS = 6                # s = 64, 32, ..., 2
BOUNDED_SPAN = 40.0       # the bounded level's factors lie in [e^-40, e^40] (module docstring)


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the bwd_intra kernel."""
  bounded: str = "auto"     # "auto": bounded chunks take the two-level path; "never": six levels always
  approx_math: bool = True   # Mosaic GPU's fast exp (ex2.approx): ~2^-22 relative
  # with aligned_cu: the chunks at or past aligned_cu[-1] get the accumulators back, nothing else
  # read (no token there, so no term)
  skip_tail: bool = True
  # bf16 terms of the dA operand: 2 (hi + lo, ~2^-16 relative, three wgmmas a product) or 1 (dA
  # rounded to bf16 once, 2^-9, two wgmmas: the same rounded dA serves both products of a pair)
  dA_terms: int = 2

  def __post_init__(self):
    if self.bounded not in ("auto", "never"):
      raise ValueError(f"bounded must be 'auto' or 'never', got {self.bounded!r}")
    if self.dA_terms not in (1, 2):
      raise ValueError(f"dA_terms must be 1 or 2, got {self.dA_terms!r}")


def _scratch(stage_dtype=None, packed_qk=False):
  """The kernel's scratch types (any K: one slab); stage_dtype: packed dq, dk's plain stage in
  their dtype (None: aligned); packed_qk: plain q, k tiles (packed rows land there; they are only
  read into registers)."""
  qk = [plgpu.SMEM((BT, SLAB), BF16) for _ in range(2)] if packed_qk else [_swz((BT, SLAB)) for _ in range(2)]
  return [
      *qk, *[_swz((BT, SLAB)) for _ in range(6)],       # q, k, dA split, k er split, x split
      plgpu.SMEM((BT, SLAB), F32), plgpu.SMEM((BT, SLAB), F32),   # gc_int, gc_frac
      plgpu.Barrier(num_arrivals=4),
      *([] if stage_dtype is None else [plgpu.SMEM((BT, SLAB), stage_dtype)]),
  ]


def smem_bytes(stage_dtype=None, packed_qk=False):
  """Shared memory per program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates; the
  body's dbeta row sums reserve the reduction scratch)."""
  return _smem_bytes(_scratch(stage_dtype, packed_qk), reduction=True)


def _reason(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu,
            stage_dtype=None, qk_T=None, pairs=False) -> Optional[str]:
  """What the kernel can run (bf16 or float32 q, k); `apply` raises with it. qk_T: q, k are packed
  [1, qk_T, HV, K]; pairs: dq, dk are pairs (bf16 [1, NTa, HV, 2 * 64, K])."""
  lead = k if qk_T is None else dgc         # the aligned layout's shape: k's, or with packed q, k dgc's
  if lead.ndim != 4 or lead.shape[0] != 1:
    return f"{'k' if qk_T is None else 'dgc'} must be [1, Ta, HV, K], got shape {lead.shape}"
  _, Ta, HV, K = lead.shape
  T = Ta if qk_T is None else qk_T
  for name, x in (("q", q), ("k", k)):
    if tuple(x.shape) != (1, T, HV, K):
      return f"{name} must have shape {(1, T, HV, K)}, got {tuple(x.shape)}"
  if K not in HEAD_DIMS:
    return f"K must be one of {HEAD_DIMS}, got {K}"
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  aligned = (1, Ta, HV, K)
  dqk = (1, Ta // BT, HV, 2 * BT, K) if pairs else aligned
  want = {"gc_int": aligned, "gc_frac": aligned, "dq": dqk, "dk": dqk, "dgc": aligned,
          "beta": (1, Ta, HV), "dbeta": (1, Ta, HV), "dAqk": (1, Ta, HV, BT),
          "dAkk": (dAkk.shape[0] or 1, Ta, HV, BT)}         # any number of parts
  given = dict(gc_int=gc_int, gc_frac=gc_frac, dq=dq, dk=dk, dgc=dgc, beta=beta, dbeta=dbeta, dAqk=dAqk,
               dAkk=dAkk)
  for name, shape in want.items():
    if tuple(given[name].shape) != tuple(shape):
      return f"{name} must have shape {tuple(shape)}, got {tuple(given[name].shape)}"
  for name, x in (("q", q), ("k", k)):
    if jnp.dtype(x.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
      return f"mosaic_gpu bwd_intra takes bfloat16 or float32 {name}, got {jnp.dtype(x.dtype).name}"
  for name, x in (("beta", beta), ("gc_int", gc_int), ("gc_frac", gc_frac), ("dAqk", dAqk), ("dAkk", dAkk),
                  ("dq", dq), ("dk", dk), ("dbeta", dbeta), ("dgc", dgc)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return f"mosaic_gpu bwd_intra takes floating {name}, got {jnp.dtype(x.dtype).name}"
  if pairs and (bad := [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("dq", dq), ("dk", dk))
                        if jnp.dtype(x.dtype) != jnp.dtype(BF16)]):
    return f"pairs are bfloat16, got {', '.join(bad)}"
  if aligned_cu is not None and (reason := aligned_cu_reason(aligned_cu)):
    return reason
  return smem_reason(smem_bytes(stage_dtype, qk_T is not None), "bwd_intra")


def supports(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu=None, *, scale,
             chunk_size, config=None, grad_dtype=None, rows=None, T=None, qk_packed=False, pairs=False,
             **_) -> Optional[str]:
  """The stage's predicate: None if the kernel takes this call, else the reason in words. Beyond
  what the kernel can run (rows given: packed dq, dk, their stage in grad_dtype counted), q and k
  must be bfloat16 (the dtype policy: float32 inputs keep float32 gradients on the reference;
  `apply` itself rounds float32 q, k to bf16)."""
  del scale, config               # no switch changes what the kernel takes
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  stage = None if rows is None else jnp.dtype(grad_dtype or F32)
  if qk_packed and (rows is None or not isinstance(T, int)):
    return "packed q, k need rows and a static int T"
  reason = _reason(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu, stage,
                   T if qk_packed else None, pairs)
  if reason is not None:
    return reason
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("q", q), ("k", k)) if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return f"mosaic_gpu bwd_intra takes bfloat16 q, k (float32 would be rounded to bfloat16), got {', '.join(bad)}"
  return None


takes = supports                  # the name kda.stages.bwd_intra registers


def bounded_levels(gc_int, gc_frac):
  """[HV * NTa] int32, row-major (head, chunk): the chunk's bounded level lb (module docstring): 6
  where both 32-token halves of the chunk span <= BOUNDED_SPAN of gc in every channel, else 5 where
  every 16-token half of both 32-token blocks does, else 4 where every 8-token half of the four
  16-token blocks does, else 0 (NaN gates included)."""
  gi, gf = (to_chunks(x.astype(F32), BT) for x in (gc_int, gc_frac))    # [NTa, BT, HV, K]
  at = lambda r: (gi[:, r], gf[:, r])

  def fits(size):
    span = jnp.zeros(gi.shape[:1] + gi.shape[2:], F32)
    for a in range(0, BT, size):
      m, e = a + size // 2, a + size - 1
      span = jnp.maximum(span, jnp.maximum(exponent(*at(a), *at(m)), exponent(*at(m), *at(e))))
    return jnp.all(span <= BOUNDED_SPAN, axis=-1)                       # [NTa, HV]; NaN -> False
  lb = jnp.where(fits(BT), 6, jnp.where(fits(32), 5, jnp.where(fits(16), 4, 0)))
  return lb.T.reshape(-1).astype(jnp.int32)


def _body(flag_g, *refs, scale, bounded, store=None, seg=False, dA_terms=2, qk_rows=None, pairs=False,
          defer_qg=False):
  """One program. seg: a [2, Ta] float32 input after the flags (kda.pipeline.segment_rows): dA's
  pairs masked to the chunk's segments, gc_int taken without the resets' -128 steps. qk_rows
  (src, count): q, k are packed (kda._mosaic_gpu.packed_tile). pairs: S3's dq, dk are pair refs
  (kda._mosaic_gpu.pair_load). defer_qg: dq's ref holds S2's dqg (`apply`)."""
  seg_g, refs = (refs[0], refs[1:]) if seg else (None, refs)
  (q_g, k_g, b_g, gi_g, gf_g, daqk_g, dakk_g, aq_g, ak_g, ag_g, oq_g, ok_g, og_g, odb_g,
   q_s, k_s, dh_s, dl_s, rh_s, rl_s, xh_s, xl_s, gi_s, gf_s, bar) = refs
  s, i_h, c = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  cols = pl.ds(pl.multiple_of(s * SLAB, SLAB), SLAB)
  qk = rows if qk_rows is None else pl.ds(qk_rows[0], BT)
  plgpu.copy_gmem_to_smem(q_g.at[qk, i_h, cols], q_s, bar)
  plgpu.copy_gmem_to_smem(k_g.at[qk, i_h, cols], k_s, bar)
  plgpu.copy_gmem_to_smem(gi_g.at[rows, i_h, cols], gi_s, bar)
  plgpu.copy_gmem_to_smem(gf_g.at[rows, i_h, cols], gf_s, bar)
  plgpu.barrier_wait(bar)

  shape = (BT, SLAB)
  row, col = _iota(0, shape), _iota(1, shape)
  bcast_row = lambda v: lax.broadcast_in_dim(v, shape, [0])
  beta = bcast_row(_load(b_g.at[i_h, rows], ROW))
  if seg:           # (i, j), j <= i, of one segment: j at or after the start row of i's
    same = col.astype(F32) >= bcast_row(_load(seg_g.at[1, rows], ROW))
    gi_s[...] = _load(gi_s) - GATE_FLOOR * bcast_row(_load(seg_g.at[0, rows], ROW))
    plgpu.commit_smem()
    dA = lambda ref: jnp.where(same, _load(ref.at[rows, i_h, :]), 0.0)
  else:
    dA = lambda ref: _load(ref.at[rows, i_h, :])            # [64, 64] float32 from GMEM

  def sum_parts(ref):
    """dAkk's [P, Ta, HV, BT] parts added on load (P = 1 but for S3's split kernel)."""
    x = dA(ref.at[0])
    for p in range(1, ref.shape[0]):
      x = x + dA(ref.at[p])
    return x

  def g_row(r):
    vec = lambda ref: lax.broadcast_in_dim(_load(ref.at[r], COL), shape, [1])
    return vec(gi_s), vec(gf_s)

  def split_into(x, hi_s, lo_s):
    hi_s[...], lo_s[...] = _split(x)

  def prod(lhs_h, lhs_l, rhs_h, rhs_l, during=None):
    """dA (left) @ a decayed operand (right) from their bf16 terms: every pair but lo lo."""
    if dA_terms == 1:
      return _acc([(lhs_h, rhs_h), (lhs_h, rhs_l)], shape, during)
    return _acc([(lhs_h, rhs_h), (lhs_h, rhs_l), (lhs_l, rhs_h)], shape, during)

  def dA_into(x):
    if dA_terms == 1:
      dh_s[...] = x.astype(BF16)
    else:
      split_into(x, dh_s, dl_s)

  def level(ls, carry, both_sides):
    """Level s = 2**ls onto the sums (P, G, W); ls and both_sides may be traced. Exact levels: el on
    second halves, er on first halves, the pairs (i second, j first half of a block); the bounded
    level (both_sides): el, er at every row (exponents within +-BOUNDED_SPAN), every strict pair of
    a block."""
    p_acc, g_acc, w_acc, daqk = carry
    size = 1 << ls
    half = size >> 1
    blk = row >> ls

    def pick(b, R):
      return tuple(jnp.where(blk == b, x, y) for x, y in zip(g_row((b << ls) + half), R))
    R = lax.fori_loop(1, BT >> ls, pick, g_row(half))       # the block's r, per row
    G = (_load(gi_s), _load(gf_s))
    same = blk == (col >> ls)
    second = (row & (size - 1)) >= half
    # exp(-inf) = 0 off the rows a factor belongs to: no exponent > 0 reaches exp on exact levels
    el = jnp.exp(jnp.where(second | both_sides, exponent(*G, *R), -jnp.inf))
    er = jnp.exp(jnp.where(second & ~both_sides, -jnp.inf, exponent(*R, *G)))
    pair = same & (col < row) & (both_sides | (second & ((col & (size - 1)) < half)))   # the level's (i, j)
    # dAqk's pairs: dqAs and dkAs (q, k read from their tiles where used, not held through the products)
    dA_into(jnp.where(pair, daqk * scale, 0.0))
    split_into(packed_tile(k_s, row, qk_rows) * er, rh_s, rl_s)
    split_into(packed_tile(q_s, row, qk_rows) * el, xh_s, xl_s)
    plgpu.commit_smem()
    # each product folds into its sum as soon as it is read: fewer arrays live through the next ones
    p_acc = p_acc + el * prod(dh_s, dl_s, rh_s, rl_s)
    wa, dakk = prod(dh_s.T, dl_s.T, xh_s, xl_s, during=lambda: sum_parts(dakk_g))   # dAkk read meanwhile
    # dAkk's pairs (the buffers are free: reading the accumulators waited for the wgmmas)
    dA_into(jnp.where(pair, dakk, 0.0))
    split_into(beta * packed_tile(k_s, row, qk_rows) * el, xh_s, xl_s)
    plgpu.commit_smem()
    g_acc = g_acc + el * prod(dh_s, dl_s, rh_s, rl_s)
    wb, daqk = prod(dh_s.T, dl_s.T, xh_s, xl_s, during=lambda: dA(daqk_g))
    return p_acc, g_acc, w_acc + er * (wa + wb), daqk

  def finish(carry):
    P, G, W, daqk = carry          # the last level read dAqk again meanwhile: its diagonal here
    kx = packed_tile(k_s, row, qk_rows)
    qx = packed_tile(q_s, row, qk_rows)
    d = bcast_row(jnp.sum(jnp.where(row == col, daqk, 0.0), axis=1)) * scale   # E = 1
    bG = beta * G
    at = lambda ref: ref.at[rows, i_h, cols]
    ld = lambda ref: term_load(ref, c, i_h, rows, cols, pairs)
    acc_q, acc_g = ld(aq_g), _load(at(ag_g))
    if defer_qg:                   # S3's part: dq = dqg exp(gc), and dqg q exp(gc) onto dgc
      gi = _load(gi_s)
      if seg:                      # the resets' steps back: the true gc
        gi = gi + GATE_FLOOR * bcast_row(_load(seg_g.at[0, rows], ROW))
      acc_q = acc_q * jnp.exp(exponent(gi, _load(gf_s)))
      acc_g = acc_g + acc_q * qx
    if store is None:
      oq_g[rows, i_h, cols] = (acc_q + (P + d * kx)).astype(oq_g.dtype)
      ok_g[rows, i_h, cols] = (ld(ak_g) + (W + d * qx + bG)).astype(ok_g.dtype)
    else:
      store(oq_g, acc_q + (P + d * kx))
      store(ok_g, ld(ak_g) + (W + d * qx + bG))
    og_g[rows, i_h, cols] = acc_g + (qx * P - kx * W + kx * bG)
    odb_g[s, i_h, rows] = jnp.sum(kx * G, axis=1)


  zero = plgpu.layout_cast(jnp.zeros(shape, F32), plgpu.Layout.WGMMA)
  # lb: the chunk's bounded level (6, 5 or 4: exact levels 64 .. 2**(lb + 1), then lb both-sided) or 0
  # (six exact levels)
  lb = flag_g[i_h * (b_g.shape[1] // BT) + c] if bounded else 0
  n = jnp.where(lb > 0, LEVELS + 1 - lb, LEVELS) if bounded else LEVELS
  carry = (zero, zero, zero, dA(daqk_g))         # the sums and the first level's dAqk
  finish(lax.fori_loop(0, n, lambda t, cr: level(LEVELS - t, cr, (LEVELS - t) == lb), carry))


def _tail(flag_g, *refs, grads=True, seg=False, pairs=False):
  """A chunk at or past aligned_cu[-1]: dq, dk their accumulators back (grads), dbeta's part 0; dgc's
  accumulator is its result already (in place)."""
  (q_g, k_g, b_g, gi_g, gf_g, daqk_g, dakk_g, aq_g, ak_g, ag_g, oq_g, ok_g, og_g,
   odb_g) = refs[1 if seg else 0:][:14]
  s, i_h, c = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  cols = pl.ds(pl.multiple_of(s * SLAB, SLAB), SLAB)
  for a_g, o_g in ((aq_g, oq_g), (ak_g, ok_g)) if grads else ():
    o_g[rows, i_h, cols] = term_load(a_g, c, i_h, rows, cols, pairs).astype(o_g.dtype)
  odb_g[s, i_h, rows] = zeros((BT,), ROW)


def _packed_body(src_g, cnt_g, pieces_g, cu_g, *refs, scale, bounded, tail_zeros=True, seg=False, dA_terms=2,
                 packed_qk=False, pairs=False, defer_qg=False):
  """Packed dq, dk (`packed_chunk`, the stage is the last scratch): program (s, h, c) stores its
  chunk's dq, dk rows packed and zeroes the gap pieces c, c + NTa, ... of both at its head and
  columns; packed_qk: q, k are read packed too, and the clean flag's ref [1] int32 comes after
  aligned_cu's."""
  qk_rows = None
  if packed_qk:
    clean_g, refs = refs[0], refs[1:]
  *refs, stage = refs
  oq_g, ok_g = refs[11 + seg], refs[12 + seg]
  s, i_h, c = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("c")
  cols = pl.ds(pl.multiple_of(s * SLAB, SLAB), SLAB)
  dst = lambda o_g: lambda ds: o_g.at[ds, i_h, cols]
  if packed_qk:
    qk_rows = (src_g[c], cnt_g[c], clean_g[0])
  packed_chunk(stage, src_g, cnt_g, pieces_g, cu_g, c,
               lambda store: _body(*refs, scale=scale, bounded=bounded, seg=seg, dA_terms=dA_terms, pairs=pairs,
                                   qk_rows=qk_rows, defer_qg=defer_qg,
                                   store=lambda o_g, x: store(dst(o_g), x)),
               (lambda: _tail(*refs, grads=False, seg=seg)) if tail_zeros else None,
               [dst(oq_g), dst(ok_g)], BT)


def _in_place(body, n_in):
  """The body with dgc in place: refs = the n_in inputs (dgc's, a mutable ref, last), the outputs dq,
  dk and dbeta's parts, the scratch; `body` gets dgc's ref as its dgc output too. Each program reads
  its dgc tile (in `finish`, into registers) before it stores the same tile, and no other program
  touches it."""
  def wrapped(*refs):
    ins, (oq, ok, odb), scratch = refs[:n_in], refs[n_in:n_in + 3], refs[n_in + 3:]
    return body(*ins, oq, ok, ins[-1], odb, *scratch)
  return wrapped


def _kernel(Ta, HV, K, *, scale, interpret, config, skip_tail=False, grad_dtype=F32, packed_T=None,
            tail_zeros=True, seg=False, packed_qk=False, pairs=False, defer_qg=False):
  nslab = K // SLAB
  out = lambda shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)
  kw = dict(seg=True) if seg else {}        # the body's and the tail's
  if pairs:
    kw["pairs"] = pairs             # True, or "slabs" (kda._mosaic_gpu's slab pairs)
  body = functools.partial(_body, scale=scale, bounded=config.bounded == "auto", dA_terms=config.dA_terms,
                           defer_qg=defer_qg, **kw)
  if packed_T is not None:
    body = functools.partial(_packed_body, scale=scale, bounded=config.bounded == "auto", dA_terms=config.dA_terms,
                             packed_qk=packed_qk, defer_qg=defer_qg, **({} if tail_zeros else dict(tail_zeros=False)),
                             **kw)
  elif skip_tail:
    body = skipping_tail(body, functools.partial(_tail, **kw) if tail_zeros else None)
  Tq = Ta if packed_T is None else packed_T
  # the inputs: the lead (src, count, pieces, aligned_cu and the clean flag; or aligned_cu), the levels,
  # seg, then q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dgc
  n_lead = 4 + bool(packed_qk) if packed_T is not None else int(skip_tail)
  body = _in_place(body, n_lead + 1 + bool(seg) + 10)
  return plgpu.kernel(
      body,
      out_type=(out((Tq, HV, K), grad_dtype), out((Tq, HV, K), grad_dtype), out((nslab, HV, Ta))),
      grid=(nslab, HV, Ta // BT), grid_names=("s", "h", "c"),
      scratch_types=_scratch(None if packed_T is None else grad_dtype, packed_qk),
      compiler_params=_params(lane=False, approx_math=config.approx_math),   # Warpgroup (module docstring)
      kernel_name="kda_bwd_intra" if packed_T is None else "kda_bwd_intra_packed",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def apply(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu=None, *, scale, chunk_size,
          grad_dtype=None, interpret=False, config=None, rows=None, pieces=None, T=None, tail_zeros=True,
          seg=None, qk_packed=False, pairs=False, clean=None, defer_qg=False):
  """The stage on the kernel; bf16 or float32 q, k (rounded to bf16; the predicate `supports` adds
  the dtype policy). aligned_cu (optional): with Config.skip_tail the chunks at or past
  aligned_cu[-1] get the accumulators back without anything else read. grad_dtype: dq's and
  dk's dtype (float32 unless given; the kernel rounds them there, as the pipeline would after).
  Packed dq, dk (the unalign folded into their stores): rows = padding.chunk_rows(layout), pieces =
  padding.gap_pieces(rows, aligned_cu, T, 64) and the packed length T (aligned_cu required): dq, dk
  are [1, T, HV, K], chunk c's row r < count[c] at packed row src[c] + r, 0 at tokens of no
  sequence; dbeta, dgc as without. tail_zeros=False (with the tail skipped): the outputs are left
  unwritten at the chunks at or past aligned_cu[-1] (callers that never read them: the packed
  backward). seg (kda.pipeline.segment_rows of a segmented layout, whose reset gates are -inf): each
  chunk's pairs masked to its segments and the resets' -128 steps taken out of gc_int, so that a
  chunk holding one keeps the bounded levels; the same results up to rounding. qk_packed (with
  packed dq, dk): q, k are the packed [1, T, HV, K] arrays, chunk c's rows read from packed rows
  src[c] + r, r < count[c] (the rest of the landed tile taken as 0), so no aligned copy of them need
  exist; the same bits as the aligned call. clean (with qk_packed; a bool scalar, traced or not):
  where true, the non-finite values of q, k are read as 0 too (kda.confine's rerun), with no copy
  and the same kernel. pairs: dq, dk come as their pairs (S3's `pairs`; "slabs": the slab pairs of
  bwd_wy's terms kernel). defer_qg (S3's): dq is S2's
  dqg, the cotangent of qg = q exp(gc), and the kernel forms S3's part of dq, dqg exp(gc), and adds
  dqg q exp(gc) to dgc (each program has its tile of gc in SMEM)."""
  config = config or Config()
  packed = rows is not None
  grad_dtype = jnp.dtype(grad_dtype or F32)
  reason = (f"chunk_size must be {BT}, got {chunk_size}" if chunk_size != BT else
            "qk_packed needs packed dq, dk (rows, pieces, T)" if qk_packed and not packed else
            _reason(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu,
                    grad_dtype if packed else None, T if qk_packed else None, pairs))
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_intra kernel: {reason}")
  _, Ta, HV, K = dgc.shape
  f32 = lambda x: x[0].astype(F32)
  q, k = (x[0].astype(BF16) for x in (q, k))
  beta_t = beta[0].astype(F32).T                   # [HV, Ta]: a head's chunk rows contiguous
  if packed and (aligned_cu is None or pieces is None or not isinstance(T, int)):
    raise ValueError(f"mosaic_gpu bwd_intra kernel: packed dq, dk (rows given) need aligned_cu, pieces and a "
                     f"static int T, got aligned_cu {aligned_cu is not None}, pieces {pieces is not None}, T {T!r}")
  skip = config.skip_tail and aligned_cu is not None
  f = _kernel(Ta, HV, K, scale=float(scale), interpret=interpret, config=config, skip_tail=skip,
              grad_dtype=grad_dtype, packed_T=T if packed else None,
              tail_zeros=bool(tail_zeros) or not (skip or packed), seg=seg is not None, packed_qk=bool(qk_packed),
              pairs=pairs if pairs == "slabs" else bool(pairs), defer_qg=bool(defer_qg))
  cu = (aligned_cu.astype(jnp.int32),) if skip or packed else ()
  if packed:
    cu = (rows.src, rows.count, pieces) + cu
  if qk_packed:
    cu += (clean_flag(clean),)
  if config.bounded == "auto":                    # [HV * NTa]: 5, 4 or 0 (six exact levels)
    flag = bounded_levels(gc_int if seg is None else reset_free(gc_int.astype(F32), seg), gc_frac)
  else:
    flag = jnp.zeros((HV * (Ta // BT),), jnp.int32)
  segs = () if seg is None else (seg.astype(F32),)
  dqk = (dq[0], dk[0]) if pairs else (f32(dq), f32(dk))
  dgc_ref = jax.new_ref(f32(dgc))            # dgc's result over the accumulator (`_in_place`)
  oq, ok, odb = f(*cu, flag, *segs, q, k, beta_t, f32(gc_int), f32(gc_frac), f32(dAqk), dAkk.astype(F32), *dqk,
                  dgc_ref)
  db = dbeta.astype(F32) + jnp.sum(odb, axis=0).T[None]
  return Out(oq[None], ok[None], db, jax.ref.freeze(dgc_ref)[None])
