"""bwd_dh (S2): the Pallas Mosaic GPU (Hopper) kernels; the math is in kda.stages.bwd_dh.

Two kernels: a serial walk that carries the state cotangent through each sequence's chunks and
stores it per chunk in bf16, then a parallel one that forms every term needing h or that cotangent,
one program per (head, chunk). Only the two dependent wgmmas of the dS chain stay in the serial
loop; the cost is dh, one [NTa, HV, K, V] bf16 buffer (as large as S0's h).

Walk: one program per (sequence rank r, value head h, V tile vt of BV = 64 columns) walks its
sequence's chunks in REVERSE in a fori_loop whose trip count it reads from aligned_cu at run time
(one compile for any lengths), carrying dS [K, BV] float32 in registers (WGMMA layout), starting
from dht[n]'s tile. Per chunk c (last first), with chunk c - 1's tiles already in flight (two SMEM
slots, one barrier per slot, TMA) and dS = dS_next:

    dh[c][:, vt] = bf16(dS)                      TMA store from the wgmma operand tile
    du            = dv + kg @ bf16(dS)           wgmma [64, K] @ [K, BV]
    dS            = decay[:, None] * dS + scale * (qg^T @ do + w^T @ bf16(-du / scale))
                                                 two wgmmas into one [K, BV] accumulator (.T views, M = K)

with do in bf16 as given and the scale applied to the float32 product (a bf16(scale * do) operand
would round every element of do once more); dh0[n]'s tile = dS after the sequence's first chunk
(dht[n]'s tile for an empty sequence). V tiles are independent (du and dS are per V column).

Terms: one program per (head, chunk), all of V, grid (HV, NTa) with the chunks on CUDA's grid x (no
65535 limit): h[c] and dh[c] [K, V] (64-column slabs), v_new and do [64, V] by TMA, then

    dqg = scale * do @ h^T,  dkg = v_new @ dh^T,  dw = bf16(-du) @ h^T    wgmma chains over V
    dgc_last = decay * sum_V(h * dh)                                  registers

bf16(-du) is formed from du in registers into v_new's tile once dkg's product has read it (reading
dkg's accumulator waits for that wgmma), so the kernel fits two CTAs per SM; du is read while the
tensor cores run dkg's product, and dgc_last formed while they run dw's.

In place: the walk stores du over dv (a mutable ref: each chunk's dv tile is in SMEM before du's
rows are stored, and dv is read nowhere else), so the two never take two buffers. With `pairs`
(K == V == 128) the terms kernel stores dqg, dkg as their bf16 pairs (kda._mosaic_gpu.pair_store:
a chunk's [64, K] float32 tile as its hi rows, then its lo rows: the bytes of the chunk's [K, V]
bf16 state) over h[c] and dh[c], which its program has in SMEM before either store.

Tail: the chunks at or past aligned_cu[-1] (no sequence; h = 0 there, as the state stage stores
it) keep du = dv (du's buffer is dv's) and get dqg = dkg = dw = dgc_last = 0 from the terms kernel,
which reads nothing there; dh is not written there. aligned_cu[0] must be 0 (align's output). Padding rows inside a sequence's chunks go through
the same formulas as real rows (as the reference does). Nothing of qg, kg, w, h, v_new, do or the
gates is read at the tail.

Grid of the walk: (N, HV, V // BV) with names ("r", "h", "v"); with Config.longest_first rank r
takes the r-th longest sequence (kda._mosaic_gpu.sequence_order): Mosaic GPU launches (g0, g1, g2)
as CUDA (z, y, x), x fastest, so every (head, V tile) of the longest sequence starts first. CUDA
caps z and y at 65535; for N > 65535, or with Config(seq_major=False), the sequences go on x.

What is bf16 (wgmma operands; float32 operands would run as tf32): qg, kg, w, h, v_new (the dtype
policy's bf16 intermediates: the predicate refuses float32 ones, `apply` casts them), do (cast if it
comes in float32), the stored bf16(dS) and the in-kernel bf16(-du) (the walk's as bf16(-du / scale)).
dS, dv, du, the decay exp(gc_last) (formed in the launcher from each chunk's last gate row,
kda.stages.state.chunk_decay) and all accumulators and outputs are float32. Both kernels lower with
Lane semantics (no layout inference).

SMEM (`walk_smem_bytes`, `terms_smem_bytes`, from the scratch the launcher allocates; limit 232448):
the walk's two slots of qg, kg, w [64, K], do [64, 64] bf16, dv [64, 64] f32 and the decay row,
bf16(dS) and bf16(-du) and two barriers: 173072 bytes at K = 128, 115728 at K = 64, either V (one
program per SM). The terms kernel's h, dh, v_new and do tiles, the reduction scratch and a barrier:
100360 bytes at K = V = 128 (two CTAs per SM).

Packed do (`apply(..., do_packed=, rows=)`): both kernels read do packed [1, T, HV, V] bf16 (chunk
c's rows r < count[c] at packed row src[c] + r) by TMA into a plain landing and keep do with the
other rows zero (a select: they may hold other sequences' tokens or NaN) in the wgmma tile. The
terms kernel's landing shares v_new's bytes, which then arrive by TMA on a second barrier; the
walk's two landings (16 KiB more SMEM) are masked into the slot's do tile while du's wgmma runs.
The same bits, and the aligned do is not read.
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

from kda._mosaic_gpu import BF16, F32, MAX_GRID_YZ, ROW, aligned_cu_reason, clean_flag, copy_chunk_slabs, kept_rows
from kda._mosaic_gpu import live_chunk
from kda._mosaic_gpu import sequence_order, term_store, tile_shapes, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, params as _params, swz as _swz
from kda._mosaic_gpu import smem_bytes as _smem_bytes, smem_reason
from kda.stages.bwd_dh import Out
from kda.stages.state import chunk_decay

BT = 64
BV = 64                   # state-cotangent columns per walk program: one wgmma N tile
SLAB = 64                 # columns of a terms tile


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the walk's grid; they change neither the arithmetic nor the bits."""
  longest_first: bool = True    # rank r of the grid takes the r-th longest sequence (else input order)
  seq_major: bool = True        # sequences on the slowest-dispatched grid axis (if N <= 65535)


