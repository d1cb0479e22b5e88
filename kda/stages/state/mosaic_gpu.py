"""state: the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.state.

Kernel: one program per (sequence rank r, value head h, V tile vt) walks its sequence's chunks in a
fori_loop whose trip count it reads from aligned_cu at run time (one compile for any lengths),
carrying the state S [K, BV] float32 in registers (WGMMA layout, BV = 64) across the chunks. Per
chunk c, with the next chunk's tiles already in flight (two SMEM slots, one barrier per slot, TMA):

    h[c]  = S                      registers -> SMEM -> TMA store
    v_new = u_c - w_c @ bf16(S)    wgmma [64, K] @ [K, BV], bf16 operands, f32 accumulation
    S     = decay_c[:, None] * S + kg_c^T @ bf16(v_new)
                                   wgmma on the transposed view kg_s.T: [K, 64] @ [64, BV], M = K

What is bf16: kg, w, u (cast in the launcher: one XLA pass over them if they come in float32) and
the two SMEM copies that feed the tensor cores, bf16(S) and bf16(v_new). S itself, the decay and
final_state are float32; the decay exp(gc_int + gc_frac) of each chunk's last row is formed in the
launcher ([NTa, HV, K] f32, it reads only those rows). h and v_new are stored in bf16 when kg, w, u
come in bf16 (the dtype policy: they feed the output stage's bf16 wgmmas), else in float32
(Config.store_dtype overrides): the bf16 ones are those very wgmma operands, bf16(S) and
bf16(v_new), TMA-stored straight from their SMEM copies, so they need no stage of their own and
are the bits the output stage would round to anyway. Rounding S and v_new to bf16 in the dots
costs ~1e-3 relative error against the float32 reference, and float32 inputs are rounded to bf16
too, so this kernel does not meet the float32 1e-5 policy: the predicate (`supports`) refuses
float32 kg, w, u, and `apply` casts them.

Grid: (N, HV, V // BV) with names ("r", "h", "v"). Mosaic GPU launches grid (g0, g1, g2) as CUDA
(z, y, x) and x is dispatched fastest, so with the sequence rank on g0 every (head, V tile) of the
longest sequence starts first (rank r takes the r-th longest sequence: an argsort in the launcher).
CUDA caps z and y at 65535; for N > 65535 the launcher puts the sequences on x instead.
Config(group_chunks=G > 0): one program walks the consecutive sequences that start in one window of
G chunks, where that makes fewer programs than sequences (kda._mosaic_gpu.sequence_groups).

Tail: the chunks at or past aligned_cu[-1] get h = 0 and v_new = 0 from the kernel itself; the N
programs of each (head, V tile) take them round-robin (disjoint rows), each with TMA stores of one
zeroed SMEM tile, so the launcher has no extra pass over h (a read and a write of all of h).
aligned_cu[0] must be 0 (align's output).

SMEM per program (bytes, BT = 64, BV = 64; `scratch`, `smem_bytes`):
    w, kg     2 slots x [64, K] bf16 each                  512 K
    u         2 slots x [64, BV] bf16                      16384
    decay     2 slots x [K] f32                            8 K (each buffer from a 1 KiB boundary)
    bf16(S)   [K, BV]; bf16(v_new) [64, BV]                128 K + 8192
    h stage   [K, BV] f32; v_new stage [64, BV] f32        256 K + 16384   (f32 stores, stage_stores)
  bf16 stores: 111632 (K = 128) and 70672 (K = 64), room for two programs per SM (228 KiB); f32
  stores through the stages 156688 and 99344; with stage_stores=False (registers straight to GMEM,
  the stages shrink to 2 KiB each) as bf16 stores.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32, MAX_GRID_YZ, ROW, WG, tile_shapes, tail_share, walk_order, with_absent, zeros
from kda._mosaic_gpu import params as _params, smem_bytes as _smem_bytes, smem_reason
from kda._mosaic_gpu import aligned_cu_reason, bf16_reason, walk_range
from kda._mosaic_gpu import load as _load
from kda._mosaic_gpu import mm as _mm
from kda._mosaic_gpu import swz as _swz
from kda.stages.state import Out, chunk_decay

BT = 64
BV = 64                        # state columns per program: one wgmma N tile


@dataclasses.dataclass(frozen=True)
class Config:
  """Variants of the state kernel; they depend on K, V, BT and dtype only."""
  longest_first: bool = True   # rank r of the grid takes the r-th longest sequence
  seq_major: bool = True       # sequences on the slowest-dispatched grid axis (if N <= 65535)
  stage_stores: bool = True    # h and v_new through SMEM + TMA (else registers -> GMEM stores)
  lane_semantics: bool = False  # Mosaic GPU LoweringSemantics.Lane (kda._mosaic_gpu.params) instead of Warpgroup
  swizzle_stages: bool = False  # the f32 store stages tiled + 128-byte swizzled (fewer bank conflicts)
  store_dtype: Optional[str] = None  # h and v_new as stored; None: bfloat16 if kg, w, u are, else float32
  # > 0 walks groups of consecutive sequences (those starting in the same window of this many
  # chunks) per program where that makes fewer programs than sequences; 0: one per sequence
  group_chunks: int = 0

  def __post_init__(self):
    if not isinstance(self.group_chunks, int) or isinstance(self.group_chunks, bool) or self.group_chunks < 0:
      raise ValueError(f"group_chunks must be an int >= 0, got {self.group_chunks!r}")
    if self.store_dtype not in (None, "float32", "bfloat16"):
      raise ValueError(f"store_dtype must be None, 'float32' or 'bfloat16', got {self.store_dtype!r}")

  def stores(self, kg, w, u):
    """The dtype h and v_new are stored in for these inputs."""
    if self.store_dtype is not None:
      return jnp.dtype(self.store_dtype)
    return jnp.dtype(BF16 if all(jnp.dtype(x.dtype) == jnp.dtype(BF16) for x in (kg, w, u)) else F32)


def shape_reason(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size) -> Optional[str]:
  """None if the state kernels (this one, kda.fused.state_output) take these shapes and dtypes
  (bf16 or float32), else the reason in words."""
  reason, dims = tile_shapes(chunk_size, "kg", kg, "u", u)
  if reason is not None:
    return reason
  Ta, HV, K, V = dims
  if Ta % chunk_size:
    return f"Ta must be a multiple of chunk_size {chunk_size}, got {Ta}"
  for name, x, shape in (("w", w, kg.shape), ("gc_int", gc_int, kg.shape), ("gc_frac", gc_frac, kg.shape)):
    if x.shape != shape:
      return f"{name} must have shape {shape}, got {x.shape}"
  for name, x in (("kg", kg), ("w", w), ("u", u), ("gc_int", gc_int), ("gc_frac", gc_frac),
                  ("initial_state", initial_state)):
    if jnp.dtype(x.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
      return f"{name} must be bfloat16 or float32, got {jnp.dtype(x.dtype).name}"
  if aligned_cu_reason(aligned_cu):
    return aligned_cu_reason(aligned_cu)
  N = aligned_cu.shape[0] - 1
  if initial_state.shape != (N, HV, K, V):
    return f"initial_state must have shape {(N, HV, K, V)}, got {initial_state.shape}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid y limit), got {HV}"
  return None


def scratch(K, config, store_dtype):
  """The kernel's scratch_types: kg, w [64, K] and u [64, BV] (two slots each, swizzled), the decay
  rows [K] f32 (two slots), bf16(S) [K, BV] and bf16(v_new) [64, BV] (the wgmmas' right-hand
  sides), the h and v_new store stages (f32 stores through SMEM; else 8-row placeholders), the two
  slots' barriers."""
  stage = lambda shape: _swz(shape, F32) if config.swizzle_stages else plgpu.SMEM(shape, F32)
  f32_stages = config.stage_stores and jnp.dtype(store_dtype) == jnp.dtype(F32)   # bf16 stores reuse the wgmma operands
  return [
      _swz((2, BT, K)), _swz((2, BT, K)), _swz((2, BT, BV)),    # kg, w, u: two slots each
      plgpu.SMEM((2, K), F32),                                  # decay rows, two slots
      _swz((K, BV)), _swz((BT, BV)),                            # bf16(S), bf16(v_new): wgmma RHS
      stage((K, BV) if f32_stages else (8, BV)),                # h store stage
      stage((BT, BV) if f32_stages else (8, BV)),               # v_new store stage
      plgpu.Barrier(num_arrivals=4, num_barriers=2),
  ]


