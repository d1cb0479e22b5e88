"""S2's terms formed inside S3 (K == V): one program per (slab p, value head h, chunk c).

S2's terms kernel (kda.stages.bwd_dh.mosaic_gpu) forms, for every chunk, dqg = scale do h^T,
dkg = v_new dh^T, dw = -du h^T and dgc_last = decay sum_V(h dh) and hands them to S3 through HBM.
Here program p forms its slab's columns of them from what S2's walk leaves: the chunk's h and dh
rows of slab p (the state's key channels p: [64, V] bf16 each), do, v_new and du ([64, V] bf16),
and goes on with the split kernel's formulas (kda.stages.bwd_wy.mosaic_gpu.split). The operands
arrive by TMA at the start on four barriers, awaited in order of first use:

    0: du's slab p, Ainv, v          dvb = Ainv^T du_p, dv = beta dvb, vb = beta v, dAinv_p = du_p vb^T
    1: h_p, du, gc_int, gc_frac, k   dw_p = -du h_p^T, dkb = Ainv^T dw_p, eg, kb, dAinv_p += dw_p kb^T,
                                     dAkk_p = strict_tril(-Ainv^T dAinv_p Ainv^T)
    2: do, q                         dqg_p = scale do h_p^T, dq = dqg_p eg, dgc = dqg_p q eg + dkb kb
    3: dh_p                          dgc_last_p = decay diag(h_p dh_p^T)
    4: v_new                         dkg_p = v_new dh_p^T, dk, el,
                                     dg_state = U dgc + L (dkg kg) + dgc_last_p

L is the strictly lower [64, 64] ones matrix (L x: x's exclusive cumsum over the chunk's rows) and
U = I + L^T (U x: x's inclusive reverse cumsum, the one bwd_gate applies to dgc), both 0/1 bf16
tiles. So the kernel hands dgc on inside dg_state and returns dgc = 0 (bwd_gate's
reverse_cumsum(dgc) + dg_state is unchanged): one [Ta, HV, K] float32 output fewer where the terms
kernel runs, the backward's peak (bwd_intra adds its dgc terms to the zeros). dgc waits for the
product in three bf16 terms (~2^-24 relative) over SMEM tiles no product reads by then (du's slab,
Ainv), as dkg kg enters the L product.

dw enters the products as one bf16 term (bwd_wy's cotangent_terms=1; the same rounding S3 gives
S2's float32 dw), du as the walk's bf16 du; every other float32 operand is split as in the split
kernel. Each program stores its parts of dbeta and dAkk ([K / 64, ...]); the launcher adds dbeta's
and hands dAkk's on as parts (bwd_intra adds them as it reads them) or sums them.

Packed (`apply(..., rows=, pieces=, T=)`, the packed backward's call): q, k, v and do are read from
their packed rows (chunk c's rows r < count[c] at packed row src[c] + r, into plain SMEM; the other
rows of a landed tile become 0, and with the clean flag non-finite values too), dv leaves to its
packed rows through a plain stage (kda._mosaic_gpu.packed_chunk), the chunks at or past
aligned_cu[-1] are neither read nor written. do's landing shares v_new's bytes, so v_new's TMA is
issued once do has been moved into its wgmma tiles.

SMEM per program (`smem_bytes`): 200 KiB aligned, 208 KiB packed (+ the reduction scratch and the
barriers), one CTA per SM.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, COL, F32, ROW, clean_flag, kept_rows, last_row, packed_chunk, packed_tile
from kda._mosaic_gpu import term_store
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, params as _params, split as _split
from kda._mosaic_gpu import MAX_GRID_YZ, smem_reason, smem_bytes as _smem_bytes, swz as _swz
from kda.stages.bwd_wy.mosaic_gpu.split import ainv_chain
from kda.stages.gate import exponent

BT = SLAB = 64


def scratch(V, packed=False, stage_dtype=None):
  """The kernel's scratch types; packed: plain q, k, v tiles, do's plain landing over v_new's tiles
  and dv's plain stage (in stage_dtype)."""
  nv = V // SLAB
  tile = (lambda: plgpu.SMEM((BT, SLAB), BF16)) if packed else (lambda: _swz((BT, SLAB)))
  slabs = lambda: _swz((nv, BT, SLAB))
  vn = plgpu.RefUnion(slabs(), plgpu.SMEM((nv, BT, SLAB), BF16)) if packed else slabs()
  return [
      tile(), tile(), tile(), _swz((BT, BT)),                          # q, k, v (slab p), Ainv
      _swz((BT, SLAB)),                                                # du's slab p
      plgpu.SMEM((BT, SLAB), F32), plgpu.SMEM((BT, SLAB), F32),        # gc_int, gc_frac
      slabs(), slabs(), slabs(), vn, slabs(),                          # h_p, dh_p, do, v_new, du by V slabs
      *[_swz((BT, SLAB)) for _ in range(4)], _swz((BT, BT)), _swz((BT, BT)),   # work tiles, L, U
      plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=2 * nv + 3),
      plgpu.Barrier(num_arrivals=nv + 1), plgpu.Barrier(num_arrivals=nv), plgpu.Barrier(num_arrivals=nv),
      *([plgpu.SMEM((BT, SLAB), stage_dtype)] if packed else []),
  ]