_DTYPES = (jnp.dtype(BF16), jnp.dtype(F32))


def _walk_scratch(K, packed=False):
  """The walk kernel's scratch types; packed: two plain landings of packed do's rows, after the
  barriers."""
  return [
      _swz((2, BT, K)), _swz((2, BT, K)), _swz((2, BT, K)),    # qg, kg, w: two slots each
      _swz((2, BT, BV)),                                        # do
      _swz((2, BT, BV), F32),                                   # dv
      plgpu.SMEM((2, K), F32),                                  # decay rows
      _swz((K, BV)), _swz((BT, BV)),                            # bf16(dS), bf16(-du): wgmma operands
      plgpu.Barrier(num_arrivals=6, num_barriers=2),
  ] + [plgpu.SMEM((2, BT, BV), BF16)] * packed


def walk_smem_bytes(K, packed=False):
  """Shared memory per walk program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates)."""
  return _smem_bytes(_walk_scratch(K, packed))


def _terms_scratch(K, V, packed=False):
  """The terms kernel's scratch types; packed: do's plain landing shares v_new's bytes, and v_new
  arrives on a barrier of its own."""
  nv = V // SLAB
  vn = _swz((nv, BT, SLAB))                                     # v_new, then bf16(-du)
  bars = [plgpu.Barrier(num_arrivals=4 * nv)]
  if packed:
    vn = plgpu.RefUnion(vn, plgpu.SMEM((nv, BT, SLAB), BF16))
    bars = [plgpu.Barrier(num_arrivals=3 * nv), plgpu.Barrier(num_arrivals=nv)]
  return [_swz((nv, K, SLAB)), _swz((nv, K, SLAB)),             # h, dh (64-column slabs)
          vn, _swz((nv, BT, SLAB)),                             # v_new, do
          *bars]


def terms_smem_bytes(K, V, packed=False):
  """Shared memory per terms program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates;
  dgc_last's row sums reserve the reduction scratch)."""
  return _smem_bytes(_terms_scratch(K, V, packed), reduction=True)


