"""bwd_dav (S1): the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.bwd_dav.

One kernel, one program per (value head h, chunk c), grid (HV, NTa) (the chunks on CUDA's grid x,
which has no 65535 limit, as the other backward kernels). Per program, with the chunk's rows
[c*64, c*64 + 64) of head h:

- do [64, V], v_new [64, V] and Aqk [64, 64] are read from GMEM straight into registers (WGMMA
  layout; bf16 or float32, upcast to float32 there), each split into hi + lo bf16 parts in swizzled
  SMEM tiles (no TMA, no barrier).
- dAqk = tril(do @ v_new^T): the RHS is the .T view of the v_new tile (contracting over V in one
  wgmma chain, K = V = 64 or 128), masked to j <= i in registers.
  dv = Aqk^T @ do: the LHS is the .T view of the Aqk tile.
  Both leave from registers to GMEM (float32).
- When do, v_new and Aqk are all bf16 (pipeline.backward aligns do in o's dtype, bf16 for bf16
  inputs), they come by TMA straight into three swizzled tiles and each product is one wgmma
  (exact products, float32 accumulation: the reference on the same bf16 values up to summation
  order); the split path below is for float32 operands.

SMEM per program: the hi and lo parts of do, v_new [64, V] and Aqk [64, 64], six swizzled bf16
tiles: 48 KiB at V = 64, 80 KiB at V = 128 (49152 and 81920 bytes as lowered; two CTAs per SM either
way; test_bwd_dav_mosaic.py asserts it).

Precision: every product is three wgmmas on the hi + lo bf16 splits of its float32 operands
(kda._mosaic_gpu.split: hi hi, hi lo, lo hi; ~2^-16 relative), float32 accumulation. bf16 v_new and
Aqk (what the forward's kernels hand over) split exactly (lo = 0: one wgmma per product adds
zeros, kept so that float32 v_new, Aqk stay accurate to ~2^-16); a float32 do needs the split. Measured against the float32 reference
(simulator, V = 64 and 128, HV 1 and 2, 2 and 3 chunks with padding rows and columns): the worst
(chunk, head) block's max|d| / max|ref| <= 3.0e-6 (dAqk) and 4.9e-6 (dv) with bf16 v_new, Aqk (also
on the records of a pipeline.backward run with the forward's and S0's kernels), <= 5.9e-6 and
6.5e-6 with float32 ones (test_bwd_dav_mosaic.py, TOL there); operands rounded to bf16 without the
split would give 2e-3. On the H200 (tools.gpu_check_bwd, H = 16, V = 128, T = 32768, v_new and Aqk
rounded to bf16 from the float32 record): <= 3.5e-3 (that rounding), 0.51 ms against the jnp
reference's 1.24 ms (FLA's dAv kernel: 0.16 ms), before the all-bf16 path.

The stage's predicate `takes` refuses what the kernel cannot do (chunk_size != 64, V not 64 / 128,
shapes, non-float dtypes, HV > 65535) with the reason, and float32 v_new or Aqk (the dtype policy:
float32 inputs keep the reference backward, as the other backward kernels' predicates do; the kernel
itself is accurate to ~2^-16 relative, not to float32's 2^-24).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32, HEAD_DIMS, MAX_GRID_YZ, aligned_cu_reason, skipping_tail, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda.stages.bwd_dav import Out

BT = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the bwd_dav kernel."""
  # chunks at or past aligned_cu[-1] (given): zeros out, nothing read
  skip_tail: bool = True


def supports(v_new, Aqk, do, aligned_cu=None, *, chunk_size, **_) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  if v_new.ndim != 4 or v_new.shape[0] != 1:
    return f"v_new must be [1, Ta, HV, V], got shape {v_new.shape}"
  _, Ta, HV, V = v_new.shape
  if V not in HEAD_DIMS:
    return f"V must be one of {HEAD_DIMS}, got {V}"
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  for name, x, shape in (("Aqk", Aqk, (1, Ta, HV, BT)), ("do", do, v_new.shape)):
    if tuple(x.shape) != tuple(shape):
      return f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}"
  for name, x in (("v_new", v_new), ("Aqk", Aqk), ("do", do)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return f"mosaic_gpu bwd_dav takes floating {name}, got {jnp.dtype(x.dtype).name}"
  return None if aligned_cu is None else aligned_cu_reason(aligned_cu)


def takes(v_new, Aqk, do, aligned_cu=None, *, chunk_size, **_) -> Optional[str]:
  """The stage's predicate: `supports`, and v_new, Aqk in bfloat16 (the dtype policy: what the
  forward's kernels store for bf16 inputs). float32 ones come from float32 inputs, whose gradients
  keep the reference's float32 accuracy, as in the other backward kernels' predicates (`apply`
  itself takes them, to ~2^-16 relative). do may be float32 (it always arrives so)."""
  reason = supports(v_new, Aqk, do, aligned_cu, chunk_size=chunk_size)
  if reason is not None:
    return reason
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("v_new", v_new), ("Aqk", Aqk))
         if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return f"mosaic_gpu bwd_dav takes bfloat16 v_new, Aqk (float32 keeps the reference), got {', '.join(bad)}"
  return None


