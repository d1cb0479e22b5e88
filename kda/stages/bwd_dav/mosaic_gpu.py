"""bwd_dav (S1): the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.bwd_dav.

One kernel, one program (one warpgroup) per (value head h, chunk c), grid (HV, NTa): the chunks on
CUDA's grid x, which has no 65535 limit. Per program, on the chunk's rows [64 c, 64 c + 64) of head h:

    dAqk = tril(do @ v_new^T)     wgmma chain over V, the .T view of the v_new tile; masked j <= i
    dv   = Aqk^T @ do             the .T view of the Aqk tile

Both results leave from registers (WGMMA layout) straight to GMEM in float32. Nothing crosses chunks.

Two bodies, chosen by the operands' dtypes:
- all bf16 (do, v_new, Aqk: what the pipeline hands over for bf16 inputs): TMA into three swizzled
  tiles, one wgmma per product (exact bf16 products, float32 accumulation: the reference on the
  same values up to summation order);
- otherwise: each operand read from GMEM into registers, upcast to float32 and split into hi + lo
  bf16 parts (kda._mosaic_gpu.split) in six swizzled tiles; each product is three wgmmas (hi hi,
  hi lo, lo hi: ~2^-16 relative), float32 accumulation. A bf16 operand splits exactly (lo = 0).

SMEM per program (`smem_bytes`): the bf16 body's do, v_new [64, V] and Aqk [64, 64] tiles and a
barrier, 24584 bytes at V = 64 and 40968 at V = 128; the split body's six tiles (hi, lo of each),
49152 and 81920 bytes. Either fits two CTAs per SM.

Tail: with aligned_cu, the chunks at or past aligned_cu[-1] hold no token; under Config.skip_tail
they store zeros (tail_zeros=False: nothing) and read nothing.

The stage's predicate `supports` refuses what the kernel cannot run (chunk_size != 64, V not 64 or
128, shapes, non-float dtypes, HV > 65535, SMEM) and float32 v_new or Aqk (the dtype policy: float32
inputs keep the reference backward's float32 accuracy; `apply` itself takes them to ~2^-16).
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

from kda._mosaic_gpu import BF16, F32, HEAD_DIMS, MAX_GRID_YZ, aligned_cu_reason, clean_flag as _flag, kept_rows
from kda._mosaic_gpu import skipping_tail, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda._mosaic_gpu import smem_bytes as _smem_bytes, smem_reason
from kda.stages.bwd_dav import Out

BT = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the bwd_dav kernel."""
  # with aligned_cu: the chunks at or past aligned_cu[-1] store zeros and read nothing
  skip_tail: bool = True


def _all_bf16(*xs):
  return all(jnp.dtype(x.dtype) == jnp.dtype(BF16) for x in xs)


def _scratch(V, all_bf16, packed=False):
  """The kernel's scratch types: bf16 body do, v_new, Aqk and a barrier (packed: and do's plain
  landing); split body hi, lo of each."""
  if all_bf16:
    return ([_swz((BT, V)), _swz((BT, V)), _swz((BT, BT)), plgpu.Barrier(num_arrivals=3)]
            + [plgpu.SMEM((BT, V), BF16)] * packed)
  return [*[_swz((BT, V)) for _ in range(4)], _swz((BT, BT)), _swz((BT, BT))]


def smem_bytes(V, all_bf16=True, packed=False):
  """Shared memory per program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates)."""
  return _smem_bytes(_scratch(V, all_bf16, packed))


def _reason(v_new, Aqk, do, aligned_cu, do_packed=None) -> Optional[str]:
  """What the kernel can run (any float dtypes; packed do: bf16 all); `apply` raises with it."""
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
  if aligned_cu is not None and (reason := aligned_cu_reason(aligned_cu)):
    return reason
  packed = do_packed is not None
  if packed and (do_packed.ndim != 4 or do_packed.shape[0] != 1 or do_packed.shape[2:] != (HV, V)
                 or not _all_bf16(v_new, Aqk, do_packed)):
    return (f"packed do must be bf16 [1, T, {HV}, {V}] with bf16 v_new and Aqk, got do "
            f"{jnp.dtype(do_packed.dtype).name}{list(do_packed.shape)}")
  return smem_reason(smem_bytes(V, _all_bf16(v_new, Aqk, do_packed if packed else do), packed), "bwd_dav")


def supports(v_new, Aqk, do, aligned_cu=None, *, chunk_size, config=None, do_packed=None, **_) -> Optional[str]:
  """The stage's predicate: None if the kernel takes this call, else the reason in words. Beyond
  what the kernel can run, v_new and Aqk must be bfloat16 (what the forward's kernels store for
  bf16 inputs; float32 ones come from float32 inputs, whose gradients keep the reference). do may
  be float32 (packed do: bf16)."""
  del config                      # no switch changes what the kernel takes
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  reason = _reason(v_new, Aqk, do, aligned_cu, do_packed)
  if reason is not None:
    return reason
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("v_new", v_new), ("Aqk", Aqk))
         if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return f"mosaic_gpu bwd_dav takes bfloat16 v_new, Aqk (float32 keeps the reference), got {', '.join(bad)}"
  return None