def _reason(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, packed=False,
            pairs=False) -> Optional[str]:
  """What the kernels can run (bf16 or float32 operands); `apply` raises with it."""
  reason, dims = tile_shapes(BT, "qg", qg, "v_new", v_new)
  if reason is not None:
    return reason
  Ta, HV, K, V = dims
  if pairs and not K == V == 2 * BT:
    return f"pairs need K == V == {2 * BT}, got K={K}, V={V}"
  if Ta % BT:
    return f"Ta must be a multiple of chunk_size {BT}, got {Ta}"
  NTa = Ta // BT
  for name, x, shape in (("kg", kg, qg.shape), ("w", w, qg.shape), ("gc_int", gc_int, qg.shape),
                         ("gc_frac", gc_frac, qg.shape), ("h", h, (1, NTa, HV, K, V)),
                         ("do", do, v_new.shape), ("dv", dv, v_new.shape)):
    if x.shape != shape:
      return f"{name} must have shape {shape}, got {x.shape}"
  named = (("qg", qg), ("kg", kg), ("w", w), ("gc_int", gc_int), ("gc_frac", gc_frac), ("h", h),
           ("v_new", v_new), ("do", do), ("dv", dv), ("dht", dht))
  for name, x in named:
    if jnp.dtype(x.dtype) not in _DTYPES:
      return f"{name} must be bfloat16 or float32, got {jnp.dtype(x.dtype).name}"
  if (reason := aligned_cu_reason(aligned_cu)) is not None:
    return reason
  N = aligned_cu.shape[0] - 1
  if dht.shape != (N, HV, K, V):
    return f"dht must have shape {(N, HV, K, V)}, got {dht.shape}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid y limit), got {HV}"
  return (smem_reason(walk_smem_bytes(K, packed), "bwd_dh walk")
          or smem_reason(terms_smem_bytes(K, V, packed), "bwd_dh terms"))


def supports(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, *, chunk_size, config=None,
             do_packed=None, pairs=False, **_) -> Optional[str]:
  """The stage's predicate: None if the kernels take this call, else the reason in words. Beyond
  what they can run (do_packed given: the terms kernel's packed landing counted), qg, kg, w, h,
  v_new must be bfloat16 (the dtype policy's bf16 intermediates; float32 ones would be rounded to
  bf16, below the float32 accuracy promised for float32 inputs). do and dv may be float32."""
  del config                      # no switch changes what the kernels take
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  reason = _reason(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, do_packed is not None, pairs)
  if reason is None:
    named = dict(qg=qg, kg=kg, w=w, h=h, v_new=v_new)
    if any(jnp.dtype(x.dtype) != jnp.dtype(BF16) for x in named.values()):
      reason = (f"mosaic_gpu bwd_dh takes bfloat16 qg, kg, w, h, v_new (float32 would be rounded to "
                f"bfloat16), got {', '.join(f'{n} {jnp.dtype(x.dtype).name}' for n, x in named.items())}")
  return reason


takes = supports                  # the name kda.stages.bwd_dh registers


