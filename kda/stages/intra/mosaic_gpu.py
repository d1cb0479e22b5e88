"""intra: the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.intra.

Two kernels, each one program per (value head, chunk), grid (HV, NTa):
- scores: TMA loads of q, k [64, K] (bf16) and the gate cumsum gc [64, K] (float32, one or two
  parts); Akk (as a hi + lo bf16 split, for the solve), Aqk, qg, kg and w's right-hand side
  kd = beta k exp(gc), all bf16. 114696 bytes of SMEM at K = 128 with gc in one part (two CTAs per
  SM), 147464 with two parts.
- solve: Akk's split, kd, v, beta -> Ainv, w, u (82952 bytes at K = V = 128 with RESIDENT_AKK, the
  default: Akk's split stays in SMEM, packed v's landing zone then holds X's: two CTAs per SM;
  66568 without it, Akk's split read once and then holding T's: room for three CTAs by SMEM, but
  243 registers kept it at two before X_FROM_SMEM). With `defer` (the packed forward's
  kda.pipeline.INVERSE_IN_STATE) it forms no w, u: Ainv, its low bf16 part and beta v out, no kd in;
  66568 bytes and 168 registers (H200 ptxas): three CTAs per SM.
Split in two so that each fits two CTAs per SM: as one kernel (1 CTA per SM) it took 4.3 ms on the
H200 at T = 32768, H = 16, K = V = 128, against 1.7-2.0 ms split. Chunks at or past aligned_cu[-1]
(the tail of a static-bound layout) are only zero-filled (Ainv = I there).

Decays by levels. Every pair (i, j), j < i, of a chunk lies in exactly one level s in 64, 32, ..., 2:
the one whose s-token block holds both, i in its second half and j in its first. With r the gc row
at the first token of that second half (gc is non-increasing: gates are <= 0),

    exp(gc_i - gc_j) = exp(gc_i - r) * exp(r - gc_j)         both exponents <= 0

so a level is one product of x * exp(gc - r) (rows of second halves, x = k or q) with
k * exp(r - gc) (rows of first halves), bf16 operands and float32 accumulation, masked to pairs in the
same block. Six levels give every strictly lower pair exactly: no factor above 1 and one underflows
only where the decay itself does. Aqk's diagonal is the plain row dot q_i . k_i.
Bounded chunks (`bounded`: each 16-token half of both 32-token blocks spans <= BOUNDED_SPAN of gc in
every channel: always true for gates >= -5 per token, e.g. safe_gate, and for the usual gates) take
two levels instead: the exact level 64 and the 32-token blocks factored through their middle row,
every factor exp(x) with |x| <= BOUNDED_SPAN (normal in float32 and bf16); entries above the
diagonal may overflow there and are masked out.

(I + Akk)^-1 by block doubling: X_1 = I, X_2s = X_s - X_s L_2s X_s, where L_2s holds Akk's pairs of
level 2s; each product takes hi + lo bf16 splits of both operands (three wgmmas, ~2^-16 relative).
w = X (beta k exp(gc)) and u = X (beta v) take X's split (two wgmmas) and bf16 right-hand sides.
X_FROM_SMEM: X lives as its split in SMEM between the levels, so that the registers hold no X
across the products (177 -> 168 registers for the deferred solve).

Packed inputs (`packed`, the align folded into the loads): q, k, v, beta stay packed [1, T, ...] and
kda.padding.ChunkRows places each aligned chunk (rows r < count[c] read packed token src[c] + r).
TMA takes any packed row into plain (unswizzled) SMEM only, so q, k land there, in a RefUnion with
the level operands (no extra SMEM), and go masked (rows past count: zeros, by a select, since they
hold other sequences' tokens or NaN) into the swizzled tiles; v lands in a plain tile of the solve
that X's split takes after it (no extra SMEM); beta is read from GMEM at src, padded by BT so no read leaves it.
The results equal `apply` on the aligned inputs.

Out (bf16, the dtype policy for bf16 inputs): Akk, Aqk, Ainv, w, u, qg, kg. The stage predicate
(`takes`) refuses float32 q/k/v: their float32 accuracy needs the pallas or reference stage.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, COL, F32, HEAD_DIMS, MAX_GRID_YZ, ROW, WG
from kda._mosaic_gpu import params as _mgpu_params
from kda._mosaic_gpu import live_chunk
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda.stages.gate import GATE_FLOOR, exponent
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import Out, to_chunks

# Lane semantics (kda._mosaic_gpu.params): lowers in 3.0 s instead of 7.9 (both scores kernels, on a
# CPU) but runs slower (H200, A: intra 1.034 ms vs 0.953)
LANE = False

BT = 64
BOUNDED_SPAN = 80.0       # exp(+-80) is a normal float32 / bf16 number
SLAB = 64                 # gc / operand columns handled at once (register pressure)
PERSISTENT_CTAS = 128     # programs of the persistent (fallback) scores kernel: one per SM
SCAN_BLOCK = 8            # rows of the gated scan loaded together (`_gate_scan`)
# The one-part gated kernel skips the work of chunks the two-part kernel redoes (not bounded)
SKIP_STRONG = True
# True: the two-part scores kernel alone, no lax.cond to the gc_frac-only one (which gives the same
# bits while gc_int == 0). H200: the same bits, fwd+bwd compiles 3-9 s faster, but runs 0.3-0.4 ms
# slower on plain gates (A 9.54 vs 9.15 ms, C 9.35 vs 9.04): off.
TWO_PART_ONLY = False
# True: no lax.cond between the one- and two-part scores kernels (its predicate makes the host wait
# for the gate kernel); the one-part kernel takes every chunk, then a persistent two-part kernel
# redoes in place the chunks whose gc_int is not 0 (`two_parts_needed`) and exits at once where there
# is none. H200 (2026-12-03, forward, the same bits everywhere): back to back A 1.459 ms against
# 1.433 with the cond, B 1.560 / 1.554, C 1.395 / 1.396, and 2.343 against 1.804 where gates reach
# -1 in every chunk (A, plain gates x 40: the one-part work is redone); host-timed no better
# (A 1.775 / 1.746, B 2.087 / 1.950, C 1.632 / 1.702): off.
COND_FREE = False
# True: the solve keeps Akk's split in SMEM (82952 bytes at K = V = 128: two CTAs per SM) and forms
# each level's T = L_2s X_s as the level's mask of Akk @ X_s (X_s block-diagonal, so the other
# entries of Akk meet exact zeros): per level two tile stores and one mask fewer, and Akk not held
# in registers across the levels. H200 (2026-12-03, A forward back to back): 1.394 against 1.423 ms
# (the solve 0.424 against 0.454 ms), gates x 640 4.069 against 4.103; o within one bf16 rounding of
# the other (max |d| 2.4e-4 of max |o| 0.148: the hardware's wgmma sums the masked entries' exact
# zeros in another order; the same bits in the simulator).
RESIDENT_AKK = True
# True (with RESIDENT_AKK): the doubling keeps X in SMEM only (its bf16 split, which the products
# read anyway) and forms X_2s = (hi + lo) - X_s T from it, so that X is not live in registers across
# the wgmmas (the solve's register count decides its CTAs per SM). hi + lo is X to ~2^-18 relative,
# below the split products' own ~2^-16.
X_FROM_SMEM = True


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the intra kernel."""
  bounded: str = "auto"     # "auto": bounded chunks take the two-level path; "never": six levels always
  two_part: str = "auto"    # "auto": gc_frac alone while gc_int == 0 everywhere; "always": both parts
  approx_math: bool = True   # Mosaic GPU's fast exp (ex2.approx): ~2^-22 relative, far below bf16 stores
  probe: str = ""           # profiling only: "scores" runs the first kernel alone (Ainv, w, u zero)

  def __post_init__(self):
    if self.probe not in ("", "scores"):
      raise ValueError(f"probe must be '' or 'scores', got {self.probe!r}")
    if self.bounded not in ("auto", "never"):
      raise ValueError(f"bounded must be 'auto' or 'never', got {self.bounded!r}")
    if self.two_part not in ("auto", "always"):
      raise ValueError(f"two_part must be 'auto' or 'always', got {self.two_part!r}")


