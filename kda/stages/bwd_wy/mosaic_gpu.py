"""bwd_wy (S3): the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.bwd_wy.

One kernel, one program per (value head h, chunk c), grid (HV, NTa) with the chunks on CUDA's grid x
(no 65535 limit there). Nothing crosses chunks: every output of chunk c needs chunk c's rows only.
Per program, with a = Ainv's [64, 64] block (bf16, the dtype policy's residual):

- TMA: q, k (per 64-column slab of K), v (per slab of V) and a into swizzled bf16 tiles. The
  float32 operands (gc's two parts, S2's dqg, dkg, dw, du, dgc_last) are read from GMEM straight
  into registers (WGMMA layout), a slab at a time, and every result leaves from registers to GMEM.
- Per V slab: dvb = a^T @ du (a .T view of the a tile; du as a hi + lo split), dv = beta dvb,
  dbeta += sum(dvb v), and dAinv += du @ vb^T, vb = beta v (hi + lo splits, .T view).
- Per K slab: dkb = a^T @ dw, then eg = exp(gc), el = exp(gc_last - gc) (two-part exponents, both
  <= 0), dq = dqg eg, dk = dkg el + beta eg dkb, dgc = dqg q eg + dkb kb, dbeta += sum(dkb k eg),
  dAinv += dw @ kb^T, kb = beta k eg; and dg_state = L @ (dkg kg) + dgc_last with L the strictly
  lower [64, 64] ones matrix (the exclusive cumsum over the chunk's rows as one product; its
  operand split in three bf16 terms, ~2^-24 relative, so the gate gradient keeps float32 accuracy).
- Last: P = dAinv @ a^T, M = a^T @ P (each operand split, a exact), dAkk = strict_tril(-M).
The dAinv sum [64, 64] float32 stays in registers across the slabs; the four work tiles that hold
the split operands are reused by every product (reading an accumulator waits for its wgmma).

SMEM per program: q, k (2 K / 64 tiles), v (V / 64), a, four work tiles and L: [64, 64] bf16 tiles
of 8 KiB, 98304 bytes + barrier at K = V = 128 (two CTAs per SM; test_bwd_wy_mosaic.py asserts the
lowered size).

Precision: every float32 wgmma operand is a hi + lo bf16 split (three wgmmas: hi hi, hi lo, lo hi,
~2^-16 relative; one term less where a side is bf16-exact: a, L), float32 accumulation; the
exponentials and sums outside the tensor cores are float32 (approx_math: ex2.approx, ~2^-22). q, k,
v and Ainv enter as bf16 (the launcher rounds float32 ones, so `takes` refuses them: their float32
accuracy needs the reference). Padding and tail rows go through the same formulas as the reference.
Simulator (test_bwd_wy_mosaic.py): <= 1.1e-5 of the float32 reference per field on the same inputs
(dg_state 1.1e-7). On the H200 (tools.gpu_check_bwd, H = 16, K = V = 128, T = 32768 bf16, lengths
in [64, 4096], Ainv rounded to bf16 from the float32 record): <= 2.8e-4 per field, 2.49 ms against
the jnp reference's 6.11 ms; FLA's fused wy/dq/dk/dg kernel takes 2.73 ms for this work and more.
Not tuned yet: one CTA issues every load and wgmma in sequence (no TMA prefetch of S2's float32
cotangents, each read straight into registers), and tail chunks past aligned_cu[-1] are computed.

Packed dv (`apply(..., rows=, pieces=, T=)`, what the pipeline's packed backward calls): the unalign
folds into dv's store. dv goes from registers to a plain bf16 [64, 64] SMEM stage (8 KiB more,
108552 bytes: still two CTAs per SM) and from there by TMA to packed rows src[c] + r, r < count[c]
(kda._mosaic_gpu.store_rows: one store per set bit of the count, so no row of another sequence is
written); program (h, c) then zeroes the gap pieces c, c + NTa, ... (padding.gap_pieces) of head h.
The other outputs, and the arithmetic, are the aligned kernel's.

The stage's predicate `takes` refuses what the kernel cannot do (chunk_size != 64, K or V not 64 /
128, shapes, non-float dtypes) with the reason, and float32 q, k, v, Ainv.
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

from kda._mosaic_gpu import BF16, COL, F32, MAX_GRID_YZ, ROW, WG, aligned_cu_reason, last_row, skipping_tail
from kda._mosaic_gpu import params as _params
from kda._mosaic_gpu import packed_chunk, tile_shapes, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, split as _split, swz as _swz
from kda.stages.bwd_wy import Out
from kda.stages.gate import exponent

# Lane semantics (kda._mosaic_gpu.params): the same code as Warpgroup here (H200: the same time),
# lowered without layout inference (1.3 s instead of 2.0 on a CPU)
LANE = True

BT = 64
SLAB = 64                  # columns per tile
# Whether dq, dk, dgc (and dg_state where K == V) are written in place of S2's dqg, dkg, dw (du):
# each program reads those tiles of its chunk before it writes the same rows, so the kernel takes
# them as mutable refs (aliased in and out) and the backward's peak (this launch: S2's four terms
# and S3's float32 results live together) loses four [Ta, HV, K] float32 buffers. False: fresh ones.
INPLACE = True


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the bwd_wy kernel."""
  approx_math: bool = True   # Mosaic GPU's fast exp (ex2.approx): ~2^-22 relative
  # chunks at or past aligned_cu[-1] (given): zeros out, nothing read
  skip_tail: bool = True


