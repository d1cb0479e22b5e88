"""output: the Pallas kernel, Triton lowering (any CUDA GPU); the math is in kda.stages.output.

Kernel: grid (V tiles, HV, NTa), one program per (V tile, head, chunk); every chunk is independent
(h already carries the state), so the tail after aligned_cu[-1] needs no special case: its inputs
are zeros and it writes zeros.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kda import _pallas
from kda._vma import out_struct
from kda.stages.output import NAME, Out


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles of the output kernel; they depend on K, V, BT and dtype only, never on T or cu_seqlens."""
  block_v: int = 64           # BV: output columns per program (capped at V rounded up to a power of 2)
  block_k: int = 128          # rows of h per dot: K = 256 runs as two slabs in the shared memory K = 128 needs
  # o is the result: keep ~float32 accuracy. Three TF32 passes give ~6e-7 relative on the tensor
  # cores; IEEE float32 dots run on the FMA units, about 20x slower.
  precision: str = "tf32x3"
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _pallas.check_config(self)


def _kernel(qg_ref, h_ref, Aqk_ref, v_new_ref, o_ref, *, scale, precision, slab):
  # refs: qg [BT, K], h [K, BV], Aqk [BT, BT], v_new and o [BT, BV] (one chunk, head, V tile); the
  # K contraction runs in slabs of `slab` rows, so each dot's tiles stay [BT, slab] x [slab, BV]
  f32 = jnp.float32
  BT = Aqk_ref.shape[0]
  m_causal = lax.broadcasted_iota(jnp.int32, (BT, BT), 0) >= lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
  b_A = jnp.where(m_causal, Aqk_ref[...].astype(f32), 0.0)      # the producer masks it too
  K = qg_ref.shape[1]
  b_o = jnp.zeros(o_ref.shape, f32)
  for j in range(K // slab):
    s = pl.ds(j * slab, slab)
    b_o = b_o + jnp.dot(qg_ref[:, s].astype(f32), h_ref[s, :].astype(f32), precision=precision,
                        preferred_element_type=f32)
  b_o = scale * b_o + jnp.dot(b_A, v_new_ref[...].astype(f32), precision=precision,
                              preferred_element_type=f32)
  o_ref[...] = b_o


def apply(qg, h, Aqk, v_new, *, scale, chunk_size, interpret=False, config=None):
  config = config or Config()
  BT = chunk_size
  _, Ta, HV, K = qg.shape
  V = v_new.shape[-1]
  NTa = Ta // BT
  Kp, Vp = max(_pallas.next_pow2(K), 16), max(_pallas.next_pow2(V), 16)
  BV = min(config.block_v, Vp)
  qg = _pallas.pad_dim(qg, 3, Kp)
  h = _pallas.pad_dim(_pallas.pad_dim(h, 3, Kp), 4, Vp)
  v_new = _pallas.pad_dim(v_new, 3, Vp)
  kernel = functools.partial(_kernel, scale=float(scale), slab=min(Kp, config.block_k),
                             precision=_pallas.dot_precision(config.precision, interpret))
  vals = pl.BlockSpec((None, BT, None, BV), lambda j, i_h, c: (0, c, i_h, j))
  o = pl.pallas_call(
      kernel, grid=(Vp // BV, HV, NTa),
      in_specs=[pl.BlockSpec((None, BT, None, Kp), lambda j, i_h, c: (0, c, i_h, 0)),
                pl.BlockSpec((None, None, None, Kp, BV), lambda j, i_h, c: (0, c, i_h, 0, j)),
                pl.BlockSpec((None, BT, None, BT), lambda j, i_h, c: (0, c, i_h, 0)),
                vals],
      out_specs=vals,
      out_shape=out_struct((1, Ta, HV, Vp), jnp.float32, qg, h, Aqk, v_new),
      compiler_params=None if interpret else _pallas.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret, name=f"kda_{NAME}")(qg, h, Aqk, v_new)
  return Out(o[..., :V] if Vp != V else o)
