"""state -> output fused: the state recurrence and the output in one kernel (the math is in
kda.stages.state and kda.stages.output). The forward needs neither h nor v_new (the backward
recomputes them), so S never leaves the chip and v_new never reaches HBM.

`mosaic_gpu(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size,
rows=None, T=None)` -> (o [1, Ta, HV, V] float32 (or bf16: Config.out_dtype), final_state
[N, HV, K, V] float32); o is 0 at padding tokens (qg = Aqk = 0 there) and on the chunks past
aligned_cu[-1]. With rows = padding.chunk_rows(layout) and the packed length T (packed mode), o is
[1, T, HV, V] in the packed layout instead, equal bit for bit to padding.unalign_with(layout, o)
of the aligned mode, so the pipeline needs no unalign gather (see "Packed mode" below).

Kernel (Pallas Mosaic GPU, Hopper): one program per (sequence rank r, value head h, V tile of
BV = 64 columns), grid (N, HV, V // BV) longest sequence first, as the state kernel
(kda.stages.state.mosaic_gpu, whose grid, tail and ordering notes hold here too). It walks its
sequence's chunks carrying S [K, BV] float32 in registers; per chunk c, with the next chunk's
tiles in flight (two SMEM slots per input, TMA):

    v_new = u_c - w_c @ bf16(S)                              wgmma [64, K] @ [K, BV]
    o_c   = scale * qg_c @ bf16(S) + Aqk_c @ bf16(v_new)     wgmmas [64, K] @ [K, BV], [64, 64] @ [64, BV]
    S     = decay_c[:, None] * S + kg_c^T @ bf16(v_new)      wgmma [K, 64] @ [64, BV] (kg_s.T view)
    o_c   -> SMEM stage -> TMA store

Two variants (Config.warp_specialized):
- serial: one warpgroup does all four wgmmas per chunk, in two pairs issued together: w @ S and
  qg @ S (one bf16(S) copy feeds both), then Aqk @ v_new and kg^T @ v_new; o is formed and stored
  while the second of these still runs (wgmma_accumulator_load with wait_n=1). With
  Config(input_slots=1) it loads each chunk's tiles when it gets there instead of prefetching
  them, so two programs can share an SM and hide each other's loads.
- warp-specialised: two warpgroups. Warpgroup 0 carries S (v_new, the S update) and publishes
  bf16(S) and bf16(v_new) of chunk c in SMEM slot c % 2 (barrier `ready`); warpgroup 1 loads qg
  and Aqk itself, computes and stores o_c from that slot and hands it back (barrier `free`). With
  two slots warpgroup 0 runs up to two chunks ahead, so the output's wgmmas and stores leave the
  serial chain. Both warpgroups finish on a common barrier (one exiting while the other still
  issues wgmmas faults).

What is bf16: kg, w, u, qg, Aqk (cast in the launcher if they come in float32; the predicate
`takes` refuses float32 ones, as the stages' predicates do), and the wgmma operand copies bf16(S),
bf16(v_new). S, the decay (formed in the launcher from each chunk's last gate row, [NTa, HV, K]),
the accumulators and final_state are float32. The roundings are those of the state kernel feeding
the output kernel with bf16 h and v_new, so o agrees with that composition to float32 summation
order.

Grouped walk (serial variant, Config.group_chunks = G, 8 by default; where P = cdiv(NTa, G) < N):
grid (P, HV, V // BV), program rank r takes group order[r] (the most chunks first), the
consecutive sequences whose first chunk lies in [p * G, (p + 1) * G) (`_mosaic_gpu.sequence_groups`,
N-sized XLA ops). It walks their chunks as one run, sequence by sequence: S from each one's h0,
final_state stored at each one's end, the next chunk's tiles prefetched across the sequence
boundaries, so short sequences do not each pay an empty pipeline; the tail chunks and the packed
gaps go round-robin over the P programs. The arithmetic per chunk is unchanged (the same bits).

Tail: the chunks past aligned_cu[-1] get o = 0 from the kernel (the N programs of each (head,
V tile) take them round-robin with TMA stores of one zeroed SMEM tile, as the state kernel does for
h), so o is defined everywhere without a pass over it in the launcher.

Packed mode (rows, T given): the same arithmetic; only o's store and the zeros differ.
- The launcher gathers from rows, per sequence, its packed rows [start, end) (at its first and last
  chunk) and the packed gaps no sequence owns (`_packed_table`: N + 1 ranges, from a sort of the N
  starts; N-sized XLA ops only). Each program reads its two scalars once, so chunk i goes to packed
  row start + i * BT with count min(end - row, BT) rows.
- The o stage is plain untransformed SMEM (BT, BV) (also for a bf16 o, swizzled in the aligned
  mode): TMA takes it at any packed row (a swizzled tile needs rows that are multiples of 8) and
  any row offset of it is 128-byte aligned (a row is 128 or 256 bytes). Lowers under both
  semantics, also for T not a multiple of 8. Config.stage_o is ignored: o always goes through it.
- A chunk's store never writes a packed row past start + count - 1, since the next sequence's
  rows there belong to another program running concurrently. So count is split into its binary
  digits: one statically sized TMA store of 64, 32, 16, 8, 4, 2, 1 rows per set bit, at increasing
  offsets of the stage, each issued under pl.when. A full chunk (count = 64) is one store; a
  sequence's last, partial chunk takes at most 6. Register stores cannot be masked by row, and
  TMA's clipping happens only at the array's end.
- The zeros: the tokens no sequence owns (after cu_seqlens[-1], before the first sequence, and the
  gaps between segment_ids runs) are zeroed in the kernel, in place of the aligned mode's tail
  chunks (zero_tail). Rank r zeroes gap r and rank N - 1 also gap N (the end), in pieces of 64 rows
  (the last piece split as above) from a zeroed stage. The gaps are disjoint from every sequence's
  rows, so no program writes another one's rows, and there is no pass over o in the launcher.

Inverse (the packed forward's default, kda.pipeline.INVERSE_IN_STATE; serial variant only): w, u
are kd = beta k exp(gc) and beta v, and X = Ainv comes as its bf16 split (hi, lo) [Ta, HV, BT], two
more tiles per input slot. Per chunk, after w @ bf16(S):

    y     = u - wS  ->  bf16 split (yh, yl)                  (SPLIT_RHS; else bf16(y) alone)
    v_new = Xh @ yh + Xh @ yl + Xl @ yh                      three wgmmas [64, 64] @ [64, BV]

then o and S as above. The solve (kda.stages.intra.mosaic_gpu, defer) then forms no w, u: it needs
three CTAs per SM instead of two. v_new is rounded to bf16 once, as u - w S is; the inverse's
products cost one more dependent wgmma group per chunk (H200, A: 0.262 ms for this kernel against
0.205 with w, u given). SMEM: 214032 bytes at K = 128, serial (X's split 32768, yl 8192 more).

SMEM per program (bytes, BT = 64, BV = 64), as lowered for CUDA (limit 232448; two programs fit
an SM's 228 KiB up to ~115 KiB each), with the f32 o stage (a bf16 o saves 8192, stage_o=False
14336). Packed mode: the same (its plain bf16 stage is as large as the swizzled one), except that
stage_o=False keeps the stage:
    serial:                   K = 128: 173072, K = 64: 115728
    serial, input_slots=1:    K = 128: 107528, K = 64:  74760
    warp-specialised:         K = 128: 197704, K = 64: 132168
  kg, w, qg, u, Aqk, decay per input slot: 384 K + 16384 + 4 K; bf16(S) and bf16(v_new): one slot
  (serial) or two (warp-specialised) x (128 K + 8192); o stage 16384.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda import padding
from kda.stages.state import chunk_decay
from kda.stages.state import mosaic_gpu as state_mgpu
from kda._mosaic_gpu import BF16, F32, MAX_GRID_YZ, ROW, WG, tail_share, walk_order, walk_range
from kda._mosaic_gpu import params as _params
from kda._mosaic_gpu import store_rows as _store_rows, with_absent, zeros as _zeros
from kda._mosaic_gpu import acc as _acc, load as _load, split as _split
from kda._mosaic_gpu import mm as _mm
from kda._mosaic_gpu import swz as _swz

OUT_DTYPES = {"float32": F32, "bfloat16": BF16}
# Inverse mode: beta v - kd S enters X's products as its own bf16 split (three wgmmas, as the solve's
# products), so v_new = X (beta v - kd S) is rounded to bf16 once, as u - w S is; False rounds the
# right-hand side to bf16 first (two wgmmas).
SPLIT_RHS = True
# Config.group_chunks' default. H200, shape B (489 sequences of 1-128 tokens): forward 2.19 ms
# device time with 8 against 2.25 one program per sequence, the same bits
GROUP_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the fused state -> output kernel; they depend on K, V, BT and dtype only."""
  block_v: int = 64               # BV: state columns per program (one wgmma N tile)
  warp_specialized: bool = False  # warpgroup 0 carries S, warpgroup 1 computes o (module docstring)
  out_dtype: str = "float32"      # o as stored: "float32" or "bfloat16"
  longest_first: bool = True      # rank r of the grid takes the r-th longest sequence
  # Lane semantics (kda._mosaic_gpu.params) instead of Warpgroup: H200, A: 0.254 ms vs 0.220
  lane_semantics: bool = False
  # serial only: 1 input slot (no prefetch) so that two programs may share an SM instead
  input_slots: int = 2
  stage_o: bool = True            # o through SMEM + TMA (else registers -> GMEM stores; aligned mode only)
  # serial only: > 0 walks groups of consecutive sequences (those starting in the same window of
  # this many chunks) per program where that makes fewer programs than sequences; None: GROUP_CHUNKS
  group_chunks: Optional[int] = None

  def __post_init__(self):
    if self.block_v != 64:
      raise ValueError(f"block_v must be 64 (one wgmma N tile), got {self.block_v}")
    if self.input_slots not in (1, 2):
      raise ValueError(f"input_slots must be 1 or 2, got {self.input_slots}")
    if self.warp_specialized and self.input_slots != 2:
      raise ValueError("the warp-specialised variant needs input_slots=2")
    if self.group_chunks is not None and (not isinstance(self.group_chunks, int) or self.group_chunks < 0):
      raise ValueError(f"group_chunks must be None or an int >= 0, got {self.group_chunks!r}")
    if self.out_dtype not in OUT_DTYPES:
      raise ValueError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {self.out_dtype!r}")