def smem_bytes(V, packed=False, stage_dtype=BF16):
  """Shared memory per program (dbeta's row sums reserve the reduction scratch)."""
  return _smem_bytes(scratch(V, packed, stage_dtype), reduction=True)


def reason(K, V, HV, packed=True):
  """None if the kernel takes head dims K, V and HV value heads, else the reason in words."""
  if K != V or K not in (64, 128):
    return f"the terms kernel takes K == V in (64, 128), got K={K}, V={V}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid y limit), got {HV}"
  return smem_reason(smem_bytes(V, packed), "bwd_wy terms")


def body(q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, h_g, dh_g, do_g, vn_g, du_g, dec_g,
         oq_g, ok_g, ov_g, odb_g, ogs_g, oa_g,
         q_s, k_s, v_s, a_s, dup_s, gi_s, gf_s, h_s, dh_s, do_s, vn_s, du_s, t0, t1, t2, t3, l_s, u_s, *bars,
         scale, store_dv=None, rows_qkv=None, rows_do=None, pairs=False):
  """Program (p, h, c). GMEM: q, k [Ta, HV, K], v [Ta, HV, V] bf16 (packed: [T, ...], rows_qkv);
  Ainv [Ta, HV, 64] bf16, beta^T [HV, Ta], gc_int, gc_frac [Ta, HV, K] f32; h, dh [NTa, HV, K, V],
  v_new, du [Ta, HV, V] bf16, do [Ta, HV, V] bf16 (packed: [T, HV, V], rows_do: (src, count, clean),
  vn_s then a (tiles, landing) union); dec [NTa, HV, K] f32 (exp(gc_last)). Out: dq, dk, dg_state
  [Ta, HV, K] f32 (dgc's reverse cumsum included), dv [Ta, HV, V] (store_dv: packed), dbeta
  [P, HV, Ta], dAkk [P, Ta, HV, 64].
  pairs: dq, dk are h's and dh's refs and take their slab pairs (kda._mosaic_gpu.slab_pair_store)
  over the rows of slab p, which only this program reads, once they have landed."""
  nv = h_s.shape[0]
  p, h, c = lax.axis_index("p"), lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  cols = pl.ds(pl.multiple_of(p * SLAB, SLAB), SLAB)
  slab = lambda j: pl.ds(j * SLAB, SLAB)
  at = lambda ref: ref.at[rows, h, cols]
  qkv = (lambda ref: ref.at[pl.ds(rows_qkv[0], BT), h, cols]) if rows_qkv is not None else at
  vn_t, land = vn_s if rows_do is not None else (vn_s, None)
  cp = plgpu.copy_gmem_to_smem
  cp(at(du_g), dup_s, bars[0]), cp(a_g.at[rows, h, :], a_s, bars[0]), cp(qkv(v_g), v_s, bars[0])
  for j in range(nv):
    cp(h_g.at[c, h, cols, slab(j)], h_s.at[j], bars[1])
    cp(du_g.at[rows, h, slab(j)], du_s.at[j], bars[1])
  cp(at(gi_g), gi_s, bars[1]), cp(at(gf_g), gf_s, bars[1]), cp(qkv(k_g), k_s, bars[1])
  do_rows = rows if rows_do is None else pl.ds(rows_do[0], BT)
  for j in range(nv):
    cp(do_g.at[do_rows, h, slab(j)], do_s.at[j] if land is None else land.at[j], bars[2])
  cp(qkv(q_g), q_s, bars[2])
  for j in range(nv):
    cp(dh_g.at[c, h, cols, slab(j)], dh_s.at[j], bars[3])
  issue_vn = lambda: [cp(vn_g.at[rows, h, slab(j)], vn_t.at[j], bars[4]) for j in range(nv)]
  if land is None:
    issue_vn()

  shape = (BT, SLAB)
  row, col = _iota(0, shape), _iota(1, shape)
  strict = col < row
  l_s[...] = jnp.where(strict, 1.0, 0.0).astype(BF16)       # L: the exclusive row cumsum
  u_s[...] = jnp.where(col >= row, 1.0, 0.0).astype(BF16)   # U = I + L^T: the inclusive reverse one
  beta = lax.broadcast_in_dim(_load(b_g.at[h, rows], ROW), shape, [0])
  tile = lambda x_s: packed_tile(x_s, row, rows_qkv)

  def put(x, *tiles):
    for t, part in zip(tiles, _split(x, len(tiles))):
      t[...] = part
    plgpu.commit_smem()

  aT = a_s.T
  plgpu.barrier_wait(bars[0])
  dvb = _acc([(aT, dup_s)], shape)
  vx = tile(v_s)
  if store_dv is None:
    ov_g[rows, h, cols] = (dvb * beta).astype(ov_g.dtype)
  else:
    store_dv(dvb * beta)
  dbeta = jnp.sum(dvb * vx, axis=1)
  put(beta * vx, t2, t3)                                     # vb
  dAinv = _acc([(dup_s, t2.T), (dup_s, t3.T)], shape)
  plgpu.barrier_wait(bars[1])
  put(-_acc([(du_s.at[j], h_s.at[j].T) for j in range(nv)], shape), t0)    # dw_p, one bf16 term
  dkb = _acc([(aT, t0)], shape)
  gate = lambda: jnp.exp(exponent(_load(gi_s), _load(gf_s)))
  keg = tile(k_s) * gate()
  dbeta = dbeta + jnp.sum(dkb * keg, axis=1)
  put(beta * keg, t2, t3)                                    # kb
  dAinv = dAinv + _acc([(t0, t2.T), (t0, t3.T)], shape)
  # dAkk's part first, so dAinv and the products' arrays are gone before the terms are formed
  oa_g[p, rows, h, :] = jnp.where(strict, -ainv_chain(put, dAinv, aT, (t0, t1, t2, t3), shape), 0.0)
  odb_g[p, h, rows] = dbeta
  plgpu.barrier_wait(bars[2])
  if land is not None:             # do's rows of the chunk (others 0) into its wgmma tiles; then v_new
    for j in range(nv):
      do_s.at[j][...] = kept_rows(_load(land.at[j]), row, rows_do)
    plgpu.commit_smem()            # also a warpgroup barrier: the landing is read before v_new's TMA
    issue_vn()
  dqg = scale * _acc([(do_s.at[j], h_s.at[j].T) for j in range(nv)], shape)
  eg = gate()                      # formed again (the same bits) rather than held through the products
  term_store(oq_g, c, h, rows, cols, dqg * eg, "slabs" if pairs else False)
  dgc_terms = (dup_s, a_s, t3)     # tiles no product reads any more (du's slab, Ainv), held to the end
  put(dqg * tile(q_s) * eg + dkb * (beta * (tile(k_s) * eg)), *dgc_terms)   # dgc, in three terms
  plgpu.barrier_wait(bars[3])
  hd = _acc([(h_s.at[j], dh_s.at[j].T) for j in range(nv)], shape)     # h_p dh_p^T: its diagonal
  dgl = _load(dec_g.at[c, h, cols], COL) * jnp.sum(jnp.where(row == col, hd, 0.0), axis=0)
  plgpu.barrier_wait(bars[4])
  dkg = _acc([(vn_t.at[j], dh_s.at[j].T) for j in range(nv)], shape)
  el = jnp.exp(exponent(last_row(gi_g, c, h, cols, shape), last_row(gf_g, c, h, cols, shape),
                        _load(gi_s), _load(gf_s)))
  term_store(ok_g, c, h, rows, cols, dkg * el + dkb * beta * gate(), "slabs" if pairs else False)
  put(dkg * (tile(k_s) * el), t0, t1, t2)                           # dkg kg, in three terms
  cums = _acc([(l_s, t0), (l_s, t1), (l_s, t2)] + [(u_s, t) for t in dgc_terms], shape)   # L (dkg kg) + U dgc
  ogs_g[rows, h, cols] = cums + lax.broadcast_in_dim(dgl, shape, [1])


