"""What the Mosaic TPU kernels (`jax.experimental.pallas.tpu`) share: the generation table, the VMEM
budget, the head-first layout with lane padding, dots by dtype, the chunk table, interpret params.

Layout. A stage array [1, Ta, HV, D] does not lower as (None, BT, None, D) blocks (TPU.md, section 5);
the kernels read head-first arrays [HV, Ta, Dp], blocks (MB, BT, Dp) of MB heads, with D zero-padded
to Dp = a multiple of 128 lanes (K, V = 64 would otherwise leave half of every vreg idle) and cut off
after. Per-token scalars (beta, the valid mask) travel as a column [HV, Ta, 1]. States are carried
TRANSPOSED, S^T [V, K] (kernel arrays [N, HV, Vp, Kp] and [HV, NTa, Vp, Kp]): the per-channel decay
exp(gc_last) [K] then scales S^T's columns, a [1, Kp] row that broadcasts over sublanes, where S [K, V]
would need it as a [Kp, 1] column (a transpose in the kernel). The launchers' transposes back to the
stage layout swap the two axes in the same pass.

Dots. f32 operands at HIGHEST (`contract_precision<fp32>`); bf16 operands at DEFAULT (one MXU pass:
HIGHEST with bf16 operands does not compile, "Bad lhs type"); f32 accumulation always.

VMEM. Every pipelined block is double-buffered; a kernel needs 2 x blocks + scratch + the values its
body keeps live (`temps`), each buffer tiled (sublanes 8 for 32-bit, 16 for 16-bit; lanes 128). A
kernel refuses a call whose need exceeds 0.9 x VMEM and otherwise asks for
vmem_limit_bytes = min(0.9 x VMEM, max(default scoped limit, 1.25 x need)). intra's `temps` (the
largest) are fitted to what Mosaic allocates (tools.tpu_aot --min-vmem), the other kernels' budgets
exceed it, so the 1.25 is a margin; default tiles (heads per program, `default_heads`) fill at most
half the usable VMEM.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda._vma import out_struct
from kda.padding import chunk_table

F32 = jnp.float32
BF16 = jnp.bfloat16
HI = lax.Precision.HIGHEST
LANES = 128
SUB = 16            # rows of intra's sub-blocks (bf16 sublane tiling on v7x)
MiB = 1 << 20
VMEM_FRACTION = 0.9

NN = (((2,), (1,)), ((0,), (0,)))   # batched [MB, m, k] @ [MB, k, n]
NT = (((2,), (2,)), ((0,), (0,)))   # batched a @ b^T
TN = (((1,), (1,)), ((0,), (0,)))   # batched a^T @ b


@dataclasses.dataclass(frozen=True)
class Generation:
  """Per-TensorCore memory of a TPU generation (jax's tpu_info; scoped limits from compile errors)."""
  name: str
  generation: int
  vmem_bytes: int          # physical VMEM
  scoped_vmem_bytes: int   # Mosaic's default vmem_limit_bytes

  def sublanes(self, dtype) -> int:
    """Sublane tiling of a VMEM buffer: 8 rows of 32-bit, 16 of 16-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)

  @property
  def vmem_cap(self) -> int:
    return int(VMEM_FRACTION * self.vmem_bytes)


GENERATIONS = {
    "v5e": Generation("v5e", 5, 128 * MiB, 16 * MiB),
    "v6e": Generation("v6e", 6, 128 * MiB, 32 * MiB),
    "v7x": Generation("v7x", 7, 64 * MiB, 32 * MiB),
}
# Off a TPU (interpret mode, tests): the smallest VMEM, so default tiles fit every generation
DEFAULT_GENERATION = "v7x"


def generation(name: Optional[str] = None) -> Generation:
  """The table row `name`, else the TPU being traced for (pltpu.get_tpu_info(): a TPU host, or an
  abstract mesh of TPU devices as an AOT compile has), else DEFAULT_GENERATION."""
  if name is not None:
    if name not in GENERATIONS:
      raise ValueError(f"generation must be one of {sorted(GENERATIONS)}, got {name!r}")
    return GENERATIONS[name]
  try:
    info = pltpu.get_tpu_info()
  except (ValueError, RuntimeError, NotImplementedError):
    return GENERATIONS[DEFAULT_GENERATION]
  chip = str(info.chip_version)
  chip = chip if chip.startswith("v") else f"v{chip}"
  if chip in GENERATIONS and GENERATIONS[chip].vmem_bytes == info.vmem_capacity_bytes:
    return GENERATIONS[chip]
  return Generation(chip, info.generation, info.vmem_capacity_bytes, (16 if info.generation < 6 else 32) * MiB)


# ---------------------------------------------------------------------------------------------------
# VMEM budget

def buffer_bytes(shape: Sequence[Optional[int]], dtype, gen: Generation) -> int:
  """Bytes of one VMEM buffer of `shape` (None: a squeezed dim), tiled (sublanes, 128 lanes)."""
  dims = [1 if d is None else int(d) for d in shape]
  if len(dims) == 1:
    dims = [1] + dims
  *lead, rows, cols = dims
  rows = -(-rows // gen.sublanes(dtype)) * gen.sublanes(dtype)
  cols = -(-cols // LANES) * LANES
  return math.prod(lead) * rows * cols * jnp.dtype(dtype).itemsize


class Budget(NamedTuple):
  need: int    # 2 x blocks + scratch + temps, bytes
  limit: int   # vmem_limit_bytes to ask for


def budget(blocks, scratch, temps, gen: Generation) -> Budget:
  """blocks, scratch, temps: (shape, dtype) pairs -> the kernel's VMEM need and the limit to set."""
  size = lambda items: sum(buffer_bytes(s, d, gen) for s, d in items)
  need = 2 * size(blocks) + size(scratch) + size(temps)
  return Budget(need, min(gen.vmem_cap, max(gen.scoped_vmem_bytes, need + need // 4)))


def budget_reason(kernel: str, b: Budget, gen: Generation) -> Optional[str]:
  if b.need > gen.vmem_cap:
    return (f"mosaic_tpu {kernel} needs {b.need / MiB:.1f} MiB of VMEM for its tiles, over "
            f"{VMEM_FRACTION} x the {gen.vmem_bytes / MiB:.0f} MiB of {gen.name}")
  return None


def default_heads(tiles_of, gen: Generation, most: int = 8) -> int:
  """The largest MB in (most, most/2, ..., 1) whose tiles (tiles_of(MB): blocks, scratch, temps)
  need at most half the usable VMEM (VMEM_FRACTION x VMEM / 2: 57.6 MiB on v5e / v6e, 28.8 MiB on
  v7x), leaving the other half to what XLA keeps in VMEM around the kernel. MB <= 8: a grid step
  costs ~0.35 us (Pallas TPU docs), which 8 heads of a chunk's work already amortise."""
  mb = most
  while mb > 1 and budget(*tiles_of(mb), gen).need > gen.vmem_cap // 2:
    mb //= 2
  return mb


def heads_per_program(HV: int, MB: int) -> int:
  """The largest divisor of HV that is <= MB (MB heads per program must tile HV)."""
  return max(d for d in range(1, min(HV, MB) + 1) if HV % d == 0)


def compiler_params(semantics: Sequence[str], b: Budget, vmem_limit: Optional[int] = None):
  """dimension_semantics and vmem_limit_bytes (the budget's limit unless a Config overrides it)."""
  return pltpu.CompilerParams(dimension_semantics=tuple(semantics),
                              vmem_limit_bytes=int(b.limit if vmem_limit is None else vmem_limit))


def check_config(cfg):
  """The fields every TPU kernel Config has: heads (MB) and vmem_limit."""
  if not isinstance(cfg.heads, int) or cfg.heads < 1:
    raise ValueError(f"heads must be an int >= 1, got {cfg.heads!r}")
  if cfg.vmem_limit is not None and (not isinstance(cfg.vmem_limit, int) or cfg.vmem_limit < MiB):
    raise ValueError(f"vmem_limit must be None or an int >= 1 MiB (bytes), got {cfg.vmem_limit!r}")


def interpret_params(interpret):
  """interpret=True -> the TPU interpreter (pltpu.InterpretParams()); InterpretParams pass through."""
  if interpret is True:
    return pltpu.InterpretParams()
  return interpret or False


def cost(flops: int, transcendentals: int, bytes_accessed: int) -> pl.CostEstimate:
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))


def nbytes(*arrays) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays if x is not None)


# ---------------------------------------------------------------------------------------------------
# Layout

def lanes(d: int) -> int:
  """d rounded up to a multiple of 128 lanes."""
  return -(-int(d) // LANES) * LANES


def _pad_last(x, size: int):
  extra = size - x.shape[-1]
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def to_heads(x, dtype=None):
  """[1, Ta, HV, D] -> [HV, Ta, Dp] (lanes zero-padded)."""
  x = x[0] if dtype is None else x[0].astype(dtype)
  return _pad_last(jnp.swapaxes(x, 0, 1), lanes(x.shape[-1]))


def from_heads(x, D: int):
  """[HV, Ta, Dp] -> [1, Ta, HV, D]."""
  return jnp.swapaxes(x[..., :D], 0, 1)[None]


def column_to_heads(x):
  """Per-token scalars [1, Ta, HV] -> [HV, Ta, 1] float32."""
  return jnp.swapaxes(x[0].astype(F32), 0, 1)[..., None]


def square_to_heads(x):
  """[1, Ta, HV, BT] (chunk rows) -> [HV, Ta, BT]; BT is a full block dim, so it is not padded."""
  return jnp.swapaxes(x[0], 0, 1)


def states_to_heads(S, dtype=F32):
  """[..., K, V] -> [..., Vp, Kp] transposed and padded (S^T, the kernels' state layout)."""
  St = jnp.swapaxes(S.astype(dtype), -1, -2)
  Vp, Kp = lanes(St.shape[-2]), lanes(St.shape[-1])
  St = _pad_last(St, Kp)
  extra = Vp - St.shape[-2]
  return St if extra == 0 else jnp.pad(St, [(0, 0)] * (St.ndim - 2) + [(0, extra), (0, 0)])


def states_from_heads(St, K: int, V: int):
  """[..., Vp, Kp] -> [..., K, V]."""
  return jnp.swapaxes(St[..., :V, :K], -1, -2)


def h_to_heads(h, dtype=None):
  """Per-chunk states [1, NTa, HV, K, V] -> [HV, NTa, Vp, Kp]."""
  return jnp.swapaxes(states_to_heads(h[0], h.dtype if dtype is None else dtype), 0, 1)


def h_from_heads(h, K: int, V: int):
  """[HV, NTa, Vp, Kp] -> [1, NTa, HV, K, V]."""
  return jnp.swapaxes(states_from_heads(h, K, V), 0, 1)[None]


def decay_to_heads(decay):
  """chunk_decay's [NTa, HV, K] -> [HV, NTa, 1, Kp] (a (1, Kp) block per chunk; padded lanes 0)."""
  return _pad_last(jnp.transpose(decay.astype(F32), (1, 0, 2)), lanes(decay.shape[-1]))[:, :, None, :]


def struct(shape, dtype, *inputs):
  return out_struct(tuple(shape), jnp.dtype(dtype), *inputs)


# ---------------------------------------------------------------------------------------------------
# Kernel helpers

def dot(a, b, dims):
  """dot_general with f32 accumulation: HIGHEST for f32 operands, one bf16 pass for bf16 ones."""
  precision = HI if a.dtype == F32 and b.dtype == F32 else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def matmul_dtype(*dtypes):
  """The dtype dot operands are cast to: bf16 where the stage's inputs are bf16, else f32."""
  return BF16 if any(jnp.dtype(d) == jnp.dtype(BF16) for d in dtypes) else F32


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def tril(BT: int):
  """[BT, BT] float32 lower-triangular ones (with the diagonal): tril @ x is the inclusive cumsum."""
  return (iota((BT, BT), 0) >= iota((BT, BT), 1)).astype(F32)


def float_reason(name, x, allowed=(F32, BF16)) -> Optional[str]:
  if jnp.dtype(x.dtype) not in tuple(jnp.dtype(d) for d in allowed):
    return f"{name} must be {' or '.join(jnp.dtype(d).name for d in allowed)}, got {jnp.dtype(x.dtype).name}"
  return None


def chunk_reason(chunk_size: int, Ta: int) -> Optional[str]:
  if chunk_size % SUB or chunk_size < SUB:
    return f"chunk_size must be a multiple of {SUB} (intra's sub-blocks, bf16 sublanes), got {chunk_size}"
  if Ta % chunk_size:
    return f"Ta must be a multiple of chunk_size {chunk_size}, got {Ta}"
  return None


# chunk flags (scalar-prefetched, SMEM): a sequence's first chunk, its last, a chunk of no sequence
FIRST, LAST, TAIL = 1, 2, 4


def chunk_flags(aligned_cu, NTa: int, chunk_size: int):
  """-> (blk [NTa] int32, flags [NTa] int32). blk: the sequence whose initial / final state block a
  chunk maps to (the tail's chunks map to the last sequence, so each state block is visited on
  consecutive grid steps only); flags: FIRST | LAST | TAIL bits."""
  t = chunk_table(aligned_cu.astype(jnp.int32), NTa, chunk_size)
  N = aligned_cu.shape[0] - 1
  tail = t.seq < 0
  blk = jnp.where(tail, N - 1, t.seq).astype(jnp.int32)
  flags = (t.first.astype(jnp.int32) * FIRST + t.last.astype(jnp.int32) * LAST
           + tail.astype(jnp.int32) * TAIL)
  return blk, flags.astype(jnp.int32)


def empty_sequences(aligned_cu):
  """[N] bool: sequences that own no chunk (their final state is their initial state)."""
  return aligned_cu[1:] == aligned_cu[:-1]
