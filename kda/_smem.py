"""The shared memory a Pallas Mosaic GPU kernel asks for, computed from its scratch types.

jax's Mosaic GPU lowering lays the scratch out as: every SMEM buffer (a `plgpu.SMEM` ref or a
`plgpu.RefUnion`, whose size is its largest member group) from a multiple of 1024 bytes; the
cross-lane reduction scratch (`CompilerParams.reduction_scratch_bytes`) when the body reduces
(jnp.sum over a register array's axis); then 8 bytes per mbarrier. A kernel's predicate and its
launcher build the same scratch list (one function per kernel), and the predicate compares
`smem_bytes` of it with the per-block limit, so a call the kernel cannot launch is refused with the
figures instead of failing in the lowering.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_ALIGN = 1024                    # each SMEM scratch buffer starts at a multiple of this
BARRIER_BYTES = 8                    # one mbarrier
REDUCTION_BYTES = plgpu.CompilerParams().reduction_scratch_bytes   # 2048: reserved for a reduction
SMEM_PER_BLOCK = 232448              # H200 (sm_90): shared memory one block may opt into, 227 KiB


def smem_bytes(scratch: Sequence, *, reduces: bool = False) -> int:
  """Bytes of shared memory a `plgpu.kernel` with these `scratch_types` asks for (reduces: its body
  has a cross-lane reduction); equal to the figure the CUDA lowering checks."""
  size = REDUCTION_BYTES if reduces else 0
  barriers = 0
  for s in scratch:
    if isinstance(s, plgpu.Barrier):
      n = s.num_barriers
      barriers += math.prod(n) if isinstance(n, tuple) else n
    else:                                       # an SMEM ref or a RefUnion ([bytes] int8)
      nbytes = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
      size += -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN
  return size + BARRIER_BYTES * barriers


def smem_reason(kernel: str, nbytes: int, limit: int = SMEM_PER_BLOCK) -> Optional[str]:
  """None if `nbytes` of shared memory fit one block, else the reason with the figures."""
  if nbytes > limit:
    return f"the {kernel} kernel needs {nbytes} bytes of shared memory per block, more than the {limit} available"
  return None
