"""intra: the Pallas Mosaic GPU (Hopper) kernels; the math is in kda.stages.intra.

Two kernels, each one program (one warpgroup) per (value head, chunk), grid (HV, NTa):
- scores (`scores.py`): q, k, gc -> Akk (as a hi + lo bf16 split, for the solve), Aqk, qg, kg and
  w's right-hand side kd = beta k exp(gc), every decay formed by levels from the two parts of gc.
  While gc_int == 0 everywhere (every gate above -1) a lax.cond runs it on gc_frac alone: the same
  bits in one float32 tile instead of two (two CTAs per SM at K = 128, one with both parts).
- solve (`solve.py`): Akk's split, kd, v, beta -> Ainv, w, u by block doubling, Akk's split and X in
  SMEM (two CTAs per SM); with `defer` (the packed forward's inverse mode) it forms no w, u and fits
  three CTAs per SM.
Split in two so that each fits two CTAs per SM (as one kernel it fits one). Chunks at or past
aligned_cu[-1] (the tail of a static-bound layout) are only zero-filled (Ainv = I there).

Packed inputs (`packed`, the align folded into the loads): q, k, v, beta stay packed [1, T, ...] and
kda.padding.ChunkRows places each aligned chunk (rows r < count[c] read packed token src[c] + r);
the results equal `apply` on the aligned inputs.

Out (bf16, the dtype policy for bf16 inputs): Akk, Aqk, Ainv, w, u, qg, kg. The predicate
(`supports`) refuses float32 q/k/v: their float32 accuracy needs the pallas or reference stage;
`apply` itself rounds them to bf16. It also checks the kernels' SMEM (`scores.smem_bytes`,
`solve.smem_bytes`: the scratch the launchers allocate) against the per-block limit.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from kda._mosaic_gpu import BF16, F32, HEAD_DIMS, MAX_GRID_YZ, smem_reason
from kda.stages.gate.mosaic_gpu import BOUNDED_SPAN, bounded_chunks, reset_free, two_parts_needed  # noqa: F401
from kda.stages.intra import Out
from kda.stages.intra.mosaic_gpu import scores, solve

BT = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """Variants of the intra kernels."""
  bounded: str = "auto"     # "auto": bounded chunks take the two-level path; "never": six levels always
  approx_math: bool = True   # Mosaic GPU's fast exp (ex2.approx): ~2^-22 relative, far below bf16 stores

  def __post_init__(self):
    if self.bounded not in ("auto", "never"):
      raise ValueError(f"bounded must be 'auto' or 'never', got {self.bounded!r}")


class Deferred(NamedTuple):
  """The solve's results with `defer` (kda.fused.state_output's inverse mode reads them in place of
  w, u): Out.Ainv is X's high bf16 part, as always."""
  kd: jax.Array       # [1, Ta, HV, K] bf16, beta k exp(gc): w = X kd
  bv: jax.Array       # [1, Ta, HV, V] bf16, beta v: u = X bv
  ainv_lo: jax.Array  # [1, Ta, HV, BT] bf16, X - Ainv rounded to bf16


def smem_bytes(K, V, *, packed=False, defer=False):
  """The larger SMEM figure of the two kernels (the scores kernel with both parts of gc)."""
  return max(scores.smem_bytes(K, two_part=True, packed=packed),
             solve.smem_bytes(K, V, packed=packed, defer=defer))


def _kernel_reason(q, k, v, beta, gc_int, gc_frac, aligned_cu, *, chunk_size, packed=False, defer=False):
  """None if the kernels run these aligned shapes (any float q, k, v: `apply` rounds them), else why."""
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  if k.ndim != 4 or k.shape[0] != 1:
    return f"k must be [1, Ta, HV, K], got shape {k.shape}"
  _, Ta, HV, K = k.shape
  if K not in HEAD_DIMS:
    return f"K must be one of {HEAD_DIMS}, got {K}"
  if v.ndim != 4 or v.shape[:3] != (1, Ta, HV) or v.shape[3] not in HEAD_DIMS:
    return f"v must be [1, Ta, HV, V] with V in {HEAD_DIMS} and k's Ta, HV, got {v.shape}"
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  for name, x in (("q", q), ("gc_int", gc_int), ("gc_frac", gc_frac)):
    if x.shape != k.shape:
      return f"{name} must have shape {k.shape}, got {x.shape}"
  if beta.shape != (1, Ta, HV):
    return f"beta must have shape {(1, Ta, HV)}, got {beta.shape}"
  if aligned_cu is not None and (aligned_cu.ndim != 1 or not jnp.issubdtype(aligned_cu.dtype, jnp.integer)):
    return f"aligned_cu must be None or a 1-D integer array, got {aligned_cu.dtype}{list(aligned_cu.shape)}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  return smem_reason(smem_bytes(K, v.shape[3], packed=packed, defer=defer))