def _body(vn_g, A_g, do_g, odA_g, odv_g, doh_s, dol_s, vnh_s, vnl_s, Ah_s, Al_s):
  i_h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  V = do_g.shape[-1]

  def split_into(ref, hi_s, lo_s):
    hi_s[...], lo_s[...] = _split(_load(ref.at[rows, i_h, :]).astype(F32))

  split_into(do_g, doh_s, dol_s)
  split_into(vn_g, vnh_s, vnl_s)
  split_into(A_g, Ah_s, Al_s)
  plgpu.commit_smem()

  def prod(lhs_h, lhs_l, rhs_h, rhs_l, shape):
    return _acc([(lhs_h, rhs_h), (lhs_h, rhs_l), (lhs_l, rhs_h)], shape)

  dA = prod(doh_s, dol_s, vnh_s.T, vnl_s.T, (BT, BT))      # do @ v_new^T
  shape = (BT, BT)
  odA_g[rows, i_h, :] = jnp.where(_iota(1, shape) <= _iota(0, shape), dA, 0.0)
  odv_g[rows, i_h, :] = prod(Ah_s.T, Al_s.T, doh_s, dol_s, (BT, V))   # Aqk^T @ do


def _body_bf16(vn_g, A_g, do_g, odA_g, odv_g, do_s, vn_s, A_s, bar):
  # every operand bf16: TMA straight into the wgmma tiles, one wgmma per product
  i_h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  V = do_g.shape[-1]
  for g, t in ((do_g, do_s), (vn_g, vn_s), (A_g, A_s)):
    plgpu.copy_gmem_to_smem(g.at[rows, i_h, :], t, bar)
  plgpu.barrier_wait(bar)
  shape = (BT, BT)
  dA = _acc([(do_s, vn_s.T)], shape)                          # do @ v_new^T
  odA_g[rows, i_h, :] = jnp.where(_iota(1, shape) <= _iota(0, shape), dA, 0.0)
  odv_g[rows, i_h, :] = _acc([(A_s.T, do_s)], (BT, V))        # Aqk^T @ do


def _zeros(vn_g, A_g, do_g, odA_g, odv_g, *scratch):
  i_h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  odA_g[rows, i_h, :] = zeros((BT, BT))
  odv_g[rows, i_h, :] = zeros((BT, do_g.shape[-1]))


@functools.lru_cache(maxsize=None)
def _kernel(Ta, HV, V, interpret, all_bf16=False, skip_tail=False, tail_zeros=True):
  out = lambda shape: jax.ShapeDtypeStruct(shape, F32)
  if all_bf16:
    body, scratch = _body_bf16, [_swz((BT, V)), _swz((BT, V)), _swz((BT, BT)), plgpu.Barrier(num_arrivals=3)]
  else:
    body, scratch = _body, [*[_swz((BT, V)) for _ in range(4)],      # do, v_new: hi, lo
                            _swz((BT, BT)), _swz((BT, BT))]          # Aqk: hi, lo
  if skip_tail:
    body = skipping_tail(body, _zeros if tail_zeros else None)
  return plgpu.kernel(
      body,
      out_type=(out((Ta, HV, BT)), out((Ta, HV, V))),
      grid=(HV, Ta // BT), grid_names=("h", "c"),
      scratch_types=scratch,
      kernel_name="kda_bwd_dav", interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def apply(v_new, Aqk, do, aligned_cu=None, *, chunk_size, interpret=False, config=None, tail_zeros=True):
  """The stage on the kernel. aligned_cu (optional): with Config(skip_tail=True) the chunks at or
  past aligned_cu[-1] get zeros without being read; tail_zeros=False leaves them unwritten (for
  callers that never read them: the packed backward)."""
  config = config or Config()
  reason = supports(v_new, Aqk, do, aligned_cu, chunk_size=chunk_size)
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_dav kernel: {reason}")
  _, Ta, HV, V = v_new.shape
  all_bf16 = all(jnp.dtype(x.dtype) == jnp.dtype(BF16) for x in (v_new, Aqk, do))
  skip = config.skip_tail and aligned_cu is not None
  cu = (aligned_cu.astype(jnp.int32),) if skip else ()
  dA, dv = _kernel(Ta, HV, V, bool(interpret), all_bf16, skip, bool(tail_zeros) or not skip)(
      *cu, v_new[0], Aqk[0], do[0])
  return Out(dA[None], dv[None])
