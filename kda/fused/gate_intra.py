"""gate -> intra fused, inside the packed forward (kda.pipeline.packed_forward): the gate's chunk
cumsum runs in intra's scores kernel, so gc never goes through HBM (the gate kernel's ~830 MB of
traffic at T = 32768, H = 16, K = 128: 0.21 ms of the forward on the H200).

`mosaic_gpu(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, ...)` -> (intra's Out, decay
[NTa, HV, K] float32, exp of each chunk's last gc row, what the state + output kernel reads of gc),
equal bit for bit to kda.stages.gate.mosaic_gpu.packed followed by kda.stages.intra.mosaic_gpu.packed
and kda.stages.state.chunk_decay while every gate is above -1 or a chunk is not bounded, and within
one more float32 rounding of gc elsewhere (below).

The scores kernel (kda.stages.intra.mosaic_gpu, `gated`) loads the chunk's raw gates (packed rows,
by TMA: float32 ones straight into gc's SMEM tile, bf16 ones into the q / k landing zone) and runs
the gate kernel's row scan on them, one thread per column (kda.stages.gate.mosaic_gpu.row_parts:
the same operations in the same order), writing gc over the tile row by row; it stores per chunk
and column gc's row 63 (the state kernel's decay is its exp).

Two kernels, no host round trip:
- one part (two CTAs per SM, every chunk): gc = gc_int + gc_frac in one float32 tile (gc_frac
  itself while every gate is above -1, so the unfused kernels' bits there), and the chunk is kept
  where it is bounded (the spans of bounded_chunks, from that tile): the two-level path, no
  six-level code. A bounded chunk's gc stays within 576 of 0, so the one rounding of
  gc_int + gc_frac moves a decay by < 2^-14 relative (bf16 operands round at 2^-9). Per chunk and
  column it also stores 1.0 where the chunk is not bounded (NaN included).
- two parts, persistent (grid (HV, 128 // HV), one CTA per SM): it redoes the chunks flagged so,
  with gc_int and gc_frac in SMEM and the exact six-level path where needed, writing its results
  over the first kernel's in place (jax.new_ref); with no such chunk its programs exit at once.
  So a call costs the first kernel and 128 empty programs, or both kernels on the flagged chunks.
  The unfused pair gives every chunk the two-part kernel (one CTA per SM) as soon as one gate
  reaches -1 (its lax.cond on whether gc_int is 0 runs on the device: a CUDA graph conditional in
  XLA's command buffer).

The one-part kernel skips the work of the chunks the two-part kernel redoes (SKIP_STRONG of
kda.stages.intra.mosaic_gpu: per column a bf16 flag into a free SMEM row, then 128 scalar reads;
a cross-warp reduction's scratch would cost it its second CTA per SM). Its gate scan loads eight rows
before it stores any (SCAN_BLOCK): the stores would otherwise hold each next load back. On by
default (kda.pipeline.FUSE_GATE_INTRA). H200, forward back to back (device time) on `tools.bench`'s
inputs: plain gates A 1.271-1.275 ms with the solve's RESIDENT_AKK against 1.423-1.446 unfused
without it (2026-12-03, third session; the group alone, before the blocked scan: 1.356, the same
bits of o as unfused; with RESIDENT_AKK on both sides the simulator gives the same bits too); the
session before, gates x 40 (about -2 a token, every chunk bounded and most reaching -1) 1.390
against 1.807 (o within one bf16 rounding); but x 640 (no chunk bounded) 5.72 against 4.10 (the
same bits: the persistent kernel, one CTA per SM and the gate scan in it, is slower than the gate
kernel + the two-part grid). A lax.cond that took the unfused pair where more than a quarter of
the chunks need the redo took x 640 to 4.46 ms but cost plain gates 0.31 ms: XLA copies a
conditional's results (the six score arrays), so the group has none.

Where it applies (`takes`): the packed forward with gates given in log space (use_gate_in_kernel
False; activated gates reach -1 often, and would pay both), K = 128 (one thread per column of the
warpgroup; K = 64 runs the unfused pair), and what the unfused kernels take.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kda.stages.gate import exponent
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import mosaic_gpu as intra_mgpu

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


def _result_types(q, Ta):
  """The scores kernels' results: Akk's split, Aqk [Ta, HV, 64], qg, kg, kd [Ta, HV, K] bf16, and
  the gc rows 63 of both parts [NTa, HV, K] float32."""
  _, HV, K = q.shape
  S = jax.ShapeDtypeStruct
  return ([S((Ta, HV, BT), intra_mgpu.BF16)] * 3 + [S((Ta, HV, K), intra_mgpu.BF16)] * 3
          + [S((Ta // BT, HV, K), F32)] * 2)


def mosaic_gpu(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, use_gate_in_kernel=False,
               interpret=False, config=None, tail_zeros=True, defer=False, **_):
  """(intra Out, decay [NTa, HV, K] float32); see the module docstring. defer: ((Out with w = u =
  None, intra's Deferred), decay), for the state + output kernel's inverse mode."""
  reason = takes(q, k, v, beta, g, aligned_cu, rows, scale=scale, chunk_size=chunk_size,
                 use_gate_in_kernel=use_gate_in_kernel)
  if reason is not None:
    raise ValueError(f"mosaic_gpu gate_intra kernel: {reason}")
  config = config or intra_mgpu.Config()
  NTa = rows.src.shape[0]
  Ta = NTa * BT
  cu = aligned_cu.astype(jnp.int32)
  beta_t, rows = intra_mgpu.packed_beta_rows(beta, rows)
  q, k, v = (x[0].astype(intra_mgpu.BF16) for x in (q, k, v))
  bounded = config.bounded == "auto"
  kw = dict(scale=float(scale), bounded=bounded, interpret=interpret, config=config, tail_zeros=bool(tail_zeros))

  g = g[0]
  HV = q.shape[1]
  if config.two_part == "always" or intra_mgpu.TWO_PART_ONLY:
    refs = [jax.new_ref(jnp.zeros(x.shape, x.dtype)) for x in _result_types(q, Ta)]
    redo = jnp.ones((HV * NTa,), jnp.int32)
  else:
    *scores, last, nz = intra_mgpu._scores(cu, rows, q, k, beta_t, (g,), None, Ta=Ta, **kw)
    refs = [jax.new_ref(x) for x in (*scores, jnp.zeros_like(last), last)]
    redo = jnp.any(nz != 0, axis=-1).T.reshape(-1).astype(jnp.int32)      # [HV * NTa], (head, chunk)
  # the chunks not bounded: the two-part kernel redoes them in place; with none it exits
  pred = jnp.any(redo != 0).astype(jnp.int32).reshape(1)
  intra_mgpu._scores(cu, rows, q, k, beta_t, (g,), None, Ta=Ta, into=refs, pred=(pred, redo), **kw)
  *scores, last_i, last_f = (jax.ref.freeze(r) for r in refs)
  decay = jnp.exp(exponent(last_i, last_f))        # chunk_decay's formula on the last rows
  akh, akl, aqk, qg, kg, kd = scores
  return intra_mgpu.solved(cu, rows, akh, akl, aqk, qg, kg, kd, v, beta_t, interpret=interpret, config=config,
                           tail_zeros=tail_zeros, defer=defer), decay