def supports(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *,
             chunk_size, **_) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  reason, dims = tile_shapes(chunk_size, "k", k, "v", v)
  if reason is not None:
    return reason
  Ta, HV, K, V = dims
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  want = {"q": k.shape, "gc_int": k.shape, "gc_frac": k.shape, "dqg": k.shape, "dkg": k.shape,
          "dw": k.shape, "du": v.shape, "beta": (1, Ta, HV), "Ainv": (1, Ta, HV, BT),
          "dgc_last": (1, Ta // BT, HV, K)}
  given = dict(q=q, gc_int=gc_int, gc_frac=gc_frac, dqg=dqg, dkg=dkg, dw=dw, du=du, beta=beta,
               Ainv=Ainv, dgc_last=dgc_last)
  for name, shape in want.items():
    if tuple(given[name].shape) != tuple(shape):
      return f"{name} must have shape {tuple(shape)}, got {tuple(given[name].shape)}"
  for name, x in dict(given, k=k, v=v).items():
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return f"mosaic_gpu bwd_wy takes floating {name}, got {jnp.dtype(x.dtype).name}"
  return None if aligned_cu is None else aligned_cu_reason(aligned_cu)


def takes(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *,
          chunk_size, **_) -> Optional[str]:
  """The stage's predicate: `supports`, and q, k, v, Ainv in bfloat16 (the dtype policy: float32
  inputs keep float32 gradients on the reference; `apply` itself rounds float32 ones to bf16)."""
  reason = supports(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu,
                    chunk_size=chunk_size)
  if reason is not None:
    return reason
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("q", q), ("k", k), ("v", v), ("Ainv", Ainv))
         if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return ("mosaic_gpu bwd_wy takes bfloat16 q, k, v, Ainv (float32 would be rounded to bfloat16), "
            f"got {', '.join(bad)}")
  return None


def _body(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, dqg_g, dkg_g, dw_g, du_g, dgl_g,
          oq_g, ok_g, ov_g, odb_g, og_g, ogs_g, oa_g,
          q_s, k_s, v_s, a_s, t0, t1, t2, t3, l_s, bar, *, nk, nv, store_dv=None):
  h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  slab = lambda j: pl.ds(j * SLAB, SLAB)
  for j in range(nk):
    plgpu.copy_gmem_to_smem(q_g.at[rows, h, slab(j)], q_s.at[j], bar)
    plgpu.copy_gmem_to_smem(k_g.at[rows, h, slab(j)], k_s.at[j], bar)
  for j in range(nv):
    plgpu.copy_gmem_to_smem(v_g.at[rows, h, slab(j)], v_s.at[j], bar)
  plgpu.copy_gmem_to_smem(a_g.at[rows, h, :], a_s, bar)

  shape = (BT, SLAB)
  row, col = _iota(0, shape), _iota(1, shape)
  strict = col < row
  l_s[...] = jnp.where(strict, 1.0, 0.0).astype(BF16)       # L: the exclusive row cumsum
  beta = lax.broadcast_in_dim(_load(b_g.at[h, rows], ROW), shape, [0])
  at = lambda ref, j: ref.at[rows, h, slab(j)]
  last = lambda ref, j: last_row(ref, c, h, slab(j), shape)

  def put(x, *tiles):
    for t, part in zip(tiles, _split(x, len(tiles))):
      t[...] = part
    plgpu.commit_smem()

  aT = a_s.T
  plgpu.barrier_wait(bar)
  dAinv = plgpu.layout_cast(jnp.zeros(shape, F32), plgpu.Layout.WGMMA)
  dbeta = []
  for j in range(nv):
    put(_load(at(du_g, j)), t0, t1)                          # du
    dvb = _acc([(aT, t0), (aT, t1)], shape)
    vx = _load(v_s.at[j]).astype(F32)
    if store_dv is None:
      ov_g[rows, h, slab(j)] = (dvb * beta).astype(ov_g.dtype)
    else:
      store_dv(j, dvb * beta)
    dbeta.append(jnp.sum(dvb * vx, axis=1))
    put(beta * vx, t2, t3)                                   # vb
    dAinv = dAinv + _acc([(t0, t2.T), (t0, t3.T), (t1, t2.T)], shape)
  for j in range(nk):
    put(_load(at(dw_g, j)), t0, t1)             # dw
    dkb = _acc([(aT, t0), (aT, t1)], shape)
    gi, gf = _load(at(gi_g, j)), _load(at(gf_g, j))
    eg = jnp.exp(exponent(gi, gf))
    el = jnp.exp(exponent(last(gi_g, j), last(gf_g, j), gi, gf))
    kx, qx = _load(k_s.at[j]).astype(F32), _load(q_s.at[j]).astype(F32)
    dqg, dkg = _load(at(dqg_g, j)), _load(at(dkg_g, j))
    keg = kx * eg
    kb = beta * keg
    oq_g[rows, h, slab(j)] = dqg * eg
    ok_g[rows, h, slab(j)] = dkg * el + dkb * beta * eg
    og_g[rows, h, slab(j)] = dqg * qx * eg + dkb * kb
    dbeta.append(jnp.sum(dkb * keg, axis=1))
    put(kb, t2, t3)
    dAinv = dAinv + _acc([(t0, t2.T), (t0, t3.T), (t1, t2.T)], shape)
    put(dkg * (kx * el), t0, t1, t2)                         # dkg kg, in three terms
    before = _acc([(l_s, t0), (l_s, t1), (l_s, t2)], shape)
    dgl = _load(dgl_g.at[c, h, slab(j)], COL)
    ogs_g[rows, h, slab(j)] = before + lax.broadcast_in_dim(dgl, shape, [1])
  put(dAinv, t0, t1)
  p = _acc([(t0, aT), (t1, aT)], shape)                      # dAinv @ Ainv^T
  put(p, t2, t3)
  m = _acc([(aT, t2), (aT, t3)], shape)                      # Ainv^T @ that
  oa_g[rows, h, :] = jnp.where(strict, -m, 0.0)
  odb_g[h, rows] = functools.reduce(jnp.add, dbeta)


def _zeros(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, dqg_g, dkg_g, dw_g, du_g, dgl_g,
           oq_g, ok_g, ov_g, odb_g, og_g, ogs_g, oa_g, *scratch, nk, nv, dv=True):
  h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  slab = lambda j: pl.ds(j * SLAB, SLAB)
  z = zeros((BT, SLAB))
  for j in range(nv if dv else 0):
    ov_g[rows, h, slab(j)] = z.astype(ov_g.dtype)
  for j in range(nk):
    for o_g in (oq_g, ok_g, og_g, ogs_g):
      o_g[rows, h, slab(j)] = z
  oa_g[rows, h, :] = z
  odb_g[h, rows] = zeros((BT,), ROW)


def _packed_body(src_g, cnt_g, pieces_g, cu_g, *refs, nk, nv, tail_zeros=True):
  """Packed dv (`packed_chunk`, the stage is the last scratch): program (h, c) stores its chunk's dv
  rows packed and zeroes the gap pieces c, c + NTa, ... of dv's head h."""
  *refs, stage = refs
  ov_g = refs[14]
  h, c = lax.axis_index("h"), lax.axis_index("c")
  dst = lambda j: lambda ds: ov_g.at[ds, h, pl.ds(j * SLAB, SLAB)]
  packed_chunk(stage, src_g, cnt_g, pieces_g, cu_g, c,
               lambda store: _body(*refs, nk=nk, nv=nv, store_dv=lambda j, x: store(dst(j), x)),
               (lambda: _zeros(*refs, nk=nk, nv=nv, dv=False)) if tail_zeros else None,
               [dst(j) for j in range(nv)], BT)


def _inplace(body, n_lead, alias_du):
  """The body on the in-place operands: refs = the n_lead leading refs, the 12 inputs (dqg, dkg, dw,
  du mutable), the fresh outputs dv, dbeta^T, dAkk (and dg_state unless alias_du), the scratch; it
  calls `body` with the outputs dq, dk, dgc (dg_state) on dqg's, dkg's, dw's (du's) refs."""
  def wrapped(*refs):
    lead, ins, rest = refs[:n_lead], refs[n_lead:n_lead + 12], refs[n_lead + 12:]
    n_out = 3 if alias_du else 4
    (ov, odb, oa, *ogs), scratch = rest[:n_out], rest[n_out:]
    ogs = ins[10] if alias_du else ogs[0]
    return body(*lead, *ins, ins[7], ins[8], ov, odb, ins[9], ogs, oa, *scratch)
  return wrapped


@functools.lru_cache(maxsize=None)
def _kernel(Ta, HV, K, V, *, interpret, config, skip_tail=False, dv_dtype=F32, packed_T=None, tail_zeros=True,
            inplace=False):
  nk, nv = K // SLAB, V // SLAB
  out = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)
  body = functools.partial(_body, nk=nk, nv=nv)
  if packed_T is not None:
    body = functools.partial(_packed_body, nk=nk, nv=nv, **({} if tail_zeros else dict(tail_zeros=False)))
  elif skip_tail:
    body = skipping_tail(body, functools.partial(_zeros, nk=nk, nv=nv) if tail_zeros else None)
  stage = [] if packed_T is None else [plgpu.SMEM((BT, SLAB), dv_dtype)]
  Tv = Ta if packed_T is None else packed_T
  # dq, dk, dv, dbeta^T, dgc, dg_state, dAkk; in place: dv, dbeta^T, dAkk (dg_state where K != V)
  out_type = (out(Ta, HV, K), out(Ta, HV, K), out(Tv, HV, V, dtype=dv_dtype), out(HV, Ta), out(Ta, HV, K),
              out(Ta, HV, K), out(Ta, HV, BT))
  if inplace:
    body = _inplace(body, 4 if packed_T is not None else int(skip_tail), alias_du=K == V)
    out_type = out_type[2:4] + out_type[6:] + (() if K == V else out_type[5:6])
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(HV, Ta // BT), grid_names=("h", "c"),
      scratch_types=[
          _swz((nk, BT, SLAB)), _swz((nk, BT, SLAB)), _swz((nv, BT, SLAB)),   # q, k, v
          _swz((BT, BT)),                                                     # Ainv
          *[_swz((BT, SLAB)) for _ in range(4)],                              # work tiles
          _swz((BT, BT)),                                                     # L
          plgpu.Barrier(num_arrivals=2 * nk + nv + 1),
          *stage,                                                             # packed dv's stage
      ],
      compiler_params=_params(LANE, approx_math=config.approx_math),
      kernel_name="kda_bwd_wy" if packed_T is None else "kda_bwd_wy_packed", interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def apply(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *, chunk_size,
          dv_dtype=None, interpret=False, config=None, rows=None, pieces=None, T=None, tail_zeros=True):
  """The stage on the kernel. aligned_cu (optional): with Config(skip_tail=True) the chunks at or
  past aligned_cu[-1] get zeros without being read. dv_dtype: dv's dtype (float32 unless given; the
  kernel rounds it there, as the pipeline would right after).
  Packed dv (the unalign folded into its store): rows = padding.chunk_rows(layout), pieces =
  padding.gap_pieces(rows, aligned_cu, T, 64) and the packed length T (aligned_cu required): dv is
  [1, T, HV, V], chunk c's row r < count[c] at packed row src[c] + r, 0 at tokens of no sequence;
  the other outputs as without (the tail chunks' zeros included). tail_zeros=False (with the tail
  skipped): the outputs are left unwritten at the chunks at or past aligned_cu[-1] (for callers
  that never read them: the packed backward)."""
  reason = supports(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu,
                    chunk_size=chunk_size)
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_wy kernel: {reason}")
  config = config or Config()
  _, Ta, HV, K = k.shape
  V = v.shape[-1]
  bf = lambda x: x[0].astype(BF16)
  f32 = lambda x: x[0].astype(F32)
  packed = rows is not None
  if packed and (aligned_cu is None or pieces is None or not isinstance(T, int)):
    raise ValueError(f"mosaic_gpu bwd_wy kernel: packed dv (rows given) needs aligned_cu, pieces and a static "
                     f"int T, got aligned_cu {aligned_cu is not None}, pieces {pieces is not None}, T {T!r}")
  skip = config.skip_tail and aligned_cu is not None
  f = _kernel(Ta, HV, K, V, interpret=interpret, config=config, skip_tail=skip,
              dv_dtype=jnp.dtype(dv_dtype or F32), packed_T=T if packed else None,
              tail_zeros=bool(tail_zeros) or not (skip or packed), inplace=INPLACE)
  cu = (aligned_cu.astype(jnp.int32),) if skip or packed else ()
  if packed:
    cu = (rows.src, rows.count, pieces) + cu
  ins = (*cu, bf(q), bf(k), bf(v), bf(Ainv), beta[0].astype(F32).T, f32(gc_int), f32(gc_frac))
  terms = [f32(x) for x in (dqg, dkg, dw, du)]
  if INPLACE:     # where nothing else reads S2's terms, XLA writes the results into their buffers
    refs = [jax.new_ref(x) for x in terms]
    dv, dbeta, dAkk, *dg_state = f(*ins, *refs, f32(dgc_last))
    dq, dk, dgc, du_out = (jax.ref.freeze(r) for r in refs)
    dg_state = du_out if K == V else dg_state[0]
  else:
    dq, dk, dv, dbeta, dgc, dg_state, dAkk = f(*ins, *terms, f32(dgc_last))
  return Out(dq[None], dk[None], dv[None], dbeta.T[None], dgc[None], dg_state[None], dAkk[None])