class Deferred(NamedTuple):
  """The solve's results with `defer` (kda.fused.state_output's inverse mode reads them in place of
  w, u): Out.Ainv is X's high bf16 part, as always."""
  kd: jax.Array       # [1, Ta, HV, K] bf16, beta k exp(gc): w = X kd
  bv: jax.Array       # [1, Ta, HV, V] bf16, beta v: u = X bv
  ainv_lo: jax.Array  # [1, Ta, HV, BT] bf16, X - Ainv rounded to bf16


def supports(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, **_) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  if k.ndim != 4 or k.shape[0] != 1:
    return f"k must be [1, Ta, HV, K], got shape {k.shape}"
  _, Ta, HV, K = k.shape
  if K not in HEAD_DIMS:
    return f"K must be one of {HEAD_DIMS}, got {K}"
  if v.ndim != 4 or v.shape[:3] != (1, Ta, HV) or v.shape[3] not in HEAD_DIMS:
    return f"v must be [1, Ta, HV, V] with V in {HEAD_DIMS} and k's Ta, HV, got {v.shape}"
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  for name, x in (("q", q), ("gc_int", gc_int), ("gc_frac", gc_frac)):
    if x.shape != k.shape:
      return f"{name} must have shape {k.shape}, got {x.shape}"
  if beta.shape != (1, Ta, HV):
    return f"beta must have shape {(1, Ta, HV)}, got {beta.shape}"
  if aligned_cu is not None and (aligned_cu.ndim != 1 or not jnp.issubdtype(aligned_cu.dtype, jnp.integer)):
    return f"aligned_cu must be None or a 1-D integer array, got {aligned_cu.dtype}{list(aligned_cu.shape)}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  return None


def takes(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, **_) -> Optional[str]:
  """The stage's predicate: `supports`, and bf16 q, k, v (the kernel's operands are bf16; float32
  inputs keep float32 accuracy on the pallas or reference stage)."""
  reason = supports(q, k, v, beta, gc_int, gc_frac, aligned_cu, scale=scale, chunk_size=chunk_size)
  if reason is None:
    bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("q", q), ("k", k), ("v", v))
           if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
    if bad:
      reason = f"mosaic_gpu intra takes bfloat16 q, k, v, got {', '.join(bad)}"
  return reason


def bounded_chunks(gc_int, gc_frac):
  """[HV * NTa] int32, row-major (head, chunk): 1 where the two-level path is exact to float32
  factors (module docstring), 0 elsewhere (NaN gates included)."""
  gi, gf = (to_chunks(x.astype(F32), BT) for x in (gc_int, gc_frac))    # [NTa, BT, HV, K]
  at = lambda r: (gi[:, r], gf[:, r])
  span = jnp.zeros(gi.shape[:1] + gi.shape[2:], F32)
  for a, m, e in ((0, 16, 31), (32, 48, 63)):
    span = jnp.maximum(span, jnp.maximum(exponent(*at(a), *at(m)), exponent(*at(m), *at(e))))
  ok = jnp.all(span <= BOUNDED_SPAN, axis=-1)                           # [NTa, HV]; NaN -> False
  return ok.T.reshape(-1).astype(jnp.int32)


def two_parts_needed(gc_int):
  """[HV * NTa] int32, row-major (head, chunk): 1 where the chunk's gc_int is not 0 (NaN included),
  i.e. where the one-part scores kernel would not be exact."""
  gi = to_chunks(gc_int.astype(F32), BT)                                # [NTa, BT, HV, K]
  return jnp.any(gi != 0, axis=(1, 3)).T.reshape(-1).astype(jnp.int32)


def _log2(n):
  return n.bit_length() - 1


