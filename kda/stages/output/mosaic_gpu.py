"""output: the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.output.

Kernel: every chunk is independent (h already carries the state), so one program takes
`chunks_per_program` consecutive chunks of one value head and one V tile of BV columns; with more
than one, the next chunk's tiles are in flight while it computes the current one (two SMEM slots,
one barrier per slot, TMA). Per chunk c:

    TMA:  qg_c [64, K], h[c] [K, BV], Aqk_c [64, 64], v_new_c [64, BV]        bf16, swizzled SMEM
    o_c = scale * qg_c @ h[c] + Aqk_c @ v_new_c      two wgmmas into two f32 accumulators
                                                     (issued together, read once; scale is not a
                                                     power of two, so it cannot ride on a bf16 operand)
    o_c   -> SMEM stage -> TMA store (Config.stage_store), or registers -> GMEM

What is bf16: qg, h, Aqk, v_new (cast in the launcher when they come in float32: one XLA pass each;
the predicate `supports` only accepts bf16 ones). Accumulation is float32. o is float32, or
bf16 with Config(out_dtype="bfloat16"): the pipeline rounds o to v's dtype after unalign, and this
kernel only runs for bf16 intermediates, i.e. bf16 inputs, so a bf16 o is the same bits there and
halves the store and the unalign's read.

Grid: (G, HV, V // BV) with names ("g", "h", "v"), G = ceil(NTa / chunks_per_program): the V tiles
and heads of one chunk group are dispatched next to each other (CUDA x fastest), so the second V
tile's reads of qg and Aqk find them in L2. CUDA caps grid z at 65535; past that G moves to x.
The tail (chunks past aligned_cu[-1]) needs no special case: qg = Aqk = 0 and h = v_new = 0 there
(align and the state stage make them so), so o = 0.

SMEM per program (bytes, BT = 64; `scratch`, `smem_bytes`), S slots (1 if a program takes one
chunk, else 2):
    qg [64, K] + h [K, BV] + Aqk [64, 64] + v_new [64, BV], bf16     S x (128 K + 2 K BV + 8192 + 128 BV)
    o stage [64, BV] (f32 or bf16)                                   256 BV or 128 BV
    barriers                                                         8 S
  K = 128, BV = 64, f32 o: 65544 (S = 1), 114704 (S = 2); BV = 128: 106504, 180240.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32, MAX_GRID_YZ, bf16_reason, smem_bytes as _smem_bytes, smem_reason, tile_shapes
from kda._mosaic_gpu import params as _params
from kda._mosaic_gpu import swz as _swz
from kda.stages.output import Out

BT = 64
OUT_DTYPES = {"float32": F32, "bfloat16": BF16}


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles and variants of the output kernel; they depend on K, V, BT and dtype only."""
  block_v: int = 64              # BV: output columns per program (64 or 128, at most V)
  chunks_per_program: int = 4    # consecutive chunks per program; > 1 double-buffers the loads
  out_dtype: str = "float32"     # o as stored: "float32" or "bfloat16"
  stage_store: bool = True       # o through SMEM + TMA (else registers -> GMEM stores)
  lane_semantics: bool = False   # Mosaic GPU LoweringSemantics.Lane (kda._mosaic_gpu.params) instead of Warpgroup

  def __post_init__(self):
    if self.block_v not in (64, 128):
      raise ValueError(f"block_v must be 64 or 128 (wgmma N tiles), got {self.block_v}")
    if self.chunks_per_program < 1:
      raise ValueError(f"chunks_per_program must be >= 1, got {self.chunks_per_program}")
    if self.out_dtype not in OUT_DTYPES:
      raise ValueError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {self.out_dtype!r}")


def _slots(config, NTa):
  """Input slots per program: two (the next chunk's loads in flight) where a program takes more than
  one chunk."""
  return 1 if min(config.chunks_per_program, NTa) == 1 else 2


def scratch(K, config, slots):
  """The kernel's scratch_types: qg [64, K], h[c] [K, BV], Aqk [64, 64], v_new [64, BV] (bf16,
  swizzled, `slots` each), the o stage [64, BV] (an 8-row placeholder without stage_store), the
  slots' barriers."""
  BV, odt = config.block_v, OUT_DTYPES[config.out_dtype]
  if config.stage_store:
    o_stage = _swz((BT, BV), BF16) if odt == BF16 else plgpu.SMEM((BT, BV), F32)
  else:
    o_stage = plgpu.SMEM((8, BV), odt)                     # unused placeholder
  return [
      _swz((slots, BT, K)), _swz((slots, K, BV)),          # qg, h[c]
      _swz((slots, BT, BT)), _swz((slots, BT, BV)),        # Aqk, v_new
      o_stage,
      plgpu.Barrier(num_arrivals=4, num_barriers=slots),
  ]


def smem_bytes(K, config=None, slots=2):
  """The SMEM the kernel asks for (as lowered for CUDA)."""
  return _smem_bytes(scratch(K, config or Config(), slots))