def _walk_body(order_g, cu_g, qg_g, kg_g, w_g, do_g, dv_g, dec_g, dht_g, dh0_g, du_g, dh_g,
               qg_s, kg_s, w_s, do_s, dv_s, dec_s, dsb_s, dub_s, bars, *, scale, rows_g=None, land_s=None):
  # GMEM: order [N] (the sequence of each rank), cu [N+1] int32; qg, kg, w [Ta, HV, K], do [Ta, HV, V]
  # bf16 (do unscaled); dv [Ta, HV, V], dec [NTa, HV, K], dht, dh0 [N, HV, K, V] f32 (None: not
  # read / not stored); du [Ta, HV, V] f32: dv's ref (each chunk's dv tile lands in SMEM before du
  # is stored over it; the tail keeps du = dv); dh [NTa, HV, K, V] bf16 (dS_next of every chunk;
  # unwritten at the tail). rows_g (src, count [NTa], clean [1] int32): do is packed [T, HV, V],
  # chunk c's rows r < count[c] at packed row src[c] + r; they land in land_s and the other rows
  # (another sequence's tokens, maybe NaN) and, with clean, non-finite values become 0 (a select) in
  # do's tile while du's wgmma runs.
  K = dec_g.shape[2]
  r, i_h, i_v = lax.axis_index("r"), lax.axis_index("h"), lax.axis_index("v")
  i_n = order_g[r]
  bos, eos = cu_g[i_n], cu_g[i_n + 1]
  nch = (eos - bos) // BT
  c_last = bos // BT + nch - 1          # chunk of loop step 0 (the walk is in reverse)
  cols = pl.ds(i_v * BV, BV)

  def fetch(j, slot):
    c = c_last - j
    rows, bar = pl.ds(pl.multiple_of(c * BT, BT), BT), bars.at[slot]
    plgpu.copy_gmem_to_smem(qg_g.at[rows, i_h, :], qg_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(kg_g.at[rows, i_h, :], kg_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(w_g.at[rows, i_h, :], w_s.at[slot], bar)
    if rows_g is None:
      plgpu.copy_gmem_to_smem(do_g.at[rows, i_h, cols], do_s.at[slot], bar)
    else:
      plgpu.copy_gmem_to_smem(do_g.at[pl.ds(rows_g[0][c], BT), i_h, cols], land_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(dv_g.at[rows, i_h, cols], dv_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(dec_g.at[c, i_h, :], dec_s.at[slot], bar)

  @pl.when(nch > 0)
  def _():
    fetch(0, 0)

  def step(j, dS):
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < nch)
    def _():
      fetch(j + 1, 1 - slot)     # that slot's last readers, step j-1's loads and wgmmas, have completed

    c = c_last - j
    rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the previous chunk's dh store has read dsb_s
    dsb_s[...] = dS.astype(BF16)
    plgpu.commit_smem()          # before the wgmmas and the TMA store read it
    plgpu.copy_smem_to_gmem(dsb_s, dh_g.at[c, i_h, :, cols])
    plgpu.barrier_wait(bars.at[slot])
    qg, kg, w, do = (x.at[slot] for x in (qg_s, kg_s, w_s, do_s))
    decay = _load(dec_s.at[slot], ROW)                   # [K], one per row of dS

    def during():              # while du's wgmma runs: dv's tile; packed do: the chunk's rows, the
      if rows_g is not None:   # others 0 (the commit below publishes it)
        do[...] = kept_rows(_load(land_s.at[slot]), _iota(0, (BT, BV)), (None, rows_g[1][c], rows_g[2][0]))
      return _load(dv_s.at[slot])

    kd, dv = _acc([(kg, dsb_s)], (BT, BV), during=during)
    du = dv + kd
    dub_s[...] = (du * (-1.0 / scale)).astype(BF16)
    plgpu.commit_smem()
    du_g[rows, i_h, cols] = du.astype(du_g.dtype)
    dS = dS * lax.broadcast_in_dim(decay, (K, BV), [0]) + scale * _acc([(qg.T, do), (w.T, dub_s)], (K, BV))
    plgpu.wgmma_wait(0)          # no wgmma may stay in flight across the loop's back-edge
    return dS

  dS = zeros((K, BV)) if dht_g is None else _load(dht_g.at[i_n, i_h, :, cols])
  dS = lax.fori_loop(0, nch, step, dS)
  if dh0_g is not None:
    dh0_g[i_n, i_h, :, cols] = dS

  # Tail chunks (at or past aligned_cu[-1]): du = dv there, which du's buffer (dv's) already holds
  plgpu.wait_smem_to_gmem(0)     # every dh store has landed before the program exits


def _terms_body(cu_g, *refs, nv, scale, tail_zeros=True, packed=False, store_du=False, pairs=False):
  # GMEM: cu [N+1] int32; (packed: src, count [NTa] int32); h, dh [NTa, HV, K, V], vn [Ta, HV, V],
  # do [Ta, HV, V] bf16 (packed: [T, HV, V]); du [Ta, HV, V], dec [NTa, HV, K] f32; out dqg, dkg,
  # dw [Ta, HV, K], dgc [NTa, HV, K] f32. SMEM: 64-column slabs; v_new's tile takes bf16(-du) after
  # dkg's product has read it. store_du: bf16(du) is stored over v_new's rows (vn is a mutable ref,
  # read into SMEM before), and dw may be du's ref (every du tile is in registers before dw's store).
  # pairs: dqg, dkg are h's and dh's refs, taking their pairs (kda._mosaic_gpu.pair_store) over the
  # chunk's state, which is in SMEM before either is stored.
  if packed:
    src_g, cnt_g, clean_g, *refs = refs
    (h_g, dh_g, vn_g, do_g, du_g, dec_g, dqg_g, dkg_g, dw_g, dgc_g,
     h_s, dh_s, (vn_s, land_s), do_s, bar, bar_vn) = refs
  else:
    (h_g, dh_g, vn_g, do_g, du_g, dec_g, dqg_g, dkg_g, dw_g, dgc_g, h_s, dh_s, vn_s, do_s, bar) = refs
  K = h_g.shape[2]
  i_h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  slab = lambda j: pl.ds(j * SLAB, SLAB)
  live = live_chunk(cu_g, c, BT)   # chunks at or past aligned_cu[-1]: nothing is read, zeros out

  store = lambda o_g, x: term_store(o_g, c, i_h, rows, slice(None), x, pairs, BT)

  @pl.when(live)
  def _():
    for j in range(nv):
      plgpu.copy_gmem_to_smem(h_g.at[c, i_h, :, slab(j)], h_s.at[j], bar)
      plgpu.copy_gmem_to_smem(dh_g.at[c, i_h, :, slab(j)], dh_s.at[j], bar)
    if packed:    # do lands in plain SMEM (TMA takes any packed row there), whole [64, 64] tiles
      src, cnt = src_g[c], cnt_g[c]
      for j in range(nv):
        plgpu.copy_gmem_to_smem(do_g.at[pl.ds(src, BT), i_h, slab(j)], land_s.at[j], bar)
      plgpu.barrier_wait(bar)
      row = _iota(0, (BT, SLAB))   # other sequences' rows (maybe NaN) out, by a select
      for j in range(nv):
        do_s.at[j][...] = kept_rows(_load(land_s.at[j]), row, (src, cnt, clean_g[0]))
      plgpu.commit_smem()   # also a warpgroup barrier: the landing is read before v_new's TMA reuses its bytes
      copy_chunk_slabs(((vn_g, vn_s),), rows, i_h, bar_vn)
    else:
      copy_chunk_slabs(((vn_g, vn_s), (do_g, do_s)), rows, i_h, bar)
      plgpu.barrier_wait(bar)
    store(dqg_g, scale * _acc([(do_s.at[j], h_s.at[j].T) for j in range(nv)], (BT, K)))
    if packed:
      plgpu.barrier_wait(bar_vn)
    # du is read while the tensor cores run dkg's product, dgc formed while they run dw's
    dkg, dus = _acc([(vn_s.at[j], dh_s.at[j].T) for j in range(nv)], (BT, K),
                    during=lambda: [_load(du_g.at[rows, i_h, slab(j)]).astype(BF16) for j in range(nv)])
    store(dkg_g, dkg)
    for j, du in enumerate(dus):   # reading dkg waited for its wgmma: v_new's tile is free
      vn_s.at[j][...] = -du
      if store_du:
        vn_g[rows, i_h, slab(j)] = du
    plgpu.commit_smem()

    def dgc():
      prod = sum(jnp.sum(_load(h_s.at[j]).astype(F32) * _load(dh_s.at[j]).astype(F32), axis=1)
                 for j in range(nv))
      return _load(dec_g.at[c, i_h, :], ROW) * prod
    dw, dgc_g[c, i_h, :] = _acc([(vn_s.at[j], h_s.at[j].T) for j in range(nv)], (BT, K), during=dgc)
    dw_g[rows, i_h, :] = dw

  def tail():
    if store_du:
      for j in range(nv):
        vn_g[rows, i_h, slab(j)] = _load(du_g.at[rows, i_h, slab(j)]).astype(BF16)
    zk = zeros((BT, K))
    store(dqg_g, zk)
    store(dkg_g, zk)
    dw_g[rows, i_h, :] = zk
    dgc_g[c, i_h, :] = zeros((K,), ROW)

  if tail_zeros:                 # False: the tail stays unwritten
    pl.when(jnp.logical_not(live))(tail)


def _terms_kernel(Ta, HV, K, V, *, scale, interp, tail_zeros=True, packed=False, store_du=False, pairs=False):
  """The terms kernel; packed: it reads do packed; store_du: v_new and du are mutable refs, bf16(du)
  is stored over v_new and, where K == V, dw over du; pairs: h and dh are mutable refs taking dqg's
  and dkg's pairs (_terms_body)."""
  NTa = Ta // BT
  kw = {} if tail_zeros else dict(tail_zeros=False)
  if packed:
    kw["packed"] = True
  body = functools.partial(_terms_body, nv=V // SLAB, scale=scale, store_du=store_du, pairs=pairs, **kw)
  dw_over_du = store_du and K == V
  n_in = 7 + 3 * packed            # cu, (src, count, clean), h, dh, vn, do, du, dec

  def wrapped(*refs):              # the body's refs: inputs, then dqg, dkg, dw, dgc_last, scratch
    ins, rest = list(refs[:n_in]), list(refs[n_in:])
    dqk = ins[n_in - 6:n_in - 4] if pairs else [rest.pop(0), rest.pop(0)]
    dw = ins[n_in - 2] if dw_over_du else rest.pop(0)
    return body(*ins, *dqk, dw, *rest)
  fk = jax.ShapeDtypeStruct((Ta, HV, K), F32)
  return plgpu.kernel(
      wrapped,
      out_type=(*[fk] * (2 * (not pairs) + (not dw_over_du)),     # dqg, dkg, dw
                jax.ShapeDtypeStruct((NTa, HV, K), F32)),          # dgc_last
      grid=(HV, NTa), grid_names=("h", "c"),
      scratch_types=_terms_scratch(K, V, packed),
      compiler_params=_params(lane=True),
      kernel_name="kda_bwd_dh_terms", interpret=interp,
  )


def _walk_kernel(Ta, HV, K, V, N, *, scale, interp, grid, names, dht_zero=False, need_dh0=True, packed=False,
                 du16=False):
  """The walk kernel, du stored over dv (a mutable ref) or, du16, as bf16 in an output of its own
  (the tail's rows unwritten); dht_zero: dht not read; need_dh0=False: dh0 not stored; packed: do is
  packed, with ChunkRows' src and count after aligned_cu (_walk_body)."""
  absent = [8] * dht_zero + [9] * (not need_dh0)     # dht_g, dh0_g in _walk_body's refs

  def body(*refs):
    refs = list(refs)
    kw = {}
    if packed:
      kw = dict(rows_g=(refs.pop(2), refs.pop(2), refs.pop(2)), land_s=refs.pop())
    for i in absent:
      refs.insert(i, None)
    refs.insert(10, refs.pop(11) if du16 else refs[6])   # du_g: its output, or dv's ref
    return _walk_body(*refs, scale=scale, **kw)

  return plgpu.kernel(
      body,
      out_type=(*[jax.ShapeDtypeStruct((N, HV, K, V), F32)] * need_dh0,   # dh0
                jax.ShapeDtypeStruct((Ta // BT, HV, K, V), BF16),   # dh: dS_next per chunk
                *[jax.ShapeDtypeStruct((Ta, HV, V), BF16)] * du16),
      grid=grid, grid_names=names,
      scratch_types=_walk_scratch(K, packed),
      compiler_params=_params(lane=True),
      kernel_name="kda_bwd_dh_walk", interpret=interp,
  )


def apply(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, *, scale, chunk_size,
          interpret=False, config=None, dht_zero=False, need_dh0=True, tail_zeros=True, do_packed=None,
          rows=None, du_dtype=None, pairs=False, clean=None):
  """The stage on the kernels; bf16 or float32 operands (qg, kg, w, h, v_new, do rounded to bf16;
  the predicate `supports` adds the dtype policy). dht_zero: dht is known to be zero (not read: XLA
  drops a zeros array nobody reads); need_dh0=False: dh0 is not stored (zeros returned, for callers
  that drop it). The pipeline sets them for a final state nobody uses and an initial state made of
  zeros inside chunk_kda. tail_zeros=False: dqg, dkg, dw, dgc_last are left unwritten at the
  chunks at or past aligned_cu[-1] (for callers that never read them: the packed backward).
  do_packed [1, T, HV, V] bf16 with rows (padding.ChunkRows): both kernels read do packed (the
  align folded into their loads: chunk c's rows r < count[c] from packed row src[c] + r) and the
  aligned do is not read (only its shape is checked). The same bits. clean (with do_packed; a bool
  scalar, traced or not): where true, non-finite values of do are read as 0 too (kda.confine's
  rerun), with no copy.
  du_dtype=bfloat16 (for a consumer that rounds du to bf16 anyway): the terms kernel stores bf16(du)
  over v_new's buffer and, where K == V, dw over du's, so neither outlives the call as an extra
  buffer (v_new is then not read after this stage). The same bits of dqg, dkg, dw, dgc_last.
  pairs=True (K == V == 128): dqg and dkg come as their pairs [1, NTa, HV, 128, K] bf16
  (kda._mosaic_gpu.pair_store: hi + lo, ~2^-17 relative), stored over h's and dh's buffers (h is
  then not read after this stage), so neither takes a float32 buffer of its own."""
  config = config or Config()
  packed = do_packed is not None
  reason = (f"chunk_size must be {BT}, got {chunk_size}" if chunk_size != BT else
            _reason(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, packed, pairs))
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_dh kernel: {reason}")
  _, Ta, HV, K = qg.shape
  V = v_new.shape[-1]
  N = aligned_cu.shape[0] - 1
  NTa = Ta // BT
  if N == 0:                                  # no program to launch; every chunk is tail
    zk = jnp.zeros((1, Ta, HV, K), F32)
    zp = jnp.zeros((1, NTa, HV, 2 * BT, K), BF16) if pairs else zk
    return Out(jnp.zeros((0, HV, K, V), F32), dv.astype(du_dtype or F32), zp, zp, zk, jnp.zeros((1, NTa, HV, K), F32))
  if packed and (rows is None or do_packed.ndim != 4 or do_packed.shape[0] != 1
                 or do_packed.shape[2:] != (HV, V) or do_packed.dtype != BF16):
    raise ValueError(f"mosaic_gpu bwd_dh kernel: do_packed must be bf16 [1, T, {HV}, {V}] with rows, got "
                     f"{do_packed.dtype}{list(do_packed.shape)}, rows {rows is not None}")
  aligned_cu = aligned_cu.astype(jnp.int32)
  decay = chunk_decay(gc_int, gc_frac, BT)                          # [NTa, HV, K] f32
  interp = plgpu.InterpretGPUParams() if interpret else None
  dh0, du, dh = _walk(qg, kg, w, decay, do, dv, dht, aligned_cu, scale=scale, interp=interp, config=config,
                      dht_zero=dht_zero, need_dh0=need_dh0, do_packed=do_packed, rows=rows, clean=clean)
  v_new, h = v_new[0].astype(BF16), h[0].astype(BF16)
  dob = None if packed else do[0].astype(BF16)
  lead = _rows_lead(rows, clean) if packed else ()
  store_du = du_dtype is not None and jnp.dtype(du_dtype) == jnp.dtype(BF16)
  terms = _terms_kernel(Ta, HV, K, V, scale=float(scale), interp=interp, tail_zeros=tail_zeros, packed=packed,
                        store_du=store_du, pairs=pairs)
  # in place: v_new's buffer takes bf16(du) and du's dw (K == V) with store_du; h's and dh's the pairs
  ref = lambda x, mutable: jax.new_ref(x) if mutable else x
  hr, dhr, vn, dur = ref(h, pairs), ref(dh, pairs), ref(v_new, store_du), ref(du, store_du)
  outs = list(terms(aligned_cu, *lead, hr, dhr, vn, do_packed[0] if packed else dob, dur, decay))
  dqg, dkg = (jax.ref.freeze(hr), jax.ref.freeze(dhr)) if pairs else (outs.pop(0), outs.pop(0))
  dw = jax.ref.freeze(dur) if store_du and K == V else outs.pop(0)
  dgc = outs.pop(0)
  du = jax.ref.freeze(vn) if store_du else du
  return Out(dh0, du[None], dqg[None], dkg[None], dw[None], dgc[None])


def _rows_lead(rows, clean):
  """The leading refs of both kernels where do is packed: ChunkRows' src and count, the clean flag."""
  return rows.src.astype(jnp.int32), rows.count.astype(jnp.int32), clean_flag(clean)


def _walk(qg, kg, w, decay, do, dv, dht, aligned_cu, *, scale, interp, config, dht_zero, need_dh0, do_packed, rows,
          clean, du16=False):
  """The walk kernel's call (N >= 1) -> (dh0 [N, HV, K, V] f32 (zeros unless need_dh0), du [Ta, HV, V]
  (float32 over dv's buffer, or du16: bf16 of its own, the tail's rows unwritten), dh [NTa, HV, K, V]
  bf16)."""
  packed = do_packed is not None
  _, Ta, HV, K = qg.shape
  V, N = dv.shape[-1], aligned_cu.shape[0] - 1
  order = sequence_order(aligned_cu, config.longest_first)       # [N]: the sequence of each rank
  qg, kg, w = (x[0].astype(BF16) for x in (qg, kg, w))
  dob = None if packed else do[0].astype(BF16)
  dv = dv[0].astype(F32)
  if config.seq_major and N <= MAX_GRID_YZ:
    grid, names = (N, HV, V // BV), ("r", "h", "v")
  else:
    grid, names = (V // BV, HV, N), ("v", "h", "r")
  kernel = _walk_kernel(Ta, HV, K, V, N, scale=float(scale), interp=interp, grid=grid, names=names,
                        dht_zero=dht_zero, need_dh0=need_dh0, packed=packed, du16=du16)
  du = dv if du16 else jax.new_ref(dv)                              # du over dv: dv dies in the walk
  lead = _rows_lead(rows, clean) if packed else ()
  outs = kernel(order, aligned_cu, *lead, qg, kg, w, do_packed[0] if packed else dob, du, decay,
                *(() if dht_zero else (dht.astype(F32),)))
  *dh0, dh = outs[:-1] if du16 else outs
  du = outs[-1] if du16 else jax.ref.freeze(du)
  return (dh0[0] if need_dh0 else jnp.zeros((N, HV, K, V), F32)), du, dh


def walk(qg, kg, w, gc_int, gc_frac, v_new, do, dv, dht, aligned_cu, *, scale, interpret=False, config=None,
         dht_zero=False, need_dh0=True, do_packed=None, rows=None, clean=None):
  """The walk alone, for a consumer that forms the terms itself (bwd_wy's `terms` kernel): -> (dh0
  [N, HV, K, V] f32, dh [1, NTa, HV, K, V] bf16, du [1, Ta, HV, V] bf16 (the tail's rows unwritten),
  decay [NTa, HV, K] f32). Arguments as `apply`'s (h is not read here)."""
  config = config or Config()
  _, Ta, HV, K = qg.shape
  V, N = v_new.shape[-1], aligned_cu.shape[0] - 1
  decay = chunk_decay(gc_int, gc_frac, BT)
  if N == 0:
    return (jnp.zeros((0, HV, K, V), F32), jnp.zeros((1, Ta // BT, HV, K, V), BF16),
            jnp.zeros((1, Ta, HV, V), BF16), decay)
  interp = plgpu.InterpretGPUParams() if interpret else None
  dh0, du, dh = _walk(qg, kg, w, decay, do, dv, dht, aligned_cu.astype(jnp.int32), scale=scale, interp=interp,
                      config=config, dht_zero=dht_zero, need_dh0=need_dh0, do_packed=do_packed, rows=rows,
                      clean=clean, du16=True)
  return dh0, dh[None], du[None], decay