def _dtype_reason(q, k, v):
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("q", q), ("k", k), ("v", v))
         if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return f"mosaic_gpu intra takes bfloat16 q, k, v, got {', '.join(bad)}"
  return None


def supports(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, config=None,
             **_) -> Optional[str]:
  """The stage's predicate: None if `apply` takes this call, else the reason in words. The kernels'
  operands are bf16: float32 q, k, v are refused (they keep float32 accuracy on the pallas or
  reference stage)."""
  del scale, config      # neither changes what the kernels take
  return (_kernel_reason(q, k, v, beta, gc_int, gc_frac, aligned_cu, chunk_size=chunk_size)
          or _dtype_reason(q, k, v))


takes = supports         # the name kda.stages.intra registers the predicate by


def packed_supports(q, k, v, beta, gc_int, gc_frac, aligned_cu, rows, *, scale, chunk_size, config=None,
                    defer=False, **_) -> Optional[str]:
  """None if `packed` takes this call (q, k, v, beta packed [1, T, ...], gc aligned), else why."""
  del scale, config
  if q.ndim != 4 or q.shape[0] != 1:
    return f"q must be packed [1, T, HV, K], got shape {q.shape}"
  T = q.shape[1]
  Ta = gc_frac.shape[1] if gc_frac.ndim == 4 else -1
  aligned = lambda x, d: jax.ShapeDtypeStruct((1, Ta) + x.shape[2:3] + (d,), x.dtype)
  reason = _kernel_reason(aligned(q, q.shape[3]), aligned(k, k.shape[3]), aligned(v, v.shape[-1]),
                          jax.ShapeDtypeStruct((1, Ta) + beta.shape[2:], beta.dtype), gc_int, gc_frac, aligned_cu,
                          chunk_size=chunk_size, packed=True, defer=defer) or _dtype_reason(q, k, v)
  if reason is not None:
    return reason
  for name, x in (("k", k), ("v", v), ("beta", beta)):
    if x.shape[:2] != (1, T):
      return f"{name} must be packed like q [1, {T}, ...], got shape {x.shape}"
  if aligned_cu is None:
    return "packed inputs need aligned_cu"
  NTa = Ta // BT
  for name, x in (("rows.src", rows.src), ("rows.count", rows.count)):
    if x.shape != (NTa,) or not jnp.issubdtype(x.dtype, jnp.integer):
      return f"{name} must be [{NTa}] integers, got {x.dtype}{list(x.shape)}"
  return None


def apply(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, interpret=False,
          config=None, seg=None):
  """The stage on the kernels. seg (kda.pipeline.segment_rows of a segmented layout, whose reset
  gates are -inf): each chunk's pairs masked to its segments and the resets' -128 steps taken out of
  gc_int, so that a chunk holding one stays bounded; the same results up to rounding."""
  config = config or Config()
  reason = _kernel_reason(q, k, v, beta, gc_int, gc_frac, aligned_cu, chunk_size=chunk_size)
  if reason is not None:
    raise ValueError(f"mosaic_gpu intra kernel: {reason}")
  Ta = k.shape[1]
  beta_t = beta[0].astype(F32).T                                  # [HV, Ta]: contiguous rows for TMA
  return _apply(q, k, v, beta_t, gc_int, gc_frac, aligned_cu, None, None, None, scale=scale,
                interpret=interpret, config=config, Ta=Ta, seg=seg)


def packed_beta_rows(beta, rows):
  """The packed kernels' beta [HV, T + BT] float32 (a chunk's BT rows from any src < T stay inside:
  those loads are not TMA) and rows as an int32 (src, count) tuple."""
  return jnp.pad(beta[0].astype(F32).T, ((0, 0), (0, BT))), tuple(x.astype(jnp.int32) for x in rows)