def _kernel_reason(qg, h, Aqk, v_new, *, chunk_size, config) -> Optional[str]:
  reason, dims = tile_shapes(chunk_size, "qg", qg, "v_new", v_new)
  if reason is not None:
    return reason
  Ta, HV, K, V = dims
  if config.block_v > V:
    return f"block_v {config.block_v} exceeds V {V}"
  if Ta % chunk_size:
    return f"Ta must be a multiple of chunk_size {chunk_size}, got {Ta}"
  NTa = Ta // chunk_size
  if h.shape != (1, NTa, HV, K, V):
    return f"h must have shape {(1, NTa, HV, K, V)}, got {h.shape}"
  if Aqk.shape != (1, Ta, HV, chunk_size):
    return f"Aqk must have shape {(1, Ta, HV, chunk_size)}, got {Aqk.shape}"
  for name, x in (("qg", qg), ("h", h), ("Aqk", Aqk), ("v_new", v_new)):
    if jnp.dtype(x.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
      return f"{name} must be bfloat16 or float32, got {jnp.dtype(x.dtype).name}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid y limit), got {HV}"
  return smem_reason(smem_bytes(K, config, _slots(config, NTa)))


def supports(qg, h, Aqk, v_new, *, scale=None, chunk_size, config=None, **_) -> Optional[str]:
  """The stage's predicate: None if `apply` takes this call, else the reason in words; bf16 qg, h,
  Aqk, v_new only (the dtype policy's bf16 intermediates)."""
  reason = _kernel_reason(qg, h, Aqk, v_new, chunk_size=chunk_size, config=config or Config())
  return reason or bf16_reason("output", qg=qg, h=h, Aqk=Aqk, v_new=v_new)


takes = supports       # the name kda.stages.output registers the predicate by


def _body(qg_g, h_g, A_g, vn_g, o_g, qg_s, h_s, A_s, vn_s, o_s, bars, *, BT, BV, per, scale,
          stage_store):
  # GMEM: qg [Ta, HV, K], h [NTa, HV, K, V], Aqk [Ta, HV, BT], v_new [Ta, HV, V] bf16; o [Ta, HV, V].
  NTa = h_g.shape[0]
  slots = qg_s.shape[0]
  g, i_h, i_v = lax.axis_index("g"), lax.axis_index("h"), lax.axis_index("v")
  c0 = g * per
  n = jnp.minimum(per, NTa - c0)
  cols = pl.ds(i_v * BV, BV)

  def fetch(i, slot):
    c = c0 + i
    rows, bar = pl.ds(pl.multiple_of(c * BT, BT), BT), bars.at[slot]
    plgpu.copy_gmem_to_smem(qg_g.at[rows, i_h, :], qg_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(h_g.at[c, i_h, :, cols], h_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(A_g.at[rows, i_h, :], A_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(vn_g.at[rows, i_h, cols], vn_s.at[slot], bar)

  def step(i, carry):
    slot = lax.rem(i, slots) if slots > 1 else 0
    if slots > 1:
      @pl.when(i + 1 < n)
      def _():
        fetch(i + 1, 1 - slot)   # that slot's readers, step i-1's wgmmas, have completed
    plgpu.barrier_wait(bars.at[slot])

    def scoped(acc_q, acc_a):
      plgpu.wgmma(acc_q, qg_s.at[slot], h_s.at[slot])
      plgpu.wgmma(acc_a, A_s.at[slot], vn_s.at[slot])
      return scale * acc_q[...] + acc_a[...]

    o = pl.run_scoped(scoped, plgpu.ACC((BT, BV), F32), plgpu.ACC((BT, BV), F32))
    rows = pl.ds(pl.multiple_of((c0 + i) * BT, BT), BT)
    if stage_store:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous chunk's store has read o_s
      o_s[...] = o.astype(o_s.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_g.at[rows, i_h, cols])
    else:
      o_g[rows, i_h, cols] = o.astype(o_g.dtype)
    plgpu.wgmma_wait(0)          # no wgmma may stay in flight across the loop's back-edge
    return carry

  fetch(0, 0)
  if per == 1:
    step(0, 0)
  else:
    lax.fori_loop(0, n, step, 0)
  plgpu.wait_smem_to_gmem(0)     # every TMA store has landed before the program exits


def apply(qg, h, Aqk, v_new, *, scale, chunk_size, interpret=False, config=None):
  """float32 inputs are rounded to bf16 (`supports` refuses them; tests and tools call this)."""
  config = config or Config()
  reason = _kernel_reason(qg, h, Aqk, v_new, chunk_size=chunk_size, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_gpu output kernel: {reason}")
  BV = config.block_v
  _, Ta, HV, K = qg.shape
  V = v_new.shape[-1]
  NTa = Ta // BT
  odt = OUT_DTYPES[config.out_dtype]
  if NTa == 0:
    return Out(jnp.zeros((1, 0, HV, V), odt))
  per = min(config.chunks_per_program, NTa)
  G = -(-NTa // per)
  slots = _slots(config, NTa)
  qg, Aqk, v_new = (x[0].astype(BF16) for x in (qg, Aqk, v_new))
  h = h[0].astype(BF16)
  if G <= MAX_GRID_YZ:
    grid, names = (G, HV, V // BV), ("g", "h", "v")
  else:
    grid, names = (V // BV, HV, G), ("v", "h", "g")
  body = lambda *refs: _body(*refs, BT=BT, BV=BV, per=per, scale=float(scale),
                             stage_store=config.stage_store)
  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((Ta, HV, V), odt),
      grid=grid, grid_names=names,
      scratch_types=scratch(K, config, slots),
      compiler_params=_params(config.lane_semantics),
      kernel_name="kda_output", interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return Out(f(qg, h, Aqk, v_new)[None])
