"""intra's scores kernel (Pallas Mosaic GPU): Akk, Aqk, qg, kg and kd per (value head, chunk).

Grid (HV, NTa), one warpgroup per program. TMA brings q, k [64, K] (bf16) and the gate cumsum gc
[64, K] (float32, as gc_frac alone or as both parts) into SMEM; the program forms every decay from
them by levels (below), with bf16 operands and float32 accumulation on the tensor cores, and stores
Akk as a hi + lo bf16 split (the solve's operand), Aqk, qg = q exp(gc), kg = k exp(gc_last - gc) and
w's right-hand side kd = beta k exp(gc), all bf16, by TMA from SMEM tiles the inputs leave free.
gc in one part (every gate above -1: gc_int == 0 and gc is gc_frac, the same decays bit for bit)
takes one float32 tile: 114696 bytes of SMEM at K = 128, two CTAs per SM; both parts take 147464.
Chunks at or past aligned_cu[-1] (the tail of a static-bound layout) are only zero-filled.

Decays by levels. Every pair (i, j), j < i, of a chunk lies in exactly one level s in 64, 32, ..., 2:
the one whose s-token block holds both, i in its second half and j in its first. With r the gc row
at the first token of that second half (gc is non-increasing: gates are <= 0),

    exp(gc_i - gc_j) = exp(gc_i - r) * exp(r - gc_j)         both exponents <= 0

so a level is one product of x * exp(gc - r) (rows of second halves, x = k or q) with
k * exp(r - gc) (rows of first halves), bf16 operands and float32 accumulation, masked to pairs in
the same block. Six levels give every strictly lower pair exactly: no factor above 1 and one
underflows only where the decay itself does. Aqk's diagonal is the plain row dot q_i . k_i.
Bounded chunks (`bounded`: each 16-token half of both 32-token blocks spans <= BOUNDED_SPAN of gc in
every channel: always true for gates >= -5 per token, e.g. safe_gate, and for the usual gates) take
two levels instead: the exact level 64 and the 32-token blocks factored through their middle row,
every factor exp(x) with |x| <= BOUNDED_SPAN (normal in float32 and bf16); entries above the
diagonal may overflow there and are masked out. The level operands go through SMEM in [64, 64]
column slabs (SLAB), so that registers hold one slab of gc at a time.

Packed inputs (`packed`, the align folded into the loads): q, k, beta stay packed [1, T, ...] and
kda.padding.ChunkRows places each aligned chunk (rows r < count[c] read packed token src[c] + r).
TMA takes any packed row into plain (unswizzled) SMEM only, so q, k land there, in a RefUnion with
the level operands (no extra SMEM), and go masked (rows past count: zeros, by a select, since they
hold other sequences' tokens or NaN) into the swizzled tiles; beta is read from GMEM at src.

Gated (kda.fused.gate_intra): the chunk's raw gates land in gc's tile (float32) or in the landing
zone (bf16) and the gate kernel's row scan runs here (`_gate_scan`), SCAN_BLOCK rows loaded before
any is stored. The one-part kernel (every chunk, two CTAs per SM) keeps the bounded chunks and skips
the others; the persistent two-part kernel (grid (HV, PERSISTENT_CTAS // HV)) redoes those in place.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, COL, F32, ROW, WG, live_chunk
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda._mosaic_gpu import params as _params, smem_bytes as _smem_bytes
from kda.stages.gate import GATE_FLOOR, exponent
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.gate.mosaic_gpu import BOUNDED_SPAN

BT = 64
SLAB = 64                 # gc / operand columns handled at once (register pressure)
PERSISTENT_CTAS = 128     # programs of the persistent two-part gated kernel: about one per SM
SCAN_BLOCK = 8            # rows of the gated scan loaded together (`_gate_scan`)


def beta_rows(b_g, i_h, rows, src, cnt):
  """shape -> beta of the chunk's rows broadcast along columns: from the aligned [HV, Ta] rows, or
  (packed) from the packed [HV, T + BT] rows at src with rows past cnt set to 0 (a select: they may
  hold other sequences' values, NaN included)."""
  if src is None:
    b = _load(b_g.at[i_h, rows], ROW)
    return lambda shape: lax.broadcast_in_dim(b, shape, [0])
  b = _load(b_g.at[i_h, pl.ds(src, BT)], ROW)
  return lambda shape: jnp.where(_iota(0, shape) < cnt, lax.broadcast_in_dim(b, shape, [0]), 0.0)



def _body(cu_g, *rest, scale, two_part, bounded, packed, tail_zeros=True, gated=False, persistent=0,
                 seg=False):
  """Per (head, chunk): Akk (hi + lo bf16 split), Aqk, qg, kg and w's right-hand side
  kd = beta k exp(gc), all bf16. packed: q, k, beta come packed and `src`, `cnt` place the chunk.
  gated (packed, K = 128; kda.fused.gate_intra): the raw gates come packed in place of gc and the
  gate's row scan runs here (`_gate_scan`); each program also stores its gc row 63 (both parts'
  where two_part) and, one part, per column 1.0 where the chunk is not bounded (`_gate_scan`); the
  one-part kernel leaves those chunks to the two-part one.
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
        if gated and not two_part:   # q's raw tile is read before it takes the flags
          plgpu.commit_smem()
        if gated:
          flag = _gate_scan(g_land, gf_s, gi_s, last_g, lasti_g, nz_g, c, i_h, cnt, landing[0])
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
        beta = beta_rows(b_g, i_h, rows, src, cnt)   # from GMEM: no SMEM for it
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

      if gated and not two_part:   # a chunk not bounded: the two-part kernel's
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



def _gate_scan(g_s, gf_s, gi_s, last_g, lasti_g, nz_g, c, i_h, cnt, flag_s):
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
  chunks (`_any_flag`: a cross-warp reduction's SMEM scratch would take this kernel over two CTAs
  per SM). Returns None."""
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
  flag_s.at[0][...] = (1.0 - fine).astype(BF16)
  return None



def scratch(K, *, two_part, packed, gated=False, bf16_gates=False):
  """The kernel's scratch_types: q, k tiles [64, K] (swizzled), the three level operands as [64, 64]
  slabs (two at K = 64 too; packed: in a RefUnion with the plain landing tiles of q, k and bf16
  gates), gc's float32 tiles (one per part), the barrier of the loads. The swizzled tiles come
  first and the plain ones after them: no alignment gaps."""
  ops = [_swz((max(K // SLAB, 2), BT, SLAB)) for _ in range(3)]
  if packed:    # the landing zone of q, k (bf16 gates) shares the operands' bytes (never live together)
    ops = [plgpu.RefUnion(ops, [plgpu.SMEM((BT, K), BF16) for _ in range(2 + (gated and bf16_gates))])]
  return [_swz((BT, K)), _swz((BT, K)), *ops, *[plgpu.SMEM((BT, K), F32) for _ in range(1 + two_part)],
          plgpu.Barrier(num_arrivals=3 if gated else 3 + two_part)]


def smem_bytes(K, *, two_part, packed=False, gated=False, bf16_gates=False):
  """The SMEM the kernel asks for (as lowered for CUDA); the two-part gated kernel's row scan reduces
  its bounded flag across warps (`_gate_scan`), whose scratch comes on top."""
  return _smem_bytes(scratch(K, two_part=two_part, packed=packed, gated=gated, bf16_gates=bf16_gates),
                     reduction=gated and two_part)


def launch(cu, rows, q, k, beta_t, gis, flag, *, scale, bounded, approx_math, interpret, tail_zeros=True,
           Ta=None, into=None, pred=None, seg=None):
  """The kernel on q, k [Ta or T, HV, K] bf16, beta_t [HV, Ta] (packed: [HV, T + BT]) float32;
  gis = (gc_int, gc_frac) or (gc_frac,) [Ta, HV, K] float32; flag [HV * NTa] int32 (bounded_chunks);
  rows: (src, count) int32 [NTa] (packed q, k, beta_t) or None. -> Akk's split, Aqk [Ta, HV, 64],
  qg, kg, kd [Ta, HV, K], all bf16.
  flag None: gated (gis = (g,), the packed raw gates [T, HV, 128]; Ta given): one part -> also
  (gc row 63, per column 1.0 where the chunk is not bounded), both [NTa, HV, K]; with pred = (int32
  [1], the chunks to redo: int32 [HV * NTa]) both parts, persistent -> also (gc_int, gc_frac row 63).
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
  body = functools.partial(_body, scale=scale, two_part=two_part, bounded=bounded, packed=packed,
                           tail_zeros=tail_zeros, gated=gated, persistent=W, seg=seg is not None)
  shape = lambda d: jax.ShapeDtypeStruct((Ta, HV, d), BF16)
  stats = [jax.ShapeDtypeStruct((NTa, HV, K), F32)] * 2 if gated else []
  outs = (shape(BT), shape(BT), shape(BT), shape(K), shape(K), shape(K), *stats)
  f = plgpu.kernel(
      body,
      out_type=() if into else outs,      # in place: the refs follow the inputs, as the outputs would
      grid=(HV, W or NTa), grid_names=("h", "c"),
      scratch_types=scratch(K, two_part=two_part, packed=packed, gated=gated,
                            bf16_gates=gated and gis[0].dtype != F32),
      compiler_params=_params(False, approx_math=approx_math),
      kernel_name=("kda_gate_intra_scores_strong" if W else "kda_gate_intra_scores") if gated else "kda_intra_scores",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  lead = () if pred is None else tuple(pred)
  return f(cu, *lead, *(() if gated else (flag,)), *(() if seg is None else (seg,)), *(() if rows is None else rows),
           q, k, beta_t, *gis, *(into or ()))
