"""The fused state -> output kernel's body (Pallas Mosaic GPU): one program's walk over its
sequence's (or group's) chunks, in the serial or the warp-specialised variant. The launcher, its
Config, SMEM figure and predicate are in kda.fused.state_output.mosaic_gpu, whose docstring maps
the kernel onto the hardware.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32, ROW, WG, tail_share, walk_range
from kda._mosaic_gpu import acc as _acc, load as _load, split as _split
from kda._mosaic_gpu import mm as _mm
from kda._mosaic_gpu import store_rows as _store_rows, zeros as _zeros

BT = 64
BV = 64                           # state columns per program: one wgmma N tile


def body(*refs, scale, split, stage_o, packed, grouped=False, inverse=False):
  """The kernel body: the walk of one program (module docstring of kda.fused.state_output.mosaic_gpu)."""
  # GMEM: order [N], cu [N+1] int32; (packed mode) tab [4N+2] int32 (mosaic_gpu._packed_table); kg, w, qg
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
      if inverse:                # v_new = X (beta v - kd S): X's split times the rhs's split
        vb[...], yl_s[...] = _split(y)
        plgpu.commit_smem()      # reading the accumulator (next) waits for the wgmmas' reads of vb
        vb[...] = _acc([(xh_s.at[slot], vb), (xh_s.at[slot], yl_s), (xl_s.at[slot], vb)], (BT, BV)).astype(BF16)
      else:
        vb[...] = y.astype(BF16)
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