def _beta(b_g, i_h, rows, src, cnt):
  """shape -> beta of the chunk's rows broadcast along columns: from the aligned [HV, Ta] rows, or
  (packed) from the packed [HV, T + BT] rows at src with rows past cnt set to 0 (a select: they may
  hold other sequences' values, NaN included)."""
  if src is None:
    b = _load(b_g.at[i_h, rows], ROW)
    return lambda shape: lax.broadcast_in_dim(b, shape, [0])
  b = _load(b_g.at[i_h, pl.ds(src, BT)], ROW)
  return lambda shape: jnp.where(_iota(0, shape) < cnt, lax.broadcast_in_dim(b, shape, [0]), 0.0)


def _scores_body(cu_g, *rest, scale, two_part, bounded, packed, tail_zeros=True, gated=False, persistent=0,
                 seg=False):
  """Kernel 1, per (head, chunk): Akk (hi + lo bf16 split), Aqk, qg, kg and w's right-hand side
  kd = beta k exp(gc), all bf16. packed: q, k, beta come packed and `src`, `cnt` place the chunk.
  gated (packed, K = 128; kda.fused.gate_intra): the raw gates come packed in place of gc and the
  gate's row scan runs here (`_gate_scan`); each program also stores its gc row 63 (both parts'
  where two_part) and, one part, per column 1.0 where the chunk is not bounded (`_gate_scan`).
  persistent = W: grid (HV, W), program w takes chunks w, w + W, ..., those whose int32 flag
  redo[h * NTa + c] is nonzero, and only if the int32 pred after cu is (else it exits at once).
  seg (not gated): a [2, Ta] float32 input after the flags, kda.pipeline.segment_rows: pairs of
  different segments masked out, qg and kd zero after the chunk's first reset, kg zero before its
  last, gc_int taken without the resets' -128 steps (`reset_free`)."""
  rest = list(rest)
  pred_g, redo_g = (rest.pop(0), rest.pop(0)) if persistent else (None, None)
  flag_g = None if gated else rest.pop(0)
  seg_g = rest.pop(0) if seg else None
  if packed:
    src_g, cnt_g, *rest = rest
  q_g, k_g, b_g, *rest = rest
  if gated:
    g_g, *rest = rest
  elif two_part:
    gi_g, gf_g, *rest = rest
  else:
    gf_g, *rest = rest
  # swizzled SMEM first, the plain buffers after it: no alignment gaps (two CTAs per SM at K = 128)
  akh_g, akl_g, aqk_g, qg_g, kg_g, kd_g, *rest = rest
  lasti_g = nz_g = None
  if gated and two_part:
    lasti_g, last_g, *rest = rest
  elif gated:
    last_g, nz_g, *rest = rest
  q_s, k_s, *rest = rest
  if packed:      # q, k (and bf16 gates) land in plain SMEM that shares the level operands' bytes
    ops, *rest = rest
    (lk_s, lq_s, rk_s), landing = ops
  else:
    lk_s, lq_s, rk_s, *rest = rest
  if two_part:
    gi_s, gf_s, bar = rest
  else:
    gf_s, bar = rest
    gi_s = None
  NTa = qg_g.shape[0] // BT
  K = q_g.shape[2]
  i_h = lax.axis_index("h")
  slabs = [pl.ds(s * SLAB, SLAB) for s in range(K // SLAB)]

  def chunk(c):     # the work of chunk c
    rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
    src = src_g[c] if packed else None
    cnt = cnt_g[c] if packed else None

    def compute():
      if packed:      # any packed row: plain SMEM takes TMA there (swizzled needs multiples of 8)
        plgpu.copy_gmem_to_smem(q_g.at[pl.ds(src, BT), i_h, :], landing[0], bar)
        plgpu.copy_gmem_to_smem(k_g.at[pl.ds(src, BT), i_h, :], landing[1], bar)
      else:
        plgpu.copy_gmem_to_smem(q_g.at[rows, i_h, :], q_s, bar)
        plgpu.copy_gmem_to_smem(k_g.at[rows, i_h, :], k_s, bar)
      if gated:       # float32 gates land in gc's tile and the scan overwrites them row by row
        g_land = gf_s if g_g.dtype == F32 else landing[2]
        plgpu.copy_gmem_to_smem(g_g.at[pl.ds(src, BT), i_h, :], g_land, bar)
      else:
        plgpu.copy_gmem_to_smem(gf_g.at[rows, i_h, :], gf_s, bar)
      if two_part and not gated:
        plgpu.copy_gmem_to_smem(gi_g.at[rows, i_h, :], gi_s, bar)
      plgpu.barrier_wait(bar)
      if packed:      # rows past the chunk's tokens belong to other sequences (or none): zeros
        # whole tiles: a column slice of a plain bf16 tile loads wrong on the H200 (right in the
        # simulator; plain float32 gc tiles slice fine there)
        real = _iota(0, (BT, K)) < cnt
        for land, dst in zip(landing, (q_s, k_s)):
          dst[...] = jnp.where(real, _load(land), jnp.zeros((), BF16))
        if gated and not two_part and SKIP_STRONG:   # q's raw tile is read before it takes the flags
          plgpu.commit_smem()
        if gated:
          flag = _gate_scan(g_land, gf_s, gi_s, last_g, lasti_g, nz_g, c, i_h, cnt,
                            flag_s=landing[0] if SKIP_STRONG else None)
        plgpu.commit_smem()   # also a warpgroup barrier: the landing zone is read before reuse
      if seg:
        n_row, start_row = (_load(seg_g.at[i, rows], ROW) for i in (0, 1))
        n_last = seg_g[0, c * BT + BT - 1]
        per_row = lambda v, shape: lax.broadcast_in_dim(v, shape, [0])
        if two_part:        # gc_int without the resets' steps, in place (one part: gc_frac has none)
          for cols in slabs:
            gi_s.at[:, cols][...] = _load(gi_s.at[:, cols]) - GATE_FLOOR * per_row(n_row, (BT, SLAB))
          plgpu.commit_smem()

      def scores():
        # gc as one array or a tuple of its two parts; `diff` forms gc_a - gc_b from them
        def g_tile(cols):
          if two_part:
            return _load(gi_s.at[:, cols]), _load(gf_s.at[:, cols])
          return _load(gf_s.at[:, cols])

        def g_row(r, cols, shape):
          vec = lambda s_: lax.broadcast_in_dim(_load(s_.at[r, cols], COL), shape, [1])
          return (vec(gi_s), vec(gf_s)) if two_part else vec(gf_s)

        def where(m, a, b):
          if two_part:
            return tuple(jnp.where(m, x, y) for x, y in zip(a, b))
          return jnp.where(m, a, b)

        diff = (lambda a, b: exponent(*a, *b)) if two_part else (lambda a, b: a - b)
        whole = (lambda a: exponent(*a)) if two_part else (lambda a: a)

        def operands(ls, both_sides):
          """Level s = 2**ls (ls may be traced) into SMEM: lk/lq = k/q * exp(gc - r), rk = k * exp(r - gc),
          r the row at the first token of each s-block's second half; exact levels zero lk/lq outside
          second halves and rk outside first halves, the bounded level keeps every row."""
          shape = (BT, SLAB)
          row = _iota(0, shape)
          blk = row >> ls
          half = 1 << (ls - 1)
          for i, cols in enumerate(slabs):
            G = g_tile(cols)

            def pick(b, R, cols=cols):
              return where(blk == b, g_row((b << ls) + half, cols, shape), R)
            R = lax.fori_loop(1, BT >> ls, pick, g_row(half, cols, shape))   # one select per block
            kx = _load(k_s.at[:, cols]).astype(F32)
            qx = _load(q_s.at[:, cols]).astype(F32)
            if both_sides:
              e_l, e_r = jnp.exp(diff(G, R)), jnp.exp(diff(R, G))
              lk, lq, rk = kx * e_l, qx * e_l, kx * e_r
            else:
              second = (row & ((1 << ls) - 1)) >= half
              e = jnp.exp(jnp.where(second, diff(G, R), diff(R, G)))
              lk = jnp.where(second, kx * e, 0.0)
              lq = jnp.where(second, qx * e, 0.0)
              rk = jnp.where(second, 0.0, kx * e)
            lk_s.at[i][...] = lk.astype(BF16)
            lq_s.at[i][...] = lq.astype(BF16)
            rk_s.at[i][...] = rk.astype(BF16)
          plgpu.commit_smem()

        def products():
          n = range(len(slabs))
          return (_acc([(lk_s.at[i], rk_s.at[i].T) for i in n], (BT, BT)),
                  _acc([(lq_s.at[i], rk_s.at[i].T) for i in n], (BT, BT)))

        row, col = _iota(0, (BT, BT)), _iota(1, (BT, BT))
        beta = _beta(b_g, i_h, rows, src, cnt)   # from GMEM: no SMEM for it
        operands(6, both_sides=False)          # level 64: no mask (its operands are zero elsewhere)
        p_kk, p_qk = products()

        def store_scores(a_kk, a_qk):
          # Akk's split and Aqk into the (now free) operand buffers' [64, 64] slabs
          if seg:           # j <= i in i's segment: j at or after its start row
            same = col.astype(F32) >= per_row(start_row, (BT, BT))
            a_kk, a_qk = jnp.where(same, a_kk, 0.0), jnp.where(same, a_qk, 0.0)
          hi, lo = _split(a_kk * beta((BT, BT)))
          lk_s.at[0][...] = hi
          lk_s.at[1][...] = lo
          lq_s.at[0][...] = (a_qk * scale).astype(BF16)

        def exact():
          # Aqk's diagonal: the plain q . k of each row (a wgmma: a row sum would take SMEM scratch)
          a_qk = p_qk + jnp.where(row == col, _acc([(q_s, k_s.T)], (BT, BT)), 0.0)

          def level(t, acc):                 # s = 32, 16, 8, 4, 2: one copy of the code for all five
            ls = 5 - t
            operands(ls, both_sides=False)
            kk, qk = products()
            same = (row >> ls) == (col >> ls)
            return acc[0] + jnp.where(same, kk, 0.0), acc[1] + jnp.where(same, qk, 0.0)
          store_scores(*lax.fori_loop(0, 5, level, (p_kk, a_qk)))

        def two_levels():
          operands(5, both_sides=True)
          kk, qk = products()
          same = (row >> 5) == (col >> 5)
          store_scores(p_kk + jnp.where(same & (col < row), kk, 0.0),
                       p_qk + jnp.where(same & (col <= row), qk, 0.0))

        if bounded and gated and not two_part:   # every chunk the one-part fused path keeps is bounded
          two_levels()
        elif bounded:
          bound = flag if gated else flag_g[i_h * NTa + c]
          pl.when(bound != 0)(two_levels)
          pl.when(bound == 0)(exact)
        else:
          exact()

        # qg, kg and kd in place of q, k and their level operands' buffers
        for i, cols in enumerate(slabs):
          G = g_tile(cols)
          last = g_row(BT - 1, cols, (BT, SLAB))
          qx = _load(q_s.at[:, cols]).astype(F32)
          kx = _load(k_s.at[:, cols]).astype(F32)
          e = jnp.exp(whole(G))
          e_last = jnp.exp(diff(last, G))
          if seg:           # the state entering the chunk reaches its first segment only, and the
            n = per_row(n_row, (BT, SLAB))     # state leaving it holds its last segment only
            e, e_last = jnp.where(n == 0, e, 0.0), jnp.where(n == n_last, e_last, 0.0)
          q_s.at[:, cols][...] = (qx * e).astype(BF16)
          k_s.at[:, cols][...] = (kx * e_last).astype(BF16)
          rk_s.at[i][...] = (beta((BT, SLAB)) * kx * e).astype(BF16)

      if gated and not two_part and SKIP_STRONG:   # a chunk not bounded: the two-part kernel's
        pl.when(_any_flag(landing[0]) == 0)(scores)
      else:
        scores()

    live = live_chunk(cu_g, c, BT)              # chunks past aligned_cu[-1] hold no token
    pl.when(live)(compute)

    @pl.when(jnp.logical_not(live))
    def _():                                      # tail: zeros (its inputs are zeros anyway)
      zero = lambda shape: plgpu.layout_cast(jnp.zeros(shape, BF16), WG)
      if gated:
        line0 = plgpu.layout_cast(jnp.zeros((K,), F32), gate_mgpu.LINE)
        for ref in (last_g, lasti_g if two_part else nz_g):
          ref[c, i_h, :] = line0
      lq_s.at[0][...] = zero((BT, BT))
      if tail_zeros:
        for buf in (lk_s.at[0], lk_s.at[1]):
          buf[...] = zero((BT, BT))
        for i, cols in enumerate(slabs):
          q_s.at[:, cols][...] = zero((BT, SLAB))
          k_s.at[:, cols][...] = zero((BT, SLAB))
          rk_s.at[i][...] = zero((BT, SLAB))

    def store_rest():
      plgpu.copy_smem_to_gmem(lk_s.at[0], akh_g.at[rows, i_h, :])
      plgpu.copy_smem_to_gmem(lk_s.at[1], akl_g.at[rows, i_h, :])
      plgpu.copy_smem_to_gmem(q_s, qg_g.at[rows, i_h, :])
      plgpu.copy_smem_to_gmem(k_s, kg_g.at[rows, i_h, :])
      for i, cols in enumerate(slabs):
        plgpu.copy_smem_to_gmem(rk_s.at[i], kd_g.at[rows, i_h, cols])

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lq_s.at[0], aqk_g.at[rows, i_h, :])   # Aqk, a residual: its tail zeros always
    if tail_zeros:
      store_rest()
    else:           # the tail's Akk, qg, kg, kd left unwritten: only this forward's kernels read them
      pl.when(live)(store_rest)
    plgpu.wait_smem_to_gmem(0)

  if persistent:
    W, w = persistent, lax.axis_index("c")

    @pl.when(pred_g[0] != 0)
    def _():
      def step(i, carry):
        c = w + i * W
        pl.when(redo_g[i_h * NTa + c] != 0)(lambda: chunk(c))
        return carry
      lax.fori_loop(0, (NTa - w + W - 1) // W, step, 0)
  else:
    chunk(lax.axis_index("c"))


def _any_flag(flag_s):
  """1.0 if any of the 128 bf16 flags in flag_s's row 0 is nonzero, else 0.0: a scalar in every
  thread, by scalar SMEM reads (no cross-warp reduction: its scratch would cost the kernel its second
  CTA)."""
  return lax.fori_loop(0, gate_mgpu.COLS, lambda j, m: jnp.maximum(m, flag_s[0, j].astype(F32)),
                       jnp.float32(0.0), unroll=16)


def _gate_scan(g_s, gf_s, gi_s, last_g, lasti_g, nz_g, c, i_h, cnt, flag_s=None):
  """The gate kernel's row scan (kda.stages.gate.mosaic_gpu, no activation) on the chunk's raw gates
  g_s [BT, 128] (rows >= cnt masked), the same operations in the same order, gc_int and gc_frac
  summed apart (in place where g_s is gf_s: each thread reads its column's row before writing it).
  Two parts: gc_frac and gc_int row by row into gf_s and gi_s, gc row 63 to last_g[c, i_h] and
  lasti_g; returns the chunk's bounded flag (int32 scalar, as bounded_chunks: the six rows' spans
  per column, then a min over the columns).
  One part (gi_s None): gc = gc_int + gc_frac (one float32 rounding; gc_frac itself while gc_int is
  0, i.e. every gate above -1) into gf_s, its row 63 to last_g, and to nz_g[c, i_h] per column 1.0
  where the chunk is not bounded (a span of bounded_chunks above BOUNDED_SPAN, or NaN), else 0.0:
  the two-part kernel redoes those chunks exactly. A bounded chunk's gc stays within 576 of 0 (four
  spans and two single rows floored at -128), so the one rounding moves a decay by < 2^-14 relative.
  flag_s (a plain bf16 [64, 128] SMEM tile): nz into its row 0 too, for the caller's skip of those
  chunks (SKIP_STRONG; a cross-warp reduction's SMEM scratch, 1 KiB as allocated, would take this
  kernel 8 bytes over two CTAs per SM). Returns None."""
  LINE, two = gate_mgpu.LINE, gi_s is not None

  def block(b, carry):
    # a block's rows are all loaded before any of its stores: the stores (maybe to the same tile)
    # would otherwise hold each next load back, a latency per row at two CTAs per SM
    acc_i, acc_f = carry
    r0 = b * SCAN_BLOCK
    xs = [plgpu.load(g_s.at[r0 + i], layout=LINE, optimized=False) for i in range(SCAN_BLOCK)]
    for i, x in enumerate(xs):
      r = r0 + i
      real = r < cnt
      x, whole = gate_mgpu.row_parts(x, lambda real=real: real)
      acc_i = acc_i + whole
      acc_f = acc_f + (x - whole)
      if two:
        gi_s.at[r][...] = acc_i
        gf_s.at[r][...] = acc_f
      else:
        gf_s.at[r][...] = acc_i + acc_f
    return acc_i, acc_f

  zero = plgpu.layout_cast(jnp.zeros((gate_mgpu.COLS,), F32), LINE)
  acc_i, acc_f = lax.fori_loop(0, BT // SCAN_BLOCK, block, (zero, zero))
  if two:
    last_g[c, i_h, :] = acc_f
    lasti_g[c, i_h, :] = acc_i
    at = lambda r: [plgpu.load(x.at[r], layout=LINE, optimized=False) for x in (gi_s, gf_s)]  # own column
    diff = lambda u, v: exponent(*at(u), *at(v))
  else:
    last_g[c, i_h, :] = acc_i + acc_f
    at = lambda r: plgpu.load(gf_s.at[r], layout=LINE, optimized=False)
    diff = lambda u, v: at(u) - at(v)
  span = None
  for a, m, e in gate_mgpu.SPAN_ROWS:
    for u, v in ((a, m), (m, e)):
      d = diff(u, v)
      span = d if span is None else jnp.maximum(span, d)      # NaN-propagating, as the gate kernel's
  fine = jnp.where(span <= BOUNDED_SPAN, 1.0, 0.0)            # NaN -> 0, as bounded_chunks
  if two:
    return (jnp.min(fine) > 0.5).astype(jnp.int32)
  nz_g[c, i_h, :] = 1.0 - fine
  if flag_s is not None:
    flag_s.at[0][...] = (1.0 - fine).astype(BF16)
  return None


def _solve_body(cu_g, *refs, packed, tail_zeros=True, resident=False, defer=False):
  """Kernel 2, per (head, chunk): X = (I + Akk)^-1 by block doubling, w = X kd, u = X (beta v).
  packed: v and beta come packed, v lands in plain SMEM (`vl_s`) at the chunk's packed row.
  resident (RESIDENT_AKK): Akk's split stays in SMEM and T = mask(Akk @ X).
  defer (kda.fused.state_output's `inverse`): no kd, w, u; X's split (hi, lo) and beta v (bf16) are
  stored instead, and the state + output kernel applies X: v_new = X (beta v - kd S)."""
  if packed:
    src_g, cnt_g, *refs = refs
  if defer:
    akh_g, akl_g, v_g, b_g, ainv_g, ainvl_g, bv_g, a_u, v_s, x_u, b_s, bar = refs
    kd_g = kd_s = None
  else:
    akh_g, akl_g, kd_g, v_g, b_g, ainv_g, w_g, u_g, a_u, kd_s, v_s, x_u, b_s, bar = refs
  (ah_s, al_s), (th_s, tl_s) = a_u      # not resident: Akk's split is read once, then T's takes its bytes
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
      beta = _beta(b_g, i_h, rows, src, cnt)((BT, V))
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
    plgpu.commit_smem()   # also a warpgroup barrier: ah, al (and vl) are read before T (and X) take them
    if defer:       # beta v leaves now: its store runs under the doubling
      plgpu.copy_smem_to_gmem(v_s, bv_g.at[rows, i_h, :])

    def split_mm(a, a_store, b, b_store):
      if a_store is not None:
        a_store[0][...], a_store[1][...] = _split(a)
      b_store[0][...], b_store[1][...] = _split(b)
      plgpu.commit_smem()
      (ah, al), (bh, bl) = a_store or (xh_s, xl_s), b_store
      return _acc([(ah, bh), (ah, bl), (al, bh)], (BT, BT))

    eye = jnp.where(row == col, 1.0, 0.0).astype(F32)
    X = eye - jnp.where((row >> 1) == (col >> 1), a_kk, 0.0)
    from_smem = resident and X_FROM_SMEM
    if from_smem:
      xh_s[...], xl_s[...] = _split(X)
      plgpu.commit_smem()
    for s in (2, 4, 8, 16, 32):
      half = _log2(s)
      level = (((row >> (half + 1)) == (col >> (half + 1))) & (((row >> half) & 1) == 1)
               & (((col >> half) & 1) == 0))                  # (i, j): i in a 2s-block's second half, j in its first
      if from_smem:   # X's split is in xh_s, xl_s; X itself is not held across the products
        T = jnp.where(level, _acc([(ah_s, xh_s), (ah_s, xl_s), (al_s, xh_s)], (BT, BT)), 0.0)  # L @ X
        XT = split_mm(None, None, T, (th_s, tl_s))
        X = _load(xh_s).astype(F32) + _load(xl_s).astype(F32) - XT
        xh_s[...], xl_s[...] = _split(X)
        plgpu.commit_smem()
        continue
      if resident:
        xh_s[...], xl_s[...] = _split(X)
        plgpu.commit_smem()
        T = jnp.where(level, _acc([(ah_s, xh_s), (ah_s, xl_s), (al_s, xh_s)], (BT, BT)), 0.0)  # L @ X
      else:
        T = split_mm(jnp.where(level, a_kk, 0.0), (th_s, tl_s), X, (xh_s, xl_s))          # L @ X
      X = X - split_mm(None, None, T, (th_s, tl_s))           # X @ T (X's split is in xh_s, xl_s)
    if not from_smem:
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


def _params(config):
  return _mgpu_params(LANE, approx_math=config.approx_math)


def _scores(cu, rows, q, k, beta_t, gis, flag, *, scale, bounded, interpret, config, tail_zeros=True, Ta=None,
            into=None, pred=None, seg=None):
  """Kernel 1; gis = (gc_int, gc_frac) or (gc_frac,); rows: ChunkRows (packed q, k, beta_t) or None.
  flag None: gated (gis = (g,), the packed raw gates [T, HV, 128]; Ta given): one part -> also
  (gc row 63, per column 1.0 where the chunk is not bounded), both [NTa, HV, K]; with pred = (int32 [1], the chunks
  to redo: int32 [HV * NTa]) both parts, persistent (module docstring of kda.fused.gate_intra) ->
  also (gc_int, gc_frac row 63).
  into: the refs (jax.new_ref) the results are written into in place, returning nothing.
  seg: kda.pipeline.segment_rows (not gated)."""
  gated = flag is None
  if gated and seg is not None:
    raise ValueError("mosaic_gpu intra: segment rows (seg) need gc from the gate kernel, not the gated scan")
  K = q.shape[2]
  Ta, HV = (Ta, q.shape[1]) if gated else gis[0].shape[:2]
  two_part = len(gis) == 2 or pred is not None
  packed = rows is not None
  NTa = Ta // BT
  W = max(1, min(NTa, PERSISTENT_CTAS // HV)) if pred is not None else 0
  body = functools.partial(_scores_body, scale=scale, two_part=two_part, bounded=bounded, packed=packed,
                           tail_zeros=tail_zeros, gated=gated, persistent=W, seg=seg is not None)
  shape = lambda d: jax.ShapeDtypeStruct((Ta, HV, d), BF16)
  ops = [_swz((max(K // SLAB, 2), BT, SLAB)) for _ in range(3)]   # [64, 64] slabs; two at K = 64 too
  if packed:    # the landing zone of q, k (bf16 gates) shares the operands' bytes (never live together)
    bf16_g = gated and gis[0].dtype != F32
    ops = plgpu.RefUnion(ops, [plgpu.SMEM((BT, K), BF16) for _ in range(2 + bf16_g)])
  stats = [jax.ShapeDtypeStruct((NTa, HV, K), F32)] * 2 if gated else []
  outs = (shape(BT), shape(BT), shape(BT), shape(K), shape(K), shape(K), *stats)
  f = plgpu.kernel(
      body,
      out_type=() if into else outs,      # in place: the refs follow the inputs, as the outputs would
      grid=(HV, W or NTa), grid_names=("h", "c"),
      scratch_types=[
          _swz((BT, K)), _swz((BT, K)),
          *([ops] if packed else ops),                     # level operands lk, lq, rk
          *[plgpu.SMEM((BT, K), F32) for _ in range(1 + two_part)],
          plgpu.Barrier(num_arrivals=3 if gated else 2 + len(gis)),
      ],
      compiler_params=_params(config),
      kernel_name=("kda_gate_intra_scores_strong" if W else "kda_gate_intra_scores") if gated else "kda_intra_scores",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  lead = () if pred is None else tuple(pred)
  return f(cu, *lead, *(() if gated else (flag,)), *(() if seg is None else (seg,)), *(() if rows is None else rows),
           q, k, beta_t, *gis, *(into or ()))


def _solve(cu, rows, akh, akl, kd, v, beta_t, *, interpret, config, tail_zeros=True, defer=False):
  """-> (Ainv, w, u) [Ta, HV, *] bf16; defer (kd None): (Ainv, Ainv's low bf16 part, beta v)."""
  HV, V = v.shape[1], v.shape[-1]
  Ta = akh.shape[0]
  packed = rows is not None
  shape = lambda d: jax.ShapeDtypeStruct((Ta, HV, d), BF16)
  akk_t = ([_swz((BT, BT)), _swz((BT, BT))], [_swz((BT, BT)), _swz((BT, BT))])         # Akk's split, T's
  outs = (shape(BT), shape(BT), shape(V)) if defer else (shape(BT), shape(kd.shape[-1]), shape(V))
  f = plgpu.kernel(
      functools.partial(_solve_body, packed=packed, tail_zeros=tail_zeros, resident=RESIDENT_AKK, defer=defer),
      out_type=outs,
      grid=(HV, Ta // BT), grid_names=("h", "c"),
      scratch_types=[
          list(akk_t) if RESIDENT_AKK else plgpu.RefUnion(*akk_t),
          *([] if defer else [_swz((BT, kd.shape[-1]))]), _swz((BT, V)),
          plgpu.RefUnion([plgpu.SMEM((BT, V), BF16)], [_swz((BT, BT)), _swz((BT, BT))])     # v landing | X
          if packed else [_swz((BT, BT)), _swz((BT, BT))],
          plgpu.SMEM((BT,), F32),
          plgpu.Barrier(num_arrivals=(4 if packed else 5) - defer),
      ],
      compiler_params=_params(config),
      kernel_name="kda_intra_solve_x" if defer else "kda_intra_solve",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return f(cu, *(() if rows is None else rows), akh, akl, *(() if defer else (kd,)), v, beta_t)


def apply(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, interpret=False,
          config=None, seg=None):
  """The stage on the kernels. seg (kda.pipeline.segment_rows of a segmented layout, whose reset
  gates are -inf): each chunk's pairs masked to its segments and the resets' -128 steps taken out of
  gc_int, so that a chunk holding one stays bounded; the same results up to rounding."""
  config = config or Config()
  reason = supports(q, k, v, beta, gc_int, gc_frac, aligned_cu, scale=scale, chunk_size=chunk_size)
  if reason is not None:
    raise ValueError(f"mosaic_gpu intra kernel: {reason}")
  Ta = k.shape[1]
  beta_t = beta[0].astype(F32).T                                  # [HV, Ta]: contiguous rows for TMA
  return _apply(q, k, v, beta_t, gc_int, gc_frac, aligned_cu, None, None, None, scale=scale,
                interpret=interpret, config=config, Ta=Ta, seg=seg)


def packed_supports(q, k, v, beta, gc_int, gc_frac, aligned_cu, rows, *, scale, chunk_size,
                    **_) -> Optional[str]:
  """None if `packed` takes this call (q, k, v, beta packed [1, T, ...], gc aligned), else why."""
  if q.ndim != 4 or q.shape[0] != 1:
    return f"q must be packed [1, T, HV, K], got shape {q.shape}"
  T = q.shape[1]
  Ta = gc_frac.shape[1] if gc_frac.ndim == 4 else -1
  aligned = lambda x, d: jax.ShapeDtypeStruct((1, Ta) + x.shape[2:3] + (d,), x.dtype)
  reason = takes(aligned(q, q.shape[3]), aligned(k, k.shape[3]), aligned(v, v.shape[-1]),
                 jax.ShapeDtypeStruct((1, Ta) + beta.shape[2:], beta.dtype), gc_int, gc_frac, aligned_cu,
                 scale=scale, chunk_size=chunk_size)
  if reason is not None:
    return reason
  for name, x in (("k", k), ("v", v), ("beta", beta)):
    if x.shape[:2] != (1, T):
      return f"{name} must be packed like q [1, {T}, ...], got shape {x.shape}"
  if aligned_cu is None:
    return "packed inputs need aligned_cu"
  NTa = Ta // BT
  for name, x in (("rows.src", rows.src), ("rows.count", rows.count)):
    if x.shape != (NTa,) or not jnp.issubdtype(x.dtype, jnp.integer):
      return f"{name} must be [{NTa}] integers, got {x.dtype}{list(x.shape)}"
  return None


def packed_beta_rows(beta, rows):
  """The packed kernels' beta [HV, T + BT] float32 (a chunk's BT rows from any src < T stay inside:
  those loads are not TMA) and rows as an int32 (src, count) tuple."""
  return jnp.pad(beta[0].astype(F32).T, ((0, 0), (0, BT))), tuple(x.astype(jnp.int32) for x in rows)


def packed(q, k, v, beta, gc_int, gc_frac, aligned_cu, rows, *, scale, chunk_size, bounded=None,
           two_part=None, interpret=False, config=None, tail_zeros=True, seg=None, defer=False):
  """`apply` on packed q, k, v [1, T, ...], beta [1, T, HV]: the align folded into the loads.

  rows (kda.padding.ChunkRows) places each aligned chunk: its rows r < rows.count[c] read packed
  token rows.src[c] + r, the others are zeros, so the result equals `apply` on the aligned inputs.
  gc_int, gc_frac are aligned [1, Ta, HV, K]; `bounded` ([HV * NTa] int32) and `two_part` (a bool
  scalar: any chunk needs both parts; or [HV * NTa] int32, per chunk, as `two_parts_needed`) may
  come from the gate kernel's statistics (else they are computed from gc here).
  tail_zeros=False: at the chunks at or past aligned_cu[-1] only the residuals are written (Aqk 0,
  Ainv I); Akk, qg, kg, w, u are left unwritten there (the fused state + output kernel never reads
  them), and gc may be unwritten there too (the tail reads no gc). seg: as in `apply` (bounded and
  two_part, if given, must be the reset-free ones: kda.stages.gate.mosaic_gpu.packed(seg=) gives them).
  defer: the solve forms no w, u; returns (Out with w = u = None, Deferred) for the state + output
  kernel's inverse mode.
  """
  config = config or Config()
  reason = packed_supports(q, k, v, beta, gc_int, gc_frac, aligned_cu, rows, scale=scale, chunk_size=chunk_size)
  if reason is not None:
    raise ValueError(f"mosaic_gpu intra kernel (packed): {reason}")
  Ta = gc_frac.shape[1]
  # [HV, T + BT]: a chunk's BT rows from any src < T stay inside (the loads there are not TMA)
  beta_t, rows = packed_beta_rows(beta, rows)
  return _apply(q, k, v, beta_t, gc_int, gc_frac, aligned_cu, rows, bounded, two_part, scale=scale,
                interpret=interpret, config=config, Ta=Ta, tail_zeros=bool(tail_zeros), seg=seg, defer=defer)


def reset_free(gc_int, seg):
  """gc_int [1, Ta, HV, K] without the -128 steps of a segmented layout's resets (seg:
  kda.pipeline.segment_rows): + 128 n per row, exact."""
  return gc_int - GATE_FLOOR * seg[0][None, :, None, None]


def _apply(q, k, v, beta_t, gc_int, gc_frac, aligned_cu, rows, flag, two_part, *, scale, interpret, config,
           Ta, tail_zeros=True, seg=None, defer=False):
  HV = k.shape[2]
  # chunks at or past aligned_cu[-1] (the tail of a static-bound layout) are only zero-filled
  cu = jnp.array([0, Ta], jnp.int32) if aligned_cu is None else aligned_cu.astype(jnp.int32)
  q, k, v = (x[0].astype(BF16) for x in (q, k, v))
  gi, gf = gc_int[0].astype(F32), gc_frac[0].astype(F32)
  free = gc_int if seg is None else reset_free(gc_int.astype(F32), seg)   # what the kernel's decays see
  bounded = config.bounded == "auto"
  if not bounded:
    flag = jnp.zeros((HV * (Ta // BT),), jnp.int32)
  elif flag is None:
    flag = bounded_chunks(free, gc_frac)
  seg = None if seg is None else seg.astype(F32)
  run = lambda *gis: _scores(cu, rows, q, k, beta_t, gis, flag, scale=float(scale), bounded=bounded,
                             interpret=interpret, config=config, tail_zeros=tail_zeros, seg=seg)
  if config.two_part == "always" or TWO_PART_ONLY:
    akh, akl, aqk, qg, kg, kd = run(gi, gf)
  elif COND_FREE:   # one part everywhere, then the chunks needing both redone in place
    redo = two_part if two_part is not None and jnp.ndim(two_part) == 1 else two_parts_needed(free)
    refs = [jax.new_ref(x) for x in run(gf)]
    pred = jnp.any(redo != 0).astype(jnp.int32).reshape(1)
    _scores(cu, rows, q, k, beta_t, (gi, gf), flag, scale=float(scale), bounded=bounded, interpret=interpret,
            config=config, tail_zeros=tail_zeros, into=refs, pred=(pred, redo.astype(jnp.int32)), seg=seg)
    akh, akl, aqk, qg, kg, kd = (jax.ref.freeze(r) for r in refs)
  else:   # gc_int == 0 everywhere (every gate > -1): gc is gc_frac, the same decays bit for bit
    if two_part is None:
      pred = jnp.any(free != 0)
    else:
      pred = two_part if jnp.ndim(two_part) == 0 else jnp.any(two_part != 0)
    akh, akl, aqk, qg, kg, kd = lax.cond(pred, lambda a, b: run(a, b), lambda a, b: run(b), gi, gf)
  if config.probe == "scores":
    if defer:
      raise ValueError("mosaic_gpu intra: probe='scores' returns intra's Out alone (no defer)")
    z = jnp.zeros_like(kd)
    return Out(akh[None], aqk[None], jnp.zeros_like(akh)[None], z[None], jnp.zeros((Ta,) + v.shape[1:], BF16)[None],
               qg[None], kg[None])
  return solved(cu, rows, akh, akl, aqk, qg, kg, kd, v, beta_t, interpret=interpret, config=config,
                tail_zeros=tail_zeros, defer=defer)


def solved(cu, rows, akh, akl, aqk, qg, kg, kd, v, beta_t, *, defer=False, **kw):
  """The scores kernel's results [Ta, HV, *] through the solve -> Out, or with defer (Out with w = u
  = None, Deferred)."""
  if defer:
    ainv, lo, bv = _solve(cu, rows, akh, akl, None, v, beta_t, defer=True, **kw)
    return (Out(akh[None], aqk[None], ainv[None], None, None, qg[None], kg[None]),
            Deferred(kd[None], bv[None], lo[None]))
  ainv, w, u = _solve(cu, rows, akh, akl, kd, v, beta_t, **kw)
  return Out(akh[None], aqk[None], ainv[None], w[None], u[None], qg[None], kg[None])