def smem_bytes(K, config=None, store_dtype=BF16):
  """The SMEM the kernel asks for (as lowered for CUDA) with h, v_new stored in `store_dtype`."""
  return _smem_bytes(scratch(K, config or Config(), store_dtype))


def _kernel_reason(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, config):
  reason = shape_reason(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size)
  return reason or smem_reason(smem_bytes(kg.shape[-1], config, config.stores(kg, w, u)))


def supports(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, config=None,
             **_) -> Optional[str]:
  """The stage's predicate: None if `apply` takes this call, else the reason in words; bf16 kg, w,
  u only (the dtype policy's bf16 intermediates)."""
  reason = _kernel_reason(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                          config=config or Config())
  return reason or bf16_reason("state", kg=kg, w=w, u=u)


takes = supports       # the name kda.stages.state registers the predicate by


def _body(order_g, cu_g, *refs, stage_stores, grouped=False):
  # GMEM: order [N] (grouped: [P], the groups' ranks), cu [N+1] int32; (grouped) grp [P+1] int32 the
  # groups' sequence ranges (kda._mosaic_gpu.sequence_groups); kg, w [Ta, HV, K] bf16; u [Ta, HV, V]
  # bf16; dec [NTa, HV, K] f32; h0, ht [N, HV, K, V] f32; h [NTa, HV, K, V], vn [Ta, HV, V] f32 or bf16.
  grp_g = refs[0] if grouped else None
  (kg_g, w_g, u_g, dec_g, h0_g, h_g, vn_g, ht_g,
   kg_s, w_s, u_s, dec_s, sb_s, vb_s, hf_s, vf_s, bars) = refs[grouped:]
  N = cu_g.shape[0] - 1
  programs = order_g.shape[0]
  NTa, K = h_g.shape[0], h_g.shape[2]
  bf16_out = h_g.dtype == BF16
  # bf16 stores go out of the wgmma operand copies themselves; f32 ones through their own stages
  h_st, v_st = (sb_s, vb_s) if bf16_out else (hf_s, vf_s)
  r, i_h, i_v = lax.axis_index("r"), lax.axis_index("h"), lax.axis_index("v")
  n_lo, n_hi, bos, eos = walk_range(order_g, grp_g, cu_g, r)   # grouped: consecutive sequences
  i_n = n_lo
  nch = (eos - bos) // BT
  cols = pl.ds(i_v * BV, BV)

  def fetch(i, slot):
    start = pl.multiple_of(bos + i * BT, BT)
    rows, bar = pl.ds(start, BT), bars.at[slot]
    plgpu.copy_gmem_to_smem(w_g.at[rows, i_h, :], w_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(kg_g.at[rows, i_h, :], kg_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(u_g.at[rows, i_h, cols], u_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(dec_g.at[start // BT, i_h, :], dec_s.at[slot], bar)

  @pl.when(nch > 0)
  def _():
    fetch(0, 0)

  def step(i, S):
    slot = lax.rem(i, 2)

    @pl.when(i + 1 < nch)
    def _():
      fetch(i + 1, 1 - slot)     # that slot's last readers, step i-1's wgmmas, have completed

    start = pl.multiple_of(bos + i * BT, BT)
    rows = pl.ds(start, BT)
    c = start // BT
    if stage_stores:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # step i-1's h and v_new stores have read
      if not bf16_out:
        hf_s[...] = S
    sb_s[...] = S.astype(BF16)
    plgpu.commit_smem()                                  # before TMA and wgmma read them
    if stage_stores:
      plgpu.copy_smem_to_gmem(h_st, h_g.at[c, i_h, :, cols])
    else:
      h_g[c, i_h, :, cols] = S.astype(h_g.dtype)
    plgpu.barrier_wait(bars.at[slot])

    v = _load(u_s.at[slot]).astype(F32) - _mm(w_s.at[slot], sb_s, (BT, BV))
    vb_s[...] = v.astype(BF16)
    if stage_stores and not bf16_out:
      vf_s[...] = v
    plgpu.commit_smem()
    if stage_stores:
      plgpu.copy_smem_to_gmem(v_st, vn_g.at[rows, i_h, cols])
    else:
      vn_g[rows, i_h, cols] = v.astype(vn_g.dtype)

    decay = _load(dec_s.at[slot], ROW)                   # [K], one per row of S
    S = S * lax.broadcast_in_dim(decay, (K, BV), [0]) + _mm(kg_s.at[slot].T, vb_s, (K, BV))
    plgpu.wgmma_wait(0)          # no wgmma may stay in flight across the loop's back-edge
    return S

  def walk(n, i0, i1):           # sequence n's chunks [i0, i1) from its h0 (None: zero), ht at the end
    S0 = zeros((K, BV)) if h0_g is None else _load(h0_g.at[n, i_h, :, cols])
    final = lax.fori_loop(i0, i1, step, S0)
    if ht_g is not None:                                                      # None: not stored
      ht_g[n, i_h, :, cols] = final

  if grouped:                    # the prefetch runs on across the group's sequences
    def sequence(n, carry):
      walk(n, (cu_g[n] - bos) // BT, (cu_g[n + 1] - bos) // BT)
      return carry

    lax.fori_loop(n_lo, n_hi, sequence, 0)
  else:
    walk(i_n, 0, nch)

  # Tail chunks (at or past aligned_cu[-1]) round-robin over the N programs of this (head, V tile),
  # the shortest sequence's program first; each stores the same zeroed tiles, so SMEM is written once.
  first, count = tail_share(cu_g, N, NTa, r, BT, programs)
  zh = plgpu.layout_cast(jnp.zeros((K, BV), F32), WG)
  zv = plgpu.layout_cast(jnp.zeros((BT, BV), F32), WG)

  @pl.when(count > 0)
  def _():
    if stage_stores:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      h_st[...] = zh.astype(h_st.dtype)
      v_st[...] = zv.astype(v_st.dtype)
      plgpu.commit_smem()

    def zero(j, carry):
      c = first + j * programs
      rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
      if stage_stores:
        plgpu.copy_smem_to_gmem(h_st, h_g.at[c, i_h, :, cols])
        plgpu.copy_smem_to_gmem(v_st, vn_g.at[rows, i_h, cols])
      else:
        h_g[c, i_h, :, cols] = zh.astype(h_g.dtype)
        vn_g[rows, i_h, cols] = zv.astype(vn_g.dtype)
      return carry

    lax.fori_loop(0, count, zero, 0)

  plgpu.wait_smem_to_gmem(0)     # every TMA store has landed before the program exits


def apply(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, interpret=False,
          config=None, zero_h0=False, store_final=True):
  """zero_h0: initial_state is known to be zero (not read: XLA drops a zeros array nobody reads);
  store_final=False: final_state is not stored (returned as zeros, for callers that drop it).
  float32 kg, w, u are rounded to bf16 (`supports` refuses them; tests and tools call this)."""
  config = config or Config()
  reason = _kernel_reason(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                          config=config)
  if reason is not None:
    raise ValueError(f"mosaic_gpu state kernel: {reason}")
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  N = aligned_cu.shape[0] - 1
  NTa = Ta // BT
  sdt = config.stores(kg, w, u)
  if N == 0:                                  # no program to launch; every chunk is tail
    return Out(jnp.zeros((1, NTa, HV, K, V), sdt), jnp.zeros((1, Ta, HV, V), sdt),
               jnp.zeros((0, HV, K, V), F32))
  aligned_cu = aligned_cu.astype(jnp.int32)
  order, bounds = walk_order(aligned_cu, NTa, config.group_chunks, config.longest_first, BT)
  R = order.shape[0]                          # programs per (head, V tile)
  decay = chunk_decay(gc_int, gc_frac, BT)                          # [NTa, HV, K] f32
  kg, w, u = (x[0].astype(BF16) for x in (kg, w, u))

  if config.seq_major and R <= MAX_GRID_YZ:
    grid, names = (R, HV, V // BV), ("r", "h", "v")
  else:
    grid, names = (V // BV, HV, R), ("v", "h", "r")
  grouped = bounds is not None
  body = lambda *refs: _body(*refs, stage_stores=config.stage_stores, **({"grouped": True} if grouped else {}))
  absent = [6 + grouped] * zero_h0 + [9 + grouped] * (not store_final)   # h0_g, ht_g in _body's refs
  if absent:
    body = with_absent(body, absent)
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((NTa, HV, K, V), sdt),
                jax.ShapeDtypeStruct((Ta, HV, V), sdt),
                *[jax.ShapeDtypeStruct((N, HV, K, V), F32)] * store_final),
      grid=grid, grid_names=names,
      scratch_types=scratch(K, config, sdt),
      compiler_params=_params(config.lane_semantics),
      kernel_name="kda_state", interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  h0 = () if zero_h0 else (initial_state.astype(F32),)
  h, v_new, *final = f(order, aligned_cu, *(() if bounds is None else (bounds,)), kg, w, u, decay, *h0)
  return Out(h[None], v_new[None], final[0] if store_final else jnp.zeros((N, HV, K, V), F32))