def supports(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size,
             rows=None, T=None, **_) -> Optional[str]:
  """None if `mosaic_gpu` takes this call (shapes, dtypes bf16 or float32; with `rows`, a
  ChunkRows of int32 [NTa] arrays and a static packed length T), else the reason."""
  reason = state_mgpu.supports(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size)
  if reason is not None:
    return reason
  if rows is not None:
    NTa = kg.shape[1] // chunk_size
    if not isinstance(T, int) or isinstance(T, bool) or T < 0:
      return f"packed mode (rows given) needs the packed length T as a static int >= 0, got {T!r}"
    try:
      src, count = rows
    except (TypeError, ValueError):
      return f"rows must be a padding.ChunkRows (src, count), got {type(rows).__name__}"
    for name, x in (("rows.src", src), ("rows.count", count)):
      if getattr(x, "shape", None) != (NTa,) or jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        return (f"{name} must be int32 [{NTa}] (one per aligned chunk), got "
                f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', None)}")
  elif T is not None:
    return "T is only taken with rows (packed mode)"
  if qg.shape != kg.shape:
    return f"qg must have kg's shape {kg.shape}, got {qg.shape}"
  if Aqk.shape != kg.shape[:3] + (chunk_size,):
    return f"Aqk must have shape {kg.shape[:3] + (chunk_size,)}, got {Aqk.shape}"
  for name, x in (("qg", qg), ("Aqk", Aqk)):
    if jnp.dtype(x.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
      return f"{name} must be bfloat16 or float32, got {jnp.dtype(x.dtype).name}"
  return None


def takes(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size,
          rows=None, T=None, **_) -> Optional[str]:
  """The group's predicate: `supports`, and bf16 kg, w, u, qg, Aqk (the dtype policy's bf16
  intermediates); float32 ones would be rounded to bf16, below the float32 accuracy promised for
  float32 inputs."""
  reason = supports(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                    rows=rows, T=T)
  if reason is None:
    named = (("kg", kg), ("w", w), ("u", u), ("qg", qg), ("Aqk", Aqk))
    if any(jnp.dtype(x.dtype) != jnp.dtype(BF16) for _, x in named):
      reason = (f"mosaic_gpu state_output takes bfloat16 kg, w, u, qg, Aqk (float32 would be rounded "
                f"to bfloat16), got {', '.join(f'{n} {jnp.dtype(x.dtype).name}' for n, x in named)}")
  return reason


def _body(*refs, BT, BV, scale, split, stage_o, packed, grouped=False, inverse=False):
  # GMEM: order [N], cu [N+1] int32; (packed mode) tab [4N+2] int32 (`_packed_table`); kg, w, qg
  # [Ta, HV, K], u [Ta, HV, V], Aqk [Ta, HV, BT] bf16; dec [NTa, HV, K], h0, ht [N, HV, K, V] f32;
  # o [Ta, HV, V] (aligned mode) or [T, HV, V] (packed mode) f32 or bf16. h0 None: zero (not an
  # input); ht None: not stored (not an output).
  # grouped: order [P] ranks the groups, grp [P + 1] int32 their sequence ranges (sequence_groups).
  # inverse: w, u are kd and beta v, and X's split [Ta, HV, BT] bf16 follows Aqk (v_new = X (u - w S)).
  order_g, cu_g, *refs = refs
  grp_g = refs.pop(0) if grouped else None
  tab_g = refs.pop(0) if packed else None
  kg_g, w_g, u_g, dec_g, qg_g, A_g, *refs = refs
  xh_g, xl_g, *refs = refs if inverse else (None, None, *refs)
  h0_g, o_g, ht_g, kg_s, w_s, u_s, dec_s, qg_s, A_s, *refs = refs
  xh_s, xl_s, yl_s, *refs = refs if inverse else (None, None, None, *refs)
  sb_s, vb_s, o_s, *bars = refs
  N = cu_g.shape[0] - 1
  NTa, K = kg_g.shape[0] // BT, kg_g.shape[-1]
  r, i_h, i_v = lax.axis_index("r"), lax.axis_index("h"), lax.axis_index("v")
  programs = order_g.shape[0] if grouped else N
  n_lo, n_hi, bos, eos = walk_range(order_g, grp_g, cu_g, r)   # grouped: consecutive sequences
  i_n = n_lo
  nch = (eos - bos) // BT
  cols = pl.ds(i_v * BV, BV)
  rows_of = lambda i: pl.ds(pl.multiple_of(bos + i * BT, BT), BT)

  def fetch_state(i, slot, bar):
    start = pl.multiple_of(bos + i * BT, BT)
    rows = pl.ds(start, BT)
    plgpu.copy_gmem_to_smem(w_g.at[rows, i_h, :], w_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(kg_g.at[rows, i_h, :], kg_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(u_g.at[rows, i_h, cols], u_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(dec_g.at[start // BT, i_h, :], dec_s.at[slot], bar)

  def fetch_out(i, slot, bar):
    rows = rows_of(i)
    plgpu.copy_gmem_to_smem(qg_g.at[rows, i_h, :], qg_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(A_g.at[rows, i_h, :], A_s.at[slot], bar)
    if inverse:
      plgpu.copy_gmem_to_smem(xh_g.at[rows, i_h, :], xh_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(xl_g.at[rows, i_h, :], xl_s.at[slot], bar)

  if packed and not grouped:     # the sequence's packed rows [p_start, p_end)
    p_start, p_end = tab_g[i_n], tab_g[N + i_n]

  def store_rows(row, n):
    _store_rows(o_s, lambda ds: o_g.at[ds, i_h, cols], row, n)

  def store_o(o, i, seq=None):
    # seq (grouped mode): the chunk's sequence (packed start, packed end, its first chunk's i)
    if packed:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_s[...] = o.astype(o_s.dtype)
      plgpu.commit_smem()
      start, end, i0 = (p_start, p_end, 0) if seq is None else seq
      row = start + (i - i0) * BT
      store_rows(row, jnp.minimum(end - row, BT))
      return
    if not stage_o:
      o_g[rows_of(i), i_h, cols] = o.astype(o_g.dtype)
      return
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the previous chunk's store has read o_s
    o_s[...] = o.astype(o_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[rows_of(i), i_h, cols])

  def update(S, slot, vb):
    decay = _load(dec_s.at[slot], ROW)                   # [K], one per row of S
    return S * lax.broadcast_in_dim(decay, (K, BV), [0]) + _mm(kg_s.at[slot].T, vb, (K, BV))

  def zero_gaps():
    # packed mode: rank r zeroes the packed gap r of `_packed_table` (rank N - 1 also gap N), in
    # pieces of BT rows through store_rows from a zeroed o_s
    zeros = plgpu.layout_cast(jnp.zeros((BT, BV), F32), WG).astype(o_s.dtype)

    def gap(j):
      lo, hi = tab_g[2 * N + j], tab_g[3 * N + 1 + j]

      @pl.when(hi > lo)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_s[...] = zeros
        plgpu.commit_smem()

        def piece(k, carry):
          row = lo + k * BT
          store_rows(row, jnp.minimum(hi - row, BT))
          return carry

        lax.fori_loop(0, (hi - lo + BT - 1) // BT, piece, 0)

    if not grouped:
      gap(r)
      pl.when(r == N - 1)(lambda: gap(N))
      return

    def gaps(m, carry):          # program r of P: gaps r, r + P, ..., up to gap N
      gap(r + m * programs)
      return carry

    lax.fori_loop(0, (N - r) // programs + 1, gaps, 0)

  def zero_tail():
    if packed:
      return zero_gaps()
    # chunks past aligned_cu[-1] round-robin over the N programs of this (head, V tile)
    first, count = tail_share(cu_g, N, NTa, r, BT, programs)
    zeros = plgpu.layout_cast(jnp.zeros((BT, BV), F32), WG).astype(o_g.dtype)

    @pl.when(count > 0)
    def _():
      if stage_o:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_s[...] = zeros
        plgpu.commit_smem()

      def zero(j, carry):
        rows = pl.ds(pl.multiple_of((first + j * programs) * BT, BT), BT)
        if stage_o:
          plgpu.copy_smem_to_gmem(o_s, o_g.at[rows, i_h, cols])
        else:
          o_g[rows, i_h, cols] = zeros
        return carry

      lax.fori_loop(0, count, zero, 0)

  S0 = lambda n: _zeros((K, BV)) if h0_g is None else _load(h0_g.at[n, i_h, :, cols])

  def store_final_state(S, n):
    if ht_g is not None:
      ht_g[n, i_h, :, cols] = S

  if not split:
    (in_bar,) = bars
    sb, vb = sb_s.at[0], vb_s.at[0]
    slots = kg_s.shape[0]

    def fetch(i, slot):
      fetch_state(i, slot, in_bar.at[slot])
      fetch_out(i, slot, in_bar.at[slot])

    @pl.when(nch > 0)
    def _():
      fetch(0, 0)

    def step(i, S, seq=None):
      slot = lax.rem(i, 2) if slots == 2 else 0
      if slots == 2:
        @pl.when(i + 1 < nch)
        def _():
          fetch(i + 1, 1 - slot)   # that slot's last readers, step i-1's wgmmas, have completed
      else:
        @pl.when(i > 0)
        def _():
          fetch(i, 0)              # step i-1's wgmmas, the slot's last readers, have completed

      sb[...] = S.astype(BF16)
      plgpu.commit_smem()
      plgpu.barrier_wait(in_bar.at[slot])

      def recall(acc_v, acc_q):
        plgpu.wgmma(acc_v, w_s.at[slot], sb)
        plgpu.wgmma(acc_q, qg_s.at[slot], sb)
        return acc_v[...], acc_q[...]

      wS, qS = pl.run_scoped(recall, plgpu.ACC((BT, BV), F32), plgpu.ACC((BT, BV), F32))
      y = _load(u_s.at[slot]).astype(F32) - wS
      if inverse and SPLIT_RHS:  # v_new = X (beta v - kd S): X's split times the rhs's split
        vb[...], yl_s[...] = _split(y)
        pairs = [(xh_s.at[slot], vb), (xh_s.at[slot], yl_s), (xl_s.at[slot], vb)]
      else:                      # v_new itself, or (inverse) the rhs rounded to bf16 first
        vb[...] = y.astype(BF16)
        pairs = [(xh_s.at[slot], vb), (xl_s.at[slot], vb)] if inverse else []
      plgpu.commit_smem()
      if inverse:                # reading the accumulator waits for the wgmmas' reads of vb
        vb[...] = _acc(pairs, (BT, BV)).astype(BF16)
        plgpu.commit_smem()

      def finish(acc_a, acc_s):
        plgpu.wgmma(acc_a, A_s.at[slot], vb)
        plgpu.wgmma(acc_s, kg_s.at[slot].T, vb)
        store_o(scale * qS + plgpu.wgmma_accumulator_load(acc_a, wait_n=1), i, seq)   # kg^T v_new runs on
        decay = _load(dec_s.at[slot], ROW)               # [K], one per row of S
        return S * lax.broadcast_in_dim(decay, (K, BV), [0]) + acc_s[...]

      S = pl.run_scoped(finish, plgpu.ACC((BT, BV), F32), plgpu.ACC((K, BV), F32))
      plgpu.wgmma_wait(0)        # no wgmma may stay in flight across the loop's back-edge
      return S

    if grouped:
      # sequence by sequence, S from its h0; the prefetch runs on across sequences (the group's
      # chunks are consecutive), so the TMA pipeline stays full over the group's short sequences
      def sequence(n, carry):
        i0, i1 = (cu_g[n] - bos) // BT, (cu_g[n + 1] - bos) // BT
        seq = (tab_g[n], tab_g[N + n], i0) if packed else None
        store_final_state(lax.fori_loop(i0, i1, lambda i, S: step(i, S, seq), S0(n)), n)
        return carry

      lax.fori_loop(n_lo, n_hi, sequence, 0)
    else:
      store_final_state(lax.fori_loop(0, nch, step, S0(i_n)), i_n)
    zero_tail()
    plgpu.wait_smem_to_gmem(0)   # every TMA store has landed before the program exits
    return

  in_s, in_o, ready, free, done = bars
  wg = lax.axis_index("wg")

  @pl.when(wg == 0)
  def _():                       # the state: v_new and S, publishing bf16(S), bf16(v_new)
    @pl.when(nch > 0)
    def _():
      fetch_state(0, 0, in_s.at[0])

    def step(i, S):
      slot = lax.rem(i, 2)

      @pl.when(i + 1 < nch)
      def _():
        fetch_state(i + 1, 1 - slot, in_s.at[1 - slot])

      @pl.when(i >= 2)
      def _():
        plgpu.barrier_wait(free.at[slot])   # warpgroup 1 is done with chunk i-2's slot

      sb, vb = sb_s.at[slot], vb_s.at[slot]
      sb[...] = S.astype(BF16)
      plgpu.commit_smem()
      plgpu.barrier_wait(in_s.at[slot])
      vb[...] = (_load(u_s.at[slot]).astype(F32) - _mm(w_s.at[slot], sb, (BT, BV))).astype(BF16)
      plgpu.commit_smem()
      plgpu.barrier_arrive(ready.at[slot])
      S = update(S, slot, vb)
      plgpu.wgmma_wait(0)
      return S

    store_final_state(lax.fori_loop(0, nch, step, S0(i_n)), i_n)
    for back in (1, 2):          # observe the hand-backs of the last two chunks too
      pl.when(nch >= back)(lambda back=back: plgpu.barrier_wait(free.at[lax.rem(nch - back, 2)]))

  @pl.when(wg == 1)
  def _():                       # the output, from the published slot
    @pl.when(nch > 0)
    def _():
      fetch_out(0, 0, in_o.at[0])

    def step(i, carry):
      slot = lax.rem(i, 2)

      @pl.when(i + 1 < nch)
      def _():
        fetch_out(i + 1, 1 - slot, in_o.at[1 - slot])

      plgpu.barrier_wait(in_o.at[slot])
      plgpu.barrier_wait(ready.at[slot])

      def output(acc_q, acc_a):
        plgpu.wgmma(acc_q, qg_s.at[slot], sb_s.at[slot])
        plgpu.wgmma(acc_a, A_s.at[slot], vb_s.at[slot])
        return scale * acc_q[...] + acc_a[...]

      o = pl.run_scoped(output, plgpu.ACC((BT, BV), F32), plgpu.ACC((BT, BV), F32))
      plgpu.barrier_arrive(free.at[slot])
      store_o(o, i)
      plgpu.wgmma_wait(0)
      return carry

    lax.fori_loop(0, nch, step, 0)
    zero_tail()
    plgpu.wait_smem_to_gmem(0)

  plgpu.barrier_arrive(done)     # neither warpgroup exits while the other still works
  plgpu.barrier_wait(done)


def _inverse_supports(inverse, kg, config, chunk_size):
  """None if the `inverse` mode takes X's split `inverse`, else why."""
  if config.warp_specialized:
    return "inverse (Ainv applied in the kernel) runs the serial variant only"
  want = kg.shape[:3] + (chunk_size,)
  try:
    xh, xl = inverse
  except (TypeError, ValueError):
    return f"inverse must be a pair (Ainv, its low part), got {type(inverse).__name__}"
  for name, x in (("Ainv", xh), ("Ainv's low part", xl)):
    if getattr(x, "shape", None) != want or jnp.dtype(x.dtype) != jnp.dtype(BF16):
      return f"inverse: {name} must be bfloat16 {want}, got {getattr(x, 'dtype', None)} {getattr(x, 'shape', None)}"
  return None


def _packed_table(rows, aligned_cu, T, BT):
  """[4N + 2] int32 for packed mode: padding.packed_gaps (each sequence's packed rows [start, end),
  then the N + 1 packed gaps [lo, hi) that no sequence owns) concatenated."""
  return jnp.concatenate(padding.packed_gaps(rows, aligned_cu, T, BT))


def mosaic_gpu(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size,
               interpret=False, config=None, out_dtype=None, rows=None, T=None, zero_h0=False,
               store_final=True, decay=None, inverse=None):
  """(o [1, Ta, HV, V], final_state [N, HV, K, V] float32); see the module docstring. `out_dtype`
  (float32 or bfloat16) overrides config.out_dtype: the pipeline asks for v's dtype, as o ends in it.

  Packed mode: with `rows` (padding.chunk_rows(layout), int32 [NTa] src and count) and the packed
  length T (static int), o is [1, T, HV, V] = padding.unalign_with(layout, o of the aligned mode),
  bit for bit: each chunk's o goes from its SMEM stage straight to packed rows src[c] + r,
  r < count[c], and the tokens that no sequence owns are 0 (module docstring, "Packed mode").
  zero_h0: initial_state is known to be zero (not read); store_final=False: the final state is not
  stored (zeros are returned in its place, for callers that drop it). decay ([NTa, HV, K] float32,
  chunk_decay's, e.g. from kda.fused.gate_intra) stands for gc_int, gc_frac, which may then be None.
  inverse ((Ainv, its low bf16 part), each [1, Ta, HV, BT] bf16; the serial variant): w and u are
  kd = beta k exp(gc) and beta v instead, and the kernel forms v_new = Ainv (beta v - kd S) (module
  docstring, "Inverse")."""
  config = config or Config()
  if decay is not None:
    gc_int = gc_frac = jax.ShapeDtypeStruct(kg.shape, F32)
  if out_dtype is not None:
    config = dataclasses.replace(config, out_dtype=jnp.dtype(out_dtype).name)
  reason = supports(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                    rows=rows, T=T)
  if reason is None and inverse is not None:
    reason = _inverse_supports(inverse, kg, config, chunk_size)
  if reason is not None:
    raise ValueError(f"mosaic_gpu state_output kernel: {reason}")
  BT, BV = chunk_size, config.block_v
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  N = aligned_cu.shape[0] - 1
  odt = OUT_DTYPES[config.out_dtype]
  packed = rows is not None
  To = T if packed else Ta                    # o's rows
  if N == 0:                                  # no program to launch; every chunk is tail
    return jnp.zeros((1, To, HV, V), odt), jnp.zeros((0, HV, K, V), F32)
  aligned_cu = aligned_cu.astype(jnp.int32)
  table = (_packed_table(rows, aligned_cu, T, BT),) if packed else ()
  NTa = Ta // BT
  G = 0 if config.warp_specialized else GROUP_CHUNKS if config.group_chunks is None else config.group_chunks
  order, bounds = walk_order(aligned_cu, NTa, G, config.longest_first, BT)
  grouped = bounds is not None
  if grouped:
    table = (bounds, *table)
  R = order.shape[0]                         # programs per (head, V tile)
  if decay is None:
    decay = chunk_decay(gc_int, gc_frac, BT)                        # [NTa, HV, K] f32
  kg, w, u, qg, Aqk = (x[0].astype(BF16) for x in (kg, w, u, qg, Aqk))

  if R <= MAX_GRID_YZ:
    grid, names = (R, HV, V // BV), ("r", "h", "v")
  else:
    grid, names = (V // BV, HV, R), ("v", "h", "r")
  split, ns = config.warp_specialized, config.input_slots
  inv = inverse is not None
  pub = 2 if split else 1                    # slots of the published bf16(S), bf16(v_new)
  if split:
    bars = [plgpu.Barrier(num_arrivals=4, num_barriers=2),          # w, kg, u, decay
            plgpu.Barrier(num_arrivals=2, num_barriers=2),          # qg, Aqk
            plgpu.Barrier(num_arrivals=1, num_barriers=2),          # ready: slot published
            plgpu.Barrier(num_arrivals=1, num_barriers=2),          # free: slot consumed
            plgpu.Barrier(num_arrivals=2)]                          # done
    extra = dict(num_threads=2, thread_name="wg")
  else:
    bars = [plgpu.Barrier(num_arrivals=6 + 2 * inv, num_barriers=ns)]
    extra = {}
  body = lambda *refs: _body(*refs, BT=BT, BV=BV, scale=float(scale), split=split, stage_o=config.stage_o,
                             packed=packed, inverse=inv, **({"grouped": True} if grouped else {}))
  base = 2 + grouped + packed + 2 * inv      # order, cu (the groups, the packed table; X's split) first
  absent = [base + 6] * zero_h0 + [base + 8] * (not store_final)   # h0_g, ht_g in _body's refs
  if absent:
    body = with_absent(body, absent)
  if packed:                                 # untransformed: TMA stores at any row, of any count
    o_stage = plgpu.SMEM((BT, BV), odt)
  elif config.stage_o:
    o_stage = _swz((BT, BV), BF16) if odt == BF16 else plgpu.SMEM((BT, BV), F32)
  else:
    o_stage = plgpu.SMEM((8, BV), odt)                               # unused placeholder
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((To, HV, V), odt),
                *[jax.ShapeDtypeStruct((N, HV, K, V), F32)] * store_final),
      grid=grid, grid_names=names,
      scratch_types=[
          _swz((ns, BT, K)), _swz((ns, BT, K)), _swz((ns, BT, BV)),  # kg, w, u
          plgpu.SMEM((ns, K), F32),                                 # decay rows
          _swz((ns, BT, K)), _swz((ns, BT, BT)),                    # qg, Aqk
          *[_swz((ns, BT, BT))] * (2 * inv),                        # X's split
          *[_swz((BT, BV))] * inv,                                  # the rhs's low part
          _swz((pub, K, BV)), _swz((pub, BT, BV)),                  # bf16(S), bf16(v_new)
          o_stage,
          *bars,
      ],
      compiler_params=_params(config.lane_semantics),
      kernel_name="kda_state_output", interpret=plgpu.InterpretGPUParams() if interpret else None,
      **extra,
  )
  h0 = () if zero_h0 else (initial_state.astype(F32),)
  xs = tuple(x[0].astype(BF16) for x in inverse) if inv else ()
  o, *final = f(order, aligned_cu, *table, kg, w, u, decay, qg, Aqk, *xs, *h0)
  return o[None], (final[0] if store_final else jnp.zeros((N, HV, K, V), F32))