def _packed_body(src_g, cnt_g, pieces_g, cu_g, clean_g, *refs, scale, pairs=False):
  """Packed q, k, v, do and dv (`packed_chunk`, the stage is the last scratch): program (p, h, c)
  stores its slab of its chunk's dv rows packed and zeroes the gap pieces c, c + NTa, ... of it."""
  *refs, stage = refs
  ov_g = refs[15]
  p, h, c = lax.axis_index("p"), lax.axis_index("h"), lax.axis_index("c")
  dst = lambda ds: ov_g.at[ds, h, pl.ds(pl.multiple_of(p * SLAB, SLAB), SLAB)]
  rows = (src_g[c], cnt_g[c], clean_g[0])
  packed_chunk(stage, src_g, cnt_g, pieces_g, cu_g, c,
               lambda store: body(*refs, scale=scale, rows_qkv=rows, rows_do=rows, pairs=pairs,
                                  store_dv=lambda x: store(dst, x)),
               None, [dst], BT)


@functools.lru_cache(maxsize=None)
def _kernel(Ta, HV, K, V, *, scale, interpret, approx_math, dv_dtype, packed_T=None, pairs=False):
  P = K // SLAB
  out = lambda *shape, dtype=F32: jax.ShapeDtypeStruct(shape, dtype)
  packed = packed_T is not None
  fn = functools.partial(_packed_body if packed else body, scale=scale, pairs=pairs)
  n_in = 13 + 5 * packed           # (src, count, pieces, aligned_cu, clean), q .. decay

  def wrapped(*refs):              # pairs: dq, dk over h's and dh's refs (inputs 7 and 8 after the lead)
    ins, rest = refs[:n_in], list(refs[n_in:])
    dqk = [ins[n_in - 6], ins[n_in - 5]] if pairs else [rest.pop(0), rest.pop(0)]
    return fn(*ins, *dqk, *rest)
  return plgpu.kernel(
      wrapped,
      out_type=((out(Ta, HV, K),) * 2 * (not pairs) + (out(packed_T or Ta, HV, V, dtype=dv_dtype), out(P, HV, Ta),
                out(Ta, HV, K), out(P, Ta, HV, BT))),
      grid=(P, HV, Ta // BT), grid_names=("p", "h", "c"),
      scratch_types=scratch(V, packed, dv_dtype),
      compiler_params=_params(lane=True, approx_math=approx_math),
      kernel_name="kda_bwd_wy_terms" if not packed else "kda_bwd_wy_terms_packed",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def apply(q, k, v, beta, gc_int, gc_frac, Ainv, h, dh, do, v_new, du, decay, aligned_cu=None, *, scale,
          dv_dtype=None, interpret=False, approx_math=False, rows=None, pieces=None, T=None, clean=None,
          dAkk_parts=False, pairs=False):
  """(dq, dk, dv, dbeta, dgc, dg_state, dAkk) of bwd_wy from S2's walk (dgc = 0: its reverse cumsum
  is in dg_state, which bwd_gate adds as it is): h, dh [1, NTa, HV, K, V],
  v_new, du [1, Ta, HV, V] bf16, decay [NTa, HV, K] (kda.stages.state.chunk_decay), do [1, Ta, HV,
  V]. Packed (rows, pieces, T, aligned_cu): q, k, v, do are the packed [1, T, ...] arrays and dv
  leaves packed [1, T, HV, V]; clean: non-finite values of q, k, v, do read as 0. dAkk_parts: dAkk
  as its slabs' parts [K // 64, Ta, HV, 64], else their sum [1, Ta, HV, 64]. pairs (K == V == 128):
  dq and dk come as slab pairs [1, NTa, HV, 128, K] bf16 (kda._mosaic_gpu: ~2^-17 relative) stored
  over h's and dh's buffers, so neither takes a float32 buffer of its own (h is not read after)."""
  _, Ta, HV, K = gc_int.shape
  V = v_new.shape[-1]
  if pairs and not K == V == 2 * BT:
    raise ValueError(f"mosaic_gpu bwd_wy terms kernel: pairs need K == V == {2 * BT}, got K={K}, V={V}")
  dv_dtype = jnp.dtype(dv_dtype or F32)
  bf = lambda x: x[0].astype(BF16)
  f32 = lambda x: x[0].astype(F32)
  packed = rows is not None
  f = _kernel(Ta, HV, K, V, scale=float(scale), interpret=interpret, approx_math=approx_math, dv_dtype=dv_dtype,
              packed_T=T if packed else None, pairs=bool(pairs))
  lead = ((rows.src.astype(jnp.int32), rows.count.astype(jnp.int32), pieces, aligned_cu.astype(jnp.int32),
           clean_flag(clean)) if packed else ())
  hr, dhr = (jax.new_ref(bf(x)) for x in (h, dh)) if pairs else (bf(h), bf(dh))
  outs = list(f(*lead, bf(q), bf(k), bf(v), bf(Ainv), beta[0].astype(F32).T, f32(gc_int), f32(gc_frac), hr, dhr,
                bf(do), bf(v_new), bf(du), decay.astype(F32)))
  dq, dk = (jax.ref.freeze(hr), jax.ref.freeze(dhr)) if pairs else (outs.pop(0), outs.pop(0))
  dv, dbeta, dgs, dAkk = outs
  dAkk = dAkk if dAkk_parts else jnp.sum(dAkk, 0)[None]
  return dq[None], dk[None], dv[None], jnp.sum(dbeta, 0).T[None], jnp.zeros_like(dgs)[None], dgs[None], dAkk
