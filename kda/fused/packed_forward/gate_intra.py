"""gate -> intra fused: the Pallas Mosaic GPU (Hopper) kernels; the math is in kda.fused.gate_intra.

`apply(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, ...)` -> (intra's Out, decay
[NTa, HV, K] float32, exp of each chunk's last gc row, what the state + output kernel reads of gc),
equal bit for bit to kda.stages.gate.mosaic_gpu.packed followed by kda.stages.intra.mosaic_gpu.packed
and kda.stages.state.chunk_decay while every gate is above -1 or a chunk is not bounded, and within
one more float32 rounding of gc elsewhere (below).

The scores kernel (kda.stages.intra.mosaic_gpu.scores, `gated`) loads the chunk's raw gates (packed
rows, by TMA: float32 ones straight into gc's SMEM tile, bf16 ones into the q / k landing zone) and
runs the gate kernel's row scan on them, one thread per column (kda.stages.gate.mosaic_gpu.row_parts:
the same operations in the same order), writing gc over the tile row by row; it stores per chunk
and column gc's row 63 (the state kernel's decay is its exp). The scan loads SCAN_BLOCK rows before
it stores any: the stores would otherwise hold each next load back.

Two kernels, no host round trip and no conditional (XLA copies a conditional's results, here the
six score arrays):
- one part (two CTAs per SM, every chunk): gc = gc_int + gc_frac in one float32 tile (gc_frac
  itself while every gate is above -1, so the unfused kernels' bits there), and the chunk is kept
  where it is bounded (the spans of bounded_chunks, from that tile): the two-level path, no
  six-level code. A bounded chunk's gc stays within 576 of 0, so the one rounding of
  gc_int + gc_frac moves a decay by < 2^-14 relative (bf16 operands round at 2^-9). Per chunk and
  column it also stores 1.0 where the chunk is not bounded (NaN included), and skips the work of
  such a chunk (per column a bf16 flag into a free SMEM row, then 128 scalar reads: a cross-warp
  reduction's scratch would cost it its second CTA per SM).
- two parts, persistent (grid (HV, 128 // HV), one CTA per SM): it redoes the chunks flagged so,
  with gc_int and gc_frac in SMEM and the exact six-level path where needed, writing its results
  over the first kernel's in place (jax.new_ref); with no such chunk its programs exit at once.
So a call costs the first kernel and 128 empty programs, or both kernels on the flagged chunks;
where most chunks are not bounded (gates far below -1) the persistent kernel, one CTA per SM with
the scan in it, is slower than the unfused gate kernel and two-part scores grid.

Where it applies (`supports`): the packed forward with gates given in log space (use_gate_in_kernel
False: activated gates reach -1 often, and would pay both kernels), K = 128 (one thread per column
of the warpgroup; K = 64 runs the unfused pair), and what the unfused kernels take.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kda._mosaic_gpu import BF16, F32, smem_reason
from kda.stages.gate import exponent
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import mosaic_gpu as intra_mgpu
from kda.stages.intra.mosaic_gpu import scores, solve

BT = 64
Config = intra_mgpu.Config       # the group's kernels are intra's, with its variants


def smem_bytes(K, V, g_dtype, *, defer=False):
  """The largest SMEM figure of the group's three kernels: the one-part and the persistent two-part
  gated scores kernels, the packed solve."""
  bf16_gates = jnp.dtype(g_dtype) != jnp.dtype(F32)
  return max(scores.smem_bytes(K, two_part=False, packed=True, gated=True, bf16_gates=bf16_gates),
             scores.smem_bytes(K, two_part=True, packed=True, gated=True, bf16_gates=bf16_gates),
             solve.smem_bytes(K, V, packed=True, defer=defer))


def supports(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, use_gate_in_kernel, config=None,
             defer=False, **_) -> Optional[str]:
  """None if `apply` takes this call (packed q, k, v, beta, g; rows a padding.ChunkRows), else why."""
  if use_gate_in_kernel:
    return "gate_intra fuses gates given in log space (use_gate_in_kernel=False)"
  if k.ndim != 4 or k.shape[3] != gate_mgpu.COLS:
    return f"gate_intra takes K = {gate_mgpu.COLS} (one thread per column), got k of shape {k.shape}"
  if g.shape != k.shape:
    return f"g must have k's shape {k.shape}, got {g.shape}"
  if jnp.dtype(g.dtype) not in (jnp.dtype(F32), jnp.dtype(BF16)):
    return f"g must be float32 or bfloat16, got {jnp.dtype(g.dtype).name}"
  reason = gate_mgpu.packed_supports(g, rows, None, None, chunk_size=chunk_size, use_gate_in_kernel=False,
                                     lower_bound=None)
  if reason is not None:
    return reason
  Ta = rows.src.shape[0] * chunk_size
  gi = jax.ShapeDtypeStruct((1, Ta) + k.shape[2:], F32)
  reason = intra_mgpu.packed_supports(q, k, v, beta, gi, gi, aligned_cu, rows, scale=scale, chunk_size=chunk_size,
                                      config=config, defer=defer)
  return reason or smem_reason(smem_bytes(k.shape[3], v.shape[3], g.dtype, defer=defer))


def _result_types(q, Ta):
  """The scores kernels' results: Akk's split, Aqk [Ta, HV, 64], qg, kg, kd [Ta, HV, K] bf16, and
  the gc rows 63 of both parts [NTa, HV, K] float32."""
  _, HV, K = q.shape
  S = jax.ShapeDtypeStruct
  return [S((Ta, HV, BT), BF16)] * 3 + [S((Ta, HV, K), BF16)] * 3 + [S((Ta // BT, HV, K), F32)] * 2


def apply(q, k, v, beta, g, aligned_cu, rows, *, scale, chunk_size, use_gate_in_kernel=False,
          interpret=False, config=None, tail_zeros=True, defer=False, **_):
  """(intra Out, decay [NTa, HV, K] float32); see the module docstring. defer: ((Out with w = u =
  None, intra's Deferred), decay), for the state + output kernel's inverse mode."""
  config = config or Config()
  reason = supports(q, k, v, beta, g, aligned_cu, rows, scale=scale, chunk_size=chunk_size,
                    use_gate_in_kernel=use_gate_in_kernel, config=config, defer=defer)
  if reason is not None:
    raise ValueError(f"mosaic_gpu gate_intra kernel: {reason}")
  NTa = rows.src.shape[0]
  Ta = NTa * BT
  cu = aligned_cu.astype(jnp.int32)
  beta_t, rows = intra_mgpu.packed_beta_rows(beta, rows)
  q, k, v = (x[0].astype(BF16) for x in (q, k, v))
  kw = dict(scale=float(scale), bounded=config.bounded == "auto", approx_math=config.approx_math,
            interpret=interpret, tail_zeros=bool(tail_zeros))
  g = g[0]
  *first, last, nz = scores.launch(cu, rows, q, k, beta_t, (g,), None, Ta=Ta, **kw)
  refs = [jax.new_ref(x) for x in (*first, jnp.zeros_like(last), last)]
  redo = jnp.any(nz != 0, axis=-1).T.reshape(-1).astype(jnp.int32)      # [HV * NTa], (head, chunk)
  # the chunks not bounded: the two-part kernel redoes them in place; with none it exits
  pred = jnp.any(redo != 0).astype(jnp.int32).reshape(1)
  scores.launch(cu, rows, q, k, beta_t, (g,), None, Ta=Ta, into=refs, pred=(pred, redo), **kw)
  *out, last_i, last_f = (jax.ref.freeze(r) for r in refs)
  decay = jnp.exp(exponent(last_i, last_f))        # chunk_decay's formula on the last rows
  akh, akl, aqk, qg, kg, kd = out
  return intra_mgpu.solved(cu, rows, akh, akl, aqk, qg, kg, kd, v, beta_t, approx_math=config.approx_math,
                           interpret=interpret, tail_zeros=tail_zeros, defer=defer), decay