takes = supports                  # the name kda.stages.bwd_dav registers


def _body(vn_g, A_g, do_g, odA_g, odv_g, doh_s, dol_s, vnh_s, vnl_s, Ah_s, Al_s):
  """The split body: any float operands, hi + lo parts in SMEM, three wgmmas per product."""
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

  shape = (BT, BT)
  dA = prod(doh_s, dol_s, vnh_s.T, vnl_s.T, shape)                       # do @ v_new^T
  odA_g[rows, i_h, :] = jnp.where(_iota(1, shape) <= _iota(0, shape), dA, 0.0)
  odv_g[rows, i_h, :] = prod(Ah_s.T, Al_s.T, doh_s, dol_s, (BT, V))      # Aqk^T @ do


def _body_bf16(vn_g, A_g, do_g, odA_g, odv_g, do_s, vn_s, A_s, bar, land_s=None, *, rows_g=None):
  """The bf16 body: TMA straight into the wgmma tiles, one wgmma per product. rows_g (src, count
  [NTa] int32, clean [1] int32): do is packed [T, HV, V], chunk c's rows r < count[c] at packed row
  src[c] + r; they land in land_s and the other rows become 0 in do's tile (a select: another
  sequence's tokens, maybe NaN), and with clean not 0 the non-finite values too."""
  i_h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  V = do_g.shape[-1]
  loads = ((vn_g.at[rows, i_h, :], vn_s), (A_g.at[rows, i_h, :], A_s))
  if rows_g is None:
    loads += ((do_g.at[rows, i_h, :], do_s),)
  else:
    loads += ((do_g.at[pl.ds(rows_g[0][c], BT), i_h, :], land_s),)
  for g, t in loads:
    plgpu.copy_gmem_to_smem(g, t, bar)
  plgpu.barrier_wait(bar)
  if rows_g is not None:
    do_s[...] = kept_rows(_load(land_s), _iota(0, (BT, V)), (rows_g[0][c], rows_g[1][c], rows_g[2][0]))
    plgpu.commit_smem()
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
def _kernel(Ta, HV, V, interpret, all_bf16=False, skip_tail=False, tail_zeros=True, packed=False):
  out = lambda shape: jax.ShapeDtypeStruct(shape, F32)
  body, zeros = (_body_bf16 if all_bf16 else _body), _zeros
  if packed:                     # ChunkRows' src and count and the clean flag's refs first (after aligned_cu's)
    body = lambda src_g, cnt_g, clean_g, *refs: _body_bf16(*refs, rows_g=(src_g, cnt_g, clean_g))
    zeros = lambda src_g, cnt_g, clean_g, *refs: _zeros(*refs)
  if skip_tail:
    body = skipping_tail(body, zeros if tail_zeros else None)
  return plgpu.kernel(
      body,
      out_type=(out((Ta, HV, BT)), out((Ta, HV, V))),
      grid=(HV, Ta // BT), grid_names=("h", "c"),
      scratch_types=_scratch(V, all_bf16, packed),
      kernel_name="kda_bwd_dav", interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def apply(v_new, Aqk, do, aligned_cu=None, *, chunk_size, interpret=False, config=None, tail_zeros=True,
          do_packed=None, rows=None, clean=None):
  """The stage on the kernel; any float v_new, Aqk, do (the predicate `supports` adds the dtype
  policy). aligned_cu (optional): with Config.skip_tail the chunks at or past aligned_cu[-1] get
  zeros without being read; tail_zeros=False leaves them unwritten (for callers that never read
  them: the packed backward). do_packed [1, T, HV, V] bf16 with rows (padding.ChunkRows), v_new
  and Aqk bf16: the kernel reads do packed (the align folded into its load: chunk c's rows
  r < count[c] from packed row src[c] + r, the others 0) and the aligned do is not read (only its
  shape is checked). The same bits. clean (with do_packed; a bool scalar, traced or not): where
  true, non-finite values of do are read as 0 too (kda.confine's rerun), with no copy."""
  config = config or Config()
  packed = do_packed is not None
  reason = (f"chunk_size must be {BT}, got {chunk_size}" if chunk_size != BT else
            "packed do needs rows (padding.ChunkRows)" if packed and rows is None else
            _reason(v_new, Aqk, do, aligned_cu, do_packed))
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_dav kernel: {reason}")
  _, Ta, HV, V = v_new.shape
  skip = config.skip_tail and aligned_cu is not None
  cu = (aligned_cu.astype(jnp.int32),) if skip else ()
  if packed:
    cu += (rows.src.astype(jnp.int32), rows.count.astype(jnp.int32), _flag(clean))
  f = _kernel(Ta, HV, V, bool(interpret), _all_bf16(v_new, Aqk, do_packed if packed else do), skip,
              bool(tail_zeros) or not skip, packed)
  dA, dv = f(*cu, v_new[0], Aqk[0], (do_packed if packed else do)[0])
  return Out(dA[None], dv[None])
