"""state: the Pallas kernel, Triton lowering (any CUDA GPU); the math is in kda.stages.state.

Kernel: grid (V tiles, HV, N); one program per (V tile, head, sequence) walks that sequence's chunks
with a fori_loop whose trip count it reads from aligned_cu, carrying the [K, BV] float32 state on chip.
Program r of the last grid axis takes the r-th longest sequence (an argsort of the lengths, on
device), so on the GPU, which dispatches the last axis slowest, long sequences start first. The
chunks after aligned_cu[-1] are zeroed (h and v_new) round-robin by the N programs of each
(V tile, head): disjoint rows, so no two GPU programs write the same memory.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kda import _pallas
from kda._vma import out_struct
from kda.stages.gate import exponent
from kda.stages.state import NAME, Out


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles of the state kernel; they depend on K, V, BT and dtype only, never on T or cu_seqlens."""
  block_v: int = 64           # BV: state columns per program (capped at V rounded up to a power of 2)
  block_k: int = 128          # state rows per dot: K = 256 runs as two slabs in the shared memory K = 128 needs
  # Both dots feed the carried state, so rounding compounds: TF32 alone (1e-3 per dot) drifts, IEEE
  # float32 runs on the FMA units (about 13x slower); three TF32 passes keep ~3e-7 relative error
  # on the tensor cores.
  precision: str = "tf32x3"
  num_warps: int = 4
  num_stages: int = 2
  longest_first: bool = True  # hand sequences to programs longest first (an on-device argsort)

  def __post_init__(self):
    _pallas.check_config(self)


def _kernel(order_ref, cu_ref, kg_ref, w_ref, u_ref, gi_ref, gf_ref, h0_ref, h_ref, v_new_ref, ht_ref, *,
            chunk_size, precision, slab):
  # refs: order [N], cu [N+1] int32; kg, w, gc_int, gc_frac [Ta, K]; u, v_new [Ta, BV]; h [NTa, K, BV];
  # h0, ht [N, K, BV] (all of one head and V tile). Both dots run at `precision` (Config: three TF32
  # passes by default): their rounding feeds the carried state and compounds over the chunks. The
  # state is carried as K // slab row slabs, so each dot's tiles are at most [BT, slab] x [slab, BV]
  # whatever K (Triton stages dot operands in shared memory).
  BT = chunk_size
  f32 = jnp.float32
  N = order_ref.shape[0]
  NTa, K, BV = h_ref.shape
  slabs = [pl.ds(j * slab, slab) for j in range(K // slab)]
  i_r = pl.program_id(2)
  i_n = order_ref[i_r]
  bos, eos = cu_ref[i_n], cu_ref[i_n + 1]

  def chunk(i, b_h):
    start = pl.multiple_of(bos + i * BT, BT)
    rows = pl.ds(start, BT)
    b_v = u_ref[rows, :].astype(f32)
    for s, b_s in zip(slabs, b_h):
      h_ref[start // BT, s, :] = b_s
      b_v = b_v - jnp.dot(w_ref[rows, s].astype(f32), b_s, precision=precision, preferred_element_type=f32)
    v_new_ref[rows, :] = b_v
    last = pl.ds(start + BT - 1, 1)
    out = []
    for s, b_s in zip(slabs, b_h):
      b_glast = exponent(gi_ref[last, s], gf_ref[last, s])              # [1, slab]
      b_upd = lax.dot_general(kg_ref[rows, s].astype(f32), b_v, _pallas.TN_DIMS, precision=precision,
                              preferred_element_type=f32)
      out.append(b_s * jnp.exp(jnp.transpose(b_glast)) + b_upd)
    return tuple(out)

  b_h = lax.fori_loop(0, (eos - bos) // BT, chunk, tuple(h0_ref[i_n, s, :].astype(f32) for s in slabs))
  for s, b_s in zip(slabs, b_h):
    ht_ref[i_n, s, :] = b_s

  first = cu_ref[N] // BT + i_r             # this program's tail chunks: first, first + N, ...

  def zero(i, carry):
    c = first + i * N
    h_ref[c] = jnp.zeros((K, BV), f32)
    v_new_ref[pl.ds(pl.multiple_of(c * BT, BT), BT), :] = jnp.zeros((BT, BV), f32)
    return carry

  lax.fori_loop(0, jnp.maximum(NTa - first + N - 1, 0) // N, zero, 0)


def apply(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, interpret=False,
          config=None):
  config = config or Config()
  BT = chunk_size
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  N = aligned_cu.shape[0] - 1
  NTa = Ta // BT
  f32 = jnp.float32
  if N == 0:                                 # no program to launch; every chunk is tail
    return Out(jnp.zeros((1, NTa, HV, K, V), f32), jnp.zeros((1, Ta, HV, V), f32),
               jnp.zeros((0, HV, K, V), f32))
  Kp, Vp = max(_pallas.next_pow2(K), 16), max(_pallas.next_pow2(V), 16)
  BV = min(config.block_v, Vp)
  kg, w, gi, gf = (_pallas.pad_dim(x, 3, Kp) for x in (kg, w, gc_int.astype(f32), gc_frac.astype(f32)))
  u = _pallas.pad_dim(u, 3, Vp)
  h0 = _pallas.pad_dim(_pallas.pad_dim(initial_state.astype(f32), 2, Kp), 3, Vp)
  aligned_cu = aligned_cu.astype(jnp.int32)
  if config.longest_first:
    order = jnp.argsort(aligned_cu[:-1] - aligned_cu[1:], stable=True).astype(jnp.int32)
  else:
    order = jnp.arange(N, dtype=jnp.int32)

  # Inputs are read in place in the [1, Ta, HV, D] layout: a full-length block per head is a strided
  # [Ta, D] view that the loop slices with pl.ds, so the wrapper transposes nothing.
  seqs = lambda n: pl.BlockSpec((n,), lambda j, h, r: (0,))
  keys = pl.BlockSpec((None, Ta, None, Kp), lambda j, h, r: (0, 0, h, 0))
  vals = pl.BlockSpec((None, Ta, None, BV), lambda j, h, r: (0, 0, h, j))
  states = pl.BlockSpec((N, None, Kp, BV), lambda j, h, r: (0, h, 0, j))
  kernel = functools.partial(_kernel, chunk_size=BT, slab=min(Kp, config.block_k),
                             precision=_pallas.dot_precision(config.precision, interpret))
  ins = (order, aligned_cu, kg, w, u, gi, gf, h0)
  h, v_new, ht = pl.pallas_call(
      kernel, grid=(Vp // BV, HV, N),
      in_specs=[seqs(N), seqs(N + 1), keys, keys, vals, keys, keys, states],
      out_specs=[pl.BlockSpec((None, NTa, None, Kp, BV), lambda j, h, r: (0, 0, h, 0, j)), vals, states],
      out_shape=[out_struct((1, NTa, HV, Kp, Vp), f32, ins), out_struct((1, Ta, HV, Vp), f32, ins),
                 out_struct((N, HV, Kp, Vp), f32, ins)],
      compiler_params=None if interpret else _pallas.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret, name=f"kda_{NAME}")(*ins)
  if (Kp, Vp) != (K, V):
    h, v_new, ht = h[..., :K, :V], v_new[..., :V], ht[..., :K, :V]
  return Out(h, v_new, ht)