def packed(q, k, v, beta, gc_int, gc_frac, aligned_cu, rows, *, scale, chunk_size, bounded=None,
           two_part=None, interpret=False, config=None, tail_zeros=True, seg=None, defer=False):
  """`apply` on packed q, k, v [1, T, ...], beta [1, T, HV]: the align folded into the loads.

  rows (kda.padding.ChunkRows) places each aligned chunk: its rows r < rows.count[c] read packed
  token rows.src[c] + r, the others are zeros, so the result equals `apply` on the aligned inputs.
  gc_int, gc_frac are aligned [1, Ta, HV, K]; `bounded` ([HV * NTa] int32) and `two_part` (a bool
  scalar: any chunk needs both parts; or [HV * NTa] int32, per chunk, as `two_parts_needed`) may
  come from the gate kernel's statistics (else they are computed from gc here).
  tail_zeros=False: at the chunks at or past aligned_cu[-1] only the residuals are written (Aqk 0,
  Ainv I); Akk, qg, kg, w, u are left unwritten there (the fused state + output kernel never reads
  them), and gc may be unwritten there too (the tail reads no gc). seg: as in `apply` (bounded and
  two_part, if given, must be the reset-free ones: kda.stages.gate.mosaic_gpu.packed(seg=) gives them).
  defer: the solve forms no w, u; returns (Out with w = u = None, Deferred) for the state + output
  kernel's inverse mode.
  """
  config = config or Config()
  reason = packed_supports(q, k, v, beta, gc_int, gc_frac, aligned_cu, rows, scale=scale, chunk_size=chunk_size,
                           defer=defer)
  if reason is not None:
    raise ValueError(f"mosaic_gpu intra kernel (packed): {reason}")
  Ta = gc_frac.shape[1]
  beta_t, rows = packed_beta_rows(beta, rows)
  return _apply(q, k, v, beta_t, gc_int, gc_frac, aligned_cu, rows, bounded, two_part, scale=scale,
                interpret=interpret, config=config, Ta=Ta, tail_zeros=bool(tail_zeros), seg=seg, defer=defer)


def _apply(q, k, v, beta_t, gc_int, gc_frac, aligned_cu, rows, flag, two_part, *, scale, interpret, config,
           Ta, tail_zeros=True, seg=None, defer=False):
  HV = k.shape[2]
  # chunks at or past aligned_cu[-1] (the tail of a static-bound layout) are only zero-filled
  cu = jnp.array([0, Ta], jnp.int32) if aligned_cu is None else aligned_cu.astype(jnp.int32)
  q, k, v = (x[0].astype(BF16) for x in (q, k, v))
  gi, gf = gc_int[0].astype(F32), gc_frac[0].astype(F32)
  free = gc_int if seg is None else reset_free(gc_int.astype(F32), seg)   # what the kernel's decays see
  bounded = config.bounded == "auto"
  if not bounded:
    flag = jnp.zeros((HV * (Ta // BT),), jnp.int32)
  elif flag is None:
    flag = bounded_chunks(free, gc_frac)
  seg = None if seg is None else seg.astype(F32)
  run = lambda *gis: scores.launch(cu, rows, q, k, beta_t, gis, flag, scale=float(scale), bounded=bounded,
                                   approx_math=config.approx_math, interpret=interpret, tail_zeros=tail_zeros,
                                   seg=seg)
  # gc_int == 0 everywhere (every gate > -1): gc is gc_frac, the same decays bit for bit
  if two_part is None:
    pred = jnp.any(free != 0)
  else:
    pred = two_part if jnp.ndim(two_part) == 0 else jnp.any(two_part != 0)
  akh, akl, aqk, qg, kg, kd = lax.cond(pred, lambda a, b: run(a, b), lambda a, b: run(b), gi, gf)
  return solved(cu, rows, akh, akl, aqk, qg, kg, kd, v, beta_t, approx_math=config.approx_math,
                interpret=interpret, tail_zeros=tail_zeros, defer=defer)


def solved(cu, rows, akh, akl, aqk, qg, kg, kd, v, beta_t, *, approx_math, interpret, tail_zeros=True,
           defer=False):
  """The scores kernel's results [Ta, HV, *] through the solve -> Out, or with defer (Out with w = u
  = None, Deferred)."""
  kw = dict(approx_math=approx_math, interpret=interpret, tail_zeros=tail_zeros)
  if defer:
    ainv, lo, bv = solve.launch(cu, rows, akh, akl, None, v, beta_t, defer=True, **kw)
    return (Out(akh[None], aqk[None], ainv[None], None, None, qg[None], kg[None]),
            Deferred(kd[None], bv[None], lo[None]))
  ainv, w, u = solve.launch(cu, rows, akh, akl, kd, v, beta_t, **kw)
  return Out(akh[None], aqk[None], ainv[None], w[None], u[None], qg[None], kg[None])
