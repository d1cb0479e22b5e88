"""What the Mosaic TPU (pallas.tpu) backward kernels share: layouts, VMEM accounting, dots, tables.

Layout. The stages' arrays are token-major [1, Ta, HV, D]; a TPU block must keep D on the 128 lanes
and tokens on the sublanes, which the heads in between forbid (kda's (None, BT, None, D) blocks do
not lower). The launchers transpose to head-first [HV, Ta, D] and back (per-chunk rows and per-token
scalars to head groups, `rows_in`); kernels take MB heads per program as (MB, BT, D) blocks and loop
over them with a fori_loop, so the live values are one head's.

VMEM. Every pipelined block is double-buffered; `block_bytes` pads a block's last two dims to the
dtype's (sublane, 128-lane) tile. A kernel's need is 2 * blocks + scratch + an allowance for one
head's intermediates; `heads_per_program` takes the largest divisor of HV whose need fits the
budget (0.9 x VMEM per TensorCore of the generation, kda._mosaic_tpu's table), and the kernels ask
for vmem_limit_bytes = min(0.9 x VMEM, max(the default scoped limit, 2 x need)): the values a head's
body keeps live are an allowance here, not fitted to Mosaic's allocation, so the factor 2 leaves it
room for spills and internal scratch (tools/tpu_bwd_aot.py compiles at production shapes).

Not padded: K, V stay as given in the lane dim (a full-dim block of 64 lanes lowers; HBM tiles pad
it to 128 lanes either way, so the bytes moved are the same).

Precision (the dtype policy). `mm(a, b, dims, low)`: with low (bf16 inputs) the operands are rounded
to bf16 here and multiplied at DEFAULT (one MXU pass, float32 accumulation), so the TPU interpreter,
which computes float32 dots exactly, sees the same operands the MXU does; otherwise float32 at
HIGHEST. Cumulative sums are dots with triangular 0/1 matrices at HIGHEST in both modes.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kda import _mosaic_tpu as _mt

F32, BF16 = jnp.float32, jnp.bfloat16
HI = lax.Precision.HIGHEST
NN = (((1,), (0,)), ((), ()))   # a @ b
NT = (((1,), (1,)), ((), ()))   # a @ b^T
TN = (((0,), (0,)), ((), ()))   # a^T @ b
interpret_params = _mt.interpret_params   # True -> pltpu.InterpretParams() (the TPU interpreter)


def vmem_budget() -> int:
  """0.9 x the VMEM per TensorCore of the generation being traced for (kda._mosaic_tpu.generation:
  the smallest, v7x's, off a TPU)."""
  return _mt.generation().vmem_cap


def block_bytes(shape, dtype) -> int:
  """VMEM bytes of one buffer of a block (None dims count as 1), last two dims tile-padded."""
  return _mt.buffer_bytes(shape, dtype, _mt.generation())


def heads_per_program(HV: int, per_head: int, fixed: int = 0, cap: int = 16) -> int:
  """The largest divisor MB of HV (<= cap) with fixed + MB * per_head within the VMEM budget; 0 if
  none fits."""
  best = 0
  for mb in range(1, min(HV, cap) + 1):
    if HV % mb == 0 and fixed + mb * per_head <= vmem_budget():
      best = mb
  return best


def budget_reason(kernel: str, need: int):
  if need > vmem_budget():
    gen = _mt.generation()
    return (f"mosaic_tpu {kernel} needs {need / 2**20:.1f} MiB of VMEM for its tiles, over "
            f"{_mt.VMEM_FRACTION} x the {gen.vmem_bytes / 2**20:.0f} MiB of {gen.name}")
  return None


def refuse(kernel: str, reason):
  """apply's guard: its predicate's reason as a ValueError (shapes and dtypes are static: trace time)."""
  if reason is not None:
    raise ValueError(f"mosaic_tpu {kernel} kernel: {reason}")


def compiler_params(semantics, need):
  """vmem_limit_bytes = min(0.9 x VMEM, max(the default scoped limit, 2 x need)) (module docstring)."""
  gen = _mt.generation()
  return _mt.compiler_params(semantics, _mt.Budget(need, min(gen.vmem_cap, max(gen.scoped_vmem_bytes, 2 * need))))


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

FIRST, LAST, TAIL = _mt.FIRST, _mt.LAST, _mt.TAIL
chunk_flags = _mt.chunk_flags   # (sequence of each chunk, the tail mapped to the last; FIRST | LAST | TAIL)


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
