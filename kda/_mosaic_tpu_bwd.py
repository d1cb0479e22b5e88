"""What the Mosaic TPU (pallas.tpu) backward kernels share: layouts, VMEM accounting, dots, tables.

Layout. The stages' arrays are token-major [1, Ta, HV, D]; a TPU block must keep D on the 128 lanes
and tokens on the sublanes, which the heads in between forbid (kda's (None, BT, None, D) blocks do
not lower). The launchers transpose to head-first [HV, Ta, D] and back (per-chunk rows and per-token
scalars to head groups, `rows_in`); kernels take MB heads per program as (MB, BT, D) blocks and loop
over them with a fori_loop, so the live values are one head's.

VMEM. Every pipelined block is double-buffered; `block_bytes` pads a block's last two dims to the
dtype's (sublane, 128-lane) tile. A kernel's need is 2 * blocks + scratch + an allowance for one
head's intermediates; `heads_per_program` takes the largest divisor of HV whose need fits the
budget (0.9 x VMEM per TensorCore, `vmem_capacity`), and the kernels ask for that need as
`vmem_limit_bytes`.

Precision (the dtype policy). `mm(a, b, dims, low)`: with low (bf16 inputs) the operands are rounded
to bf16 here and multiplied at DEFAULT (one MXU pass, float32 accumulation), so the TPU interpreter,
which computes float32 dots exactly, sees the same operands the MXU does; otherwise float32 at
HIGHEST. Cumulative sums are dots with triangular 0/1 matrices at HIGHEST in both modes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32, BF16 = jnp.float32, jnp.bfloat16
HI = lax.Precision.HIGHEST
NN = (((1,), (0,)), ((), ()))   # a @ b
NT = (((1,), (1,)), ((), ()))   # a @ b^T
TN = (((0,), (0,)), ((), ()))   # a^T @ b
DEFAULT_VMEM = 64 << 20         # off a TPU (interpret mode, tests): v7x's, the smallest per core
BUDGET = 0.9                    # of VMEM per TensorCore, for blocks + scratch + intermediates
LANES = 128


def vmem_capacity() -> int:
  """VMEM bytes per TensorCore of the TPU being compiled for (the abstract mesh's device under an
  AOT compile), DEFAULT_VMEM when tracing for no TPU."""
  try:
    return int(pltpu.get_tpu_info().vmem_capacity_bytes)
  except Exception:  # noqa: BLE001  not a TPU (CPU interpret mode): no generation to ask
    return DEFAULT_VMEM


def interpret_params(interpret):
  """apply's `interpret` -> pallas_call's: True means the TPU interpreter (pltpu.InterpretParams()),
  which checks what the generic one does not (out-of-bounds reads, unwritten scratch, revisits)."""
  if interpret is True:
    return pltpu.InterpretParams()
  return interpret or False


def sublanes(dtype) -> int:
  return 8 * 4 // jnp.dtype(dtype).itemsize        # (8, 128) f32 tiles, (16, 128) bf16


def block_bytes(shape, dtype) -> int:
  """VMEM bytes of one buffer of a block (None dims count as 1), last two dims tile-padded."""
  shape = [1 if d is None else d for d in shape]
  shape = [1] * max(0, 2 - len(shape)) + shape
  lead = 1
  for d in shape[:-2]:
    lead *= d
  s = -(-shape[-2] // sublanes(dtype)) * sublanes(dtype)
  lanes = -(-shape[-1] // LANES) * LANES
  return lead * s * lanes * jnp.dtype(dtype).itemsize


def heads_per_program(HV: int, per_head: int, fixed: int, budget: int, cap: int = 16) -> int:
  """The largest divisor MB of HV (<= cap) with fixed + MB * per_head <= budget; 0 if none fits."""
  best = 0
  for mb in range(1, min(HV, cap) + 1):
    if HV % mb == 0 and fixed + mb * per_head <= budget:
      best = mb
  return best


def vmem_limit(need: int) -> int:
  """vmem_limit_bytes for a kernel needing `need` bytes: the need plus a quarter and 4 MiB for
  Mosaic's internal scratch, within the budget."""
  return int(min(BUDGET * vmem_capacity(), need * 5 // 4 + (4 << 20)))


def compiler_params(semantics, need):
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit(need))


def mm(a, b, dims, low):
  """dot_general(a, b) with float32 accumulation: bf16 operands at DEFAULT if `low`, else float32 at
  HIGHEST (module docstring)."""
  if low:
    a, b, prec = a.astype(BF16), b.astype(BF16), lax.Precision.DEFAULT
  else:
    a, b, prec = a.astype(F32), b.astype(F32), HI
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


def tri(n, pred):
  """[n, n] float32 0/1 matrix with ones where pred(row, col)."""
  r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  c = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return jnp.where(pred(r, c), 1.0, 0.0).astype(F32)


def exact(a, b, dims):
  """A float32 dot at HIGHEST (cumulative sums and other exact 0/1 products)."""
  return lax.dot_general(a.astype(F32), b.astype(F32), dims, precision=HI,
                         preferred_element_type=F32)


# ---- layouts -------------------------------------------------------------------------------------

def head_first(x):
  """[1, Ta, HV, D] -> [HV, Ta, D]."""
  return jnp.transpose(x[0], (1, 0, 2))


def token_major(x):
  """[HV, Ta, D] -> [1, Ta, HV, D]."""
  return jnp.transpose(x, (1, 0, 2))[None]


# Per-chunk rows ([1, NTa, HV, D]) and per-token scalars ([1, Ta, HV]) go in groups of MB heads,
# [HV / MB, NTa, MB, D] and [HV / MB, NTa, MB, BT], read as (None, None, MB, D) blocks: the last
# two dims are the array's, so any MB lowers, and HBM pads (MB, D) to (8, 128) tiles only (a
# [HV, Ta, 1] layout would pad every scalar to 128 lanes). Kernels read head m's row with
# ref[pl.ds(m, 1), :] and turn rows into columns with `to_col`.

def rows_in(x, MB):
  """[1, NTa, HV, D] -> [HV / MB, NTa, MB, D]."""
  _, NTa, HV, D = x.shape
  return jnp.transpose(x[0].reshape(NTa, HV // MB, MB, D), (1, 0, 2, 3))


def rows_out(y):
  """[HV / MB, NTa, MB, D] -> [1, NTa, HV, D]."""
  G, NTa, MB, D = y.shape
  return jnp.transpose(y, (1, 0, 2, 3)).reshape(1, NTa, G * MB, D)


def scalars_in(x, MB, BT):
  """[1, Ta, HV] -> [HV / MB, NTa, MB, BT]."""
  _, Ta, HV = x.shape
  return jnp.transpose(x[0].reshape(Ta // BT, BT, HV // MB, MB), (2, 0, 3, 1))


def scalars_out(y):
  """[HV / MB, NTa, MB, BT] -> [1, Ta, HV]."""
  G, NTa, MB, BT = y.shape
  return jnp.transpose(y, (1, 3, 0, 2)).reshape(1, NTa * BT, G * MB)


def group_block(MB, D, chunk=None):
  """The (None, None, MB, D) block of a grouped array, for grids (head group, chunk, *prefetch)."""
  chunk = chunk or (lambda c, *_: c)
  return pl.BlockSpec((None, None, MB, D), lambda h, c, *s: (h, chunk(c, *s), 0, 0))


def head_row(ref, m):
  """Head m's [1, D] row of a (MB, D) grouped block."""
  return ref[pl.ds(m, 1), :]


def to_col(row):
  """[1, n] -> [n, 1], exactly (a diagonal select and a lane reduction: no transpose)."""
  n = row.shape[-1]
  eye = tri(n, lambda r, c: r == c) > 0
  return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def to_row(col):
  """[n, 1] -> [1, n], exactly (a diagonal select and a sublane reduction)."""
  n = col.shape[0]
  eye = tri(n, lambda r, c: r == c) > 0
  return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def token_block(MB, BT, D, chunk=None):
  """The (MB, BT, D) block of a head-first [HV, Ta, D] array (chunk(c, *prefetch) maps the grid's
  chunk index, e.g. reversed), for grids (head group, chunk, *prefetch)."""
  chunk = chunk or (lambda c, *_: c)
  return pl.BlockSpec((MB, BT, D), lambda h, c, *s: (h, chunk(c, *s), 0))


def head_loop(MB, body):
  """body(m) for the MB heads of the program, m traced: one head's values live at a time."""
  if MB == 1:
    body(0)
    return
  def step(m, carry):
    body(m)
    return carry
  lax.fori_loop(0, MB, step, 0)


# ---- varlen tables (scalar prefetch, SMEM) --------------------------------------------------------

FIRST, LAST, OWNED = 1, 2, 4


def chunk_flags(aligned_cu, NTa, chunk_size):
  """(seq [NTa] int32, flags [NTa] int32) for SMEM: each chunk's sequence (the tail, owned by no
  sequence, maps to the last one: its blocks then follow that sequence's and are revisited
  consecutively) and FIRST | LAST | OWNED bits."""
  from kda.padding import chunk_table
  t = chunk_table(jnp.asarray(aligned_cu, jnp.int32), NTa, chunk_size)
  N = aligned_cu.shape[0] - 1
  seq = jnp.where(t.seq >= 0, t.seq, max(N - 1, 0)).astype(jnp.int32)
  flags = (t.first.astype(jnp.int32) * FIRST + t.last.astype(jnp.int32) * LAST
           + (t.seq >= 0).astype(jnp.int32) * OWNED)
  return seq, flags


def aligned_cu_reason(aligned_cu):
  if aligned_cu is None or aligned_cu.ndim != 1 or not jnp.issubdtype(aligned_cu.dtype, jnp.integer):
    got = None if aligned_cu is None else f"{aligned_cu.dtype}{list(aligned_cu.shape)}"
    return f"aligned_cu must be a 1-D integer array, got {got}"
  return None


def dtype_reason(named, allowed=(F32, BF16)):
  """None if every array's dtype is one of `allowed` (f16 does not compile on TPU), else why."""
  ok = tuple(jnp.dtype(d) for d in allowed)
  for name, x in named:
    if x is not None and jnp.dtype(x.dtype) not in ok:
      return f"{name} must be {' or '.join(d.name for d in ok)} on TPU, got {jnp.dtype(x.dtype).name}"
  return None


def chunk_reason(Ta, chunk_size):
  if chunk_size not in (16, 32, 64):
    return f"chunk_size must be 16, 32 or 64, got {chunk_size}"
  if Ta % chunk_size:
    return f"Ta must be a multiple of chunk_size {chunk_size}, got {Ta}"
  return None
