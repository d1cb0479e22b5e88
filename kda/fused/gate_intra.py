"""gate -> intra fused, inside the packed forward (kda.pipeline.packed_forward): the gate's chunk
cumsum runs in intra's scores kernel, so gc never goes through HBM (the gate kernel's ~830 MB of
traffic at T = 32768, H = 16, K = 128: 0.21 ms of the forward on the H200).

`mosaic_gpu(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, ...)` -> (intra's Out, decay
[NTa, HV, K] float32, exp of each chunk's last gc row, what the state + output kernel reads of gc),
equal bit for bit to kda.stages.gate.mosaic_gpu.packed followed by kda.stages.intra.mosaic_gpu.packed
and kda.stages.state.chunk_decay.

The scores kernel (kda.stages.intra.mosaic_gpu, `gated`) loads the chunk's raw gates (packed rows,
by TMA: float32 ones straight into gc's SMEM tile, bf16 ones into the q / k landing zone) and runs
the gate kernel's row scan on them, one thread per column (kda.stages.gate.mosaic_gpu.row_parts:
the same operations in the same order, so the same bits), writing gc_frac over the tile row by row.
It stores per chunk and column gc's row 63 and the sum of ceil(g)**2.

One part only: while every gate is above -1 the ceilings are all 0, gc_int is 0 and gc is gc_frac
(what intra's one-part kernel reads), and every chunk is bounded (16 rows of gates in (-1, 0] span
less than 16): the kernel takes the two-level path without a flag and has no six-level code. Where any ceiling is not 0 (a gate at or below -1), the
call's results are those of the unfused kernels instead: a lax.cond on the column sums runs the gate
kernel and intra's two-part scores kernel (what the unfused pair runs then). The predicate copy is
the one the unfused pair makes for its own cond, so plain gates cost the fused kernel alone.

Where it applies (`takes`): the packed forward with gates given in log space (use_gate_in_kernel
False; activated gates reach -1 often, and would pay both), K = 128 (one thread per column of the
warpgroup; K = 64 runs the unfused pair), and what the unfused kernels take.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import Out
from kda.stages.intra import mosaic_gpu as intra_mgpu
from kda.stages.state import chunk_decay

F32 = jnp.float32
BT = 64


def takes(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, use_gate_in_kernel, **_) -> Optional[str]:
  """None if `mosaic_gpu` takes this call (packed q, k, v, beta, g; rows a padding.ChunkRows), else why."""
  if use_gate_in_kernel:
    return "gate_intra fuses gates given in log space (use_gate_in_kernel=False)"
  if k.ndim != 4 or k.shape[3] != gate_mgpu.COLS:
    return f"gate_intra takes K = {gate_mgpu.COLS} (one thread per column), got k of shape {k.shape}"
  if g.shape != k.shape:
    return f"g must have k's shape {k.shape}, got {g.shape}"
  if jnp.dtype(g.dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
    return f"g must be float32 or bfloat16, got {jnp.dtype(g.dtype).name}"
  reason = gate_mgpu.packed_takes(g, rows, None, None, chunk_size=chunk_size, use_gate_in_kernel=False,
                                  lower_bound=None)
  if reason is not None:
    return reason
  Ta = rows.src.shape[0] * chunk_size
  gi = jax.ShapeDtypeStruct((1, Ta) + k.shape[2:], F32)
  return intra_mgpu.packed_supports(q, k, v, beta, gi, gi, aligned_cu, rows, scale=scale, chunk_size=chunk_size)


def mosaic_gpu(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, use_gate_in_kernel=False,
               interpret=False, config=None, tail_zeros=True, **_):
  """(intra Out, decay [NTa, HV, K] float32); see the module docstring."""
  reason = takes(q, k, v, beta, g, aligned_cu, rows, scale=scale, chunk_size=chunk_size,
                 use_gate_in_kernel=use_gate_in_kernel)
  if reason is not None:
    raise ValueError(f"mosaic_gpu gate_intra kernel: {reason}")
  config = config or intra_mgpu.Config()
  NTa = rows.src.shape[0]
  Ta = NTa * BT
  cu = aligned_cu.astype(jnp.int32)
  beta_t = jnp.pad(beta[0].astype(F32).T, ((0, 0), (0, BT)))   # as intra_mgpu.packed
  chunk_rows, rows = rows, tuple(x.astype(jnp.int32) for x in rows)
  q, k, v = (x[0].astype(intra_mgpu.BF16) for x in (q, k, v))
  bounded = config.bounded == "auto"
  kw = dict(scale=float(scale), bounded=bounded, interpret=interpret, config=config, tail_zeros=bool(tail_zeros))

  def unfused(into=None):   # some gate <= -1: the gate kernel and intra's two-part scores kernel
    gi, gf, flag, _two = gate_mgpu.packed(g, chunk_rows, None, None, chunk_size=BT, use_gate_in_kernel=False,
                                          lower_bound=None, interpret=interpret, tail_zeros=tail_zeros)
    flag = flag if bounded else jnp.zeros_like(flag)
    out = intra_mgpu._scores(cu, rows, q, k, beta_t, (gi[0], gf[0]), flag, **kw, into=into and into[:6])
    if into:
      into[6][...] = chunk_decay(gi, gf, BT)
    return None if into else (*out, chunk_decay(gi, gf, BT))

  if config.two_part == "always" or intra_mgpu.TWO_PART_ONLY:
    *scores, decay = unfused()
  else:
    *scores, last, nz = intra_mgpu._scores(cu, rows, q, k, beta_t, (g[0],), None, Ta=Ta, **kw)
    # gc_int is 0 everywhere here: exp(gc_last), as chunk_decay forms it from (0, gc_frac). Otherwise
    # the unfused kernels overwrite the results in place: a cond passing them through would copy them
    refs = [jax.new_ref(x) for x in (*scores, jnp.exp(last))]
    lax.cond(jnp.any(nz != 0), lambda: unfused(refs), lambda: None)
    *scores, decay = (jax.ref.freeze(r) for r in refs)
  akh, akl, aqk, qg, kg, kd = scores
  ainv, w, u = intra_mgpu._solve(cu, rows, akh, akl, kd, v, beta_t, interpret=interpret, config=config,
                                 tail_zeros=tail_zeros)
  return Out(akh[None], aqk[None], ainv[None], w[None], u[None], qg[None], kg[None]), decay
