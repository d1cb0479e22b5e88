"""bwd_recompute: the Pallas Mosaic GPU (Hopper) implementation; the math is in kda.stages.bwd_recompute.

The forward's gate kernel (gc in two parts) and state kernel (h, v_new) run again on the saved
inputs; between them one kernel of this module forms w, u, qg, kg from the SAVED Ainv (bf16, as the
forward's intra kernel stores it), as the reference S0 does: no Akk, no scores, no solve. Outputs
follow the dtype policy: gc float32; w, u, qg, kg, h, v_new bf16, as the forward's kernels store
them for bf16 inputs (the backward stages upcast what they read). The predicate `supports` is the
conjunction of the wy and state kernels' (bf16 q, k, v; chunk_size 64; K, V in {64, 128}; shapes;
SMEM) and, for packed g, the gate kernel's. Where the gate kernel refuses an aligned call (HV * K
not a multiple of 128: one thread per column) the XLA gate forms gc, as the forward's gate stage did
there, so the state walk still runs its kernel (the XLA state stage is a scan over every chunk).

The wy kernel: one program (one warpgroup) per (value head, chunk), grid (HV, NTa) with the chunks
on CUDA's grid x: q, k, v and Ainv by TMA into swizzled bf16 tiles (per 64-column slab), gc's two
parts from GMEM into registers, each slab's read while the tensor cores run the product before it;
eg = exp(gc), el = exp(gc_last - gc) (exponents <= 0), w = Ainv @ (beta k eg) and u = Ainv @ (beta
v) as wgmmas on hi + lo bf16 splits of the right-hand side (Ainv exact), qg = q eg, kg = k el; all
four rounded to bf16 and stored from swizzled SMEM tiles by TMA. SMEM (`smem_bytes`): 13 [64, 64]
bf16 tiles and a barrier at K = V = 128, 106504 bytes, two CTAs per SM. Packed q, k, v (`rows`, the
packed backward): each chunk's rows come by TMA from its first packed row into plain tiles (read
into registers only) and the rows past its count are taken as 0 by a select (another sequence's
tokens, maybe NaN), as align leaves them: the same bits as on the aligned copies. Lane lowering
semantics: the same code as Warpgroup here, lowered without layout inference. Against the forward's
w, u (formed from its float32 in-kernel inverse) the difference is the bf16 rounding of Ainv, ~2^-9
relative, the same the reference S0 sees.

Config.per_slab: one program per (value head, chunk, 64-column slab j), grid (HV, NTa * S) with S =
max(K, V) / 64 and a chunk's slabs side by side on grid x (their Ainv reads meet in L2): q, k, v's
slab j and Ainv by TMA, gc's slab j read into registers (and its decays formed) while those loads
fly, then u_j, then w_j, qg_j, kg_j, each stored from a tile its inputs have left (u over v's, w
over the split's hi tile). Six tiles, 49160 bytes of SMEM, and 146 registers (205 for the default,
compiled for an H200 in the packed backward): three programs per SM instead of two to hide the
loads' latency. The same arithmetic in the same order: the same bits.
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

from kda._mosaic_gpu import BF16, F32, MAX_GRID_YZ, ROW, aligned_cu_reason, copy_chunk_slabs, last_row
from kda._mosaic_gpu import live_chunk, packed_tile, tile_shapes, zeros
from kda._mosaic_gpu import acc as _acc, iota as _iota, load as _load, params as _params, split as _split, swz as _swz
from kda._mosaic_gpu import smem_bytes as _smem_bytes, smem_reason
from kda.stages.bwd_recompute import Out
from kda.stages.gate import exponent
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.gate import xla as gate_xla
from kda.stages.state import mosaic_gpu as state_mgpu

BT = SLAB = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the wy kernel (the gate and state kernels run in their default configs)."""
  approx_math: bool = True      # the wy kernel's exp: Mosaic GPU's ex2.approx (~2^-22 relative)
  # with aligned_cu: the wy kernel stores zeros at the chunks at or past aligned_cu[-1], reading
  # nothing of them
  skip_tail: bool = True
  # one program per (value head, chunk, 64-column slab) instead of per (value head, chunk): six
  # SMEM tiles instead of thirteen and one slab's registers, so three programs share an SM instead
  # of two to hide the loads' latency; Ainv is read once per slab. The same bits either way.
  per_slab: bool = False


def _wy_scratch(K, V, packed_qkv=False, per_slab=False):
  """The wy kernel's scratch types; packed_qkv: plain q, k, v tiles (TMA lands packed rows there;
  they are only read into registers, and qg, kg leave from them by TMA). per_slab: one slab of q,
  k, v, Ainv and the split operand; w and u leave from the split's hi tile and v's tile."""
  nk, nv = K // SLAB, V // SLAB
  if per_slab:
    tile = (lambda: plgpu.SMEM((BT, SLAB), BF16)) if packed_qkv else (lambda: _swz((BT, SLAB)))
    return [tile(), tile(), tile(), _swz((BT, BT)), _swz((BT, SLAB)), _swz((BT, SLAB)),
            plgpu.Barrier(num_arrivals=4)]
  tile = (lambda n: plgpu.SMEM((n, BT, SLAB), BF16)) if packed_qkv else (lambda n: _swz((n, BT, SLAB)))
  return [tile(nk), tile(nk), tile(nv),                                       # q, k, v
          _swz((BT, BT)),                                                     # Ainv
          _swz((nk, BT, SLAB)), _swz((nv, BT, SLAB)),                         # w, u
          _swz((BT, SLAB)), _swz((BT, SLAB)),                                 # split operand
          plgpu.Barrier(num_arrivals=2 * nk + nv + 1)]


def smem_bytes(K, V, probe=False, packed_qkv=False, per_slab=False):
  """Shared memory per wy program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates;
  the probe's row sums reserve the reduction scratch)."""
  return _smem_bytes(_wy_scratch(K, V, packed_qkv, per_slab), reduction=probe)


def _wy_reason(q, k, v, beta, Ainv, aligned_cu, packed_qkv=False) -> Optional[str]:
  """What the wy kernel takes: shapes, head dims, grid, SMEM, and bf16 q, k, v (the dtype policy:
  float32 inputs keep float32 accuracy on the reference; `wy_from_saved` itself rounds them). With
  packed_qkv, q, k, v are the aligned stand-ins of packed ones (`_aligned_qkv`)."""
  reason, dims = tile_shapes(BT, "k", k, "v", v)
  if reason is not None:
    return reason
  Ta, HV, K, V = dims
  if Ta % BT:
    return f"Ta must be a multiple of {BT}, got {Ta}"
  if HV > MAX_GRID_YZ:
    return f"HV must be <= {MAX_GRID_YZ} (a CUDA grid limit), got {HV}"
  for name, x, shape in (("q", q, k.shape), ("beta", beta, (1, Ta, HV)), ("Ainv", Ainv, (1, Ta, HV, BT))):
    if x is not None and tuple(x.shape) != tuple(shape):       # Ainv None: a predicate-only call
      return f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}"
  if aligned_cu is not None and (reason := aligned_cu_reason(aligned_cu)):
    return reason
  bad = [f"{n} {jnp.dtype(x.dtype).name}" for n, x in (("q", q), ("k", k), ("v", v))
         if jnp.dtype(x.dtype) != jnp.dtype(BF16)]
  if bad:
    return f"mosaic_gpu bwd_recompute takes bfloat16 q, k, v, got {', '.join(bad)}"
  return smem_reason(smem_bytes(K, V, probe=True, packed_qkv=packed_qkv), "bwd_recompute wy")


def _aligned_qkv(q, k, v, beta):
  """(reason or None, aligned stand-ins of packed q, k, v [1, T, HV, D]: beta's [1, Ta] rows)."""
  S = jax.ShapeDtypeStruct
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4 or x.shape[0] != 1 or x.shape[1] != k.shape[1]:
      return f"packed {name} must be [1, T, HV, D] with k's T, got shape {tuple(x.shape)}", None
  return None, tuple(S((1, beta.shape[1]) + x.shape[2:], x.dtype) for x in (q, k, v))


def supports(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
             use_gate_in_kernel, lower_bound, config=None, rows=None, qkv_packed=False, **_) -> Optional[str]:
  """The stage's predicate: None if the wy and state kernels take the call, else the first reason.
  rows (a padding.ChunkRows): g is packed [1, T, HV, K] and the gate kernel's packed mode is asked
  too (valid unused); aligned g takes the gate kernel or, where it refuses, the XLA gate. qkv_packed
  (with rows): q, k, v are packed [1, T, HV, D] too (the wy kernel reads them so). Ainv may be None
  (a question before the forward has run)."""
  del config                      # no switch changes what the kernels take
  gkw = dict(chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  S = jax.ShapeDtypeStruct
  if rows is not None and (reason := gate_mgpu.packed_takes(g, rows, A_log, dt_bias, **gkw)) is not None:
    return reason                 # aligned g: the XLA gate where the kernel refuses (`apply`)
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  if qkv_packed:
    if rows is None:
      return "packed q, k, v need rows (padding.ChunkRows)"
    reason, (q, k, v) = _aligned_qkv(q, k, v, beta)
    if reason is not None:
      return reason
  reason = _wy_reason(q, k, v, beta, Ainv, aligned_cu, qkv_packed)
  if reason is not None:
    return reason
  gc, kb = S(k.shape, F32), S(k.shape, BF16)
  return state_mgpu.takes(kb, kb, S(v.shape, BF16), gc, gc, initial_state, aligned_cu, chunk_size=chunk_size)


takes = supports                  # the name kda.stages.bwd_recompute registers

_BF16_FIELDS = ("w", "u", "qg", "kg", "h", "v_new")


def stores(q, k, v, *_, chunk_size, config=None, **__) -> dict:
  """The dtypes `apply` stores Out's fields in for these arguments (kda.stages.base): for bf16 q, k,
  v at the kernels' chunk and head dims, w, u, qg, kg (the wy kernel) and h, v_new (the state
  kernel) in bf16, gc in float32; otherwise nothing, since no kernel of the chain runs there and
  float32 keeps float32. A refusal by the gate kernel alone (HV * K not a multiple of 128) still
  names the bf16 fields: bwd_dav and bwd_dh take them."""
  del config
  if tile_shapes(chunk_size, "k", k, "v", v)[0] is not None:
    return {}
  if any(jnp.dtype(x.dtype) != jnp.dtype(BF16) for x in (q, k, v)):
    return {}
  return dict.fromkeys(_BF16_FIELDS, BF16)


def _leading_refs(refs, skip_tail, probe, packed_qkv):
  """(ChunkRows' src and count refs or None, aligned_cu's ref or None, the other refs with None for
  an absent probe output) of a wy body's refs."""
  qkv_rows = cu_g = None
  if packed_qkv:               # ChunkRows' src and count refs first: q, k, v are packed
    qkv_rows, refs = refs[:2], refs[2:]
  if skip_tail:                # aligned_cu's ref next: the chunks at or past aligned_cu[-1] store zeros
    cu_g, refs = refs[0], refs[1:]
  if not probe:                # no probe output: a stand-in nothing writes
    refs = refs[:11] + (None,) + refs[11:]
  return qkv_rows, cu_g, refs


def _schedule(compute, store, tiles, probe_zeros, live, tail_zeros):
  """A wy program's control flow: compute, then store the outputs from their SMEM `tiles`; with
  `live` (aligned_cu given), a chunk at or past aligned_cu[-1] reads nothing and stores zeros from
  the tiles (nothing at all if not tail_zeros: callers that never read the tail), and
  `probe_zeros` (None without a probe) writes the probe's zeros there whatever the other outputs'."""
  if live is None:
    compute()
    store()
    return
  if probe_zeros is not None:
    pl.when(jnp.logical_not(live))(probe_zeros)
  if not tail_zeros:

    @pl.when(live)
    def _():
      compute()
      store()
    return
  pl.when(live)(compute)

  @pl.when(jnp.logical_not(live))
  def _():
    z = zeros((BT, SLAB), dtype=BF16)
    for t in tiles:
      t[...] = z
  store()


def _wy_body(*refs, nk, nv, skip_tail=False, tail_zeros=True, probe=False, packed_qkv=False):
  qkv_rows, cu_g, refs = _leading_refs(refs, skip_tail, probe, packed_qkv)
  (q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, w_g, u_g, qg_g, kg_g, p_g,
   q_s, k_s, v_s, a_s, w_s, u_s, t0, t1, bar) = refs
  h, c = lax.axis_index("h"), lax.axis_index("c")
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  slab = lambda j: pl.ds(j * SLAB, SLAB)

  def store():
    plgpu.commit_smem()
    for j in range(nk):
      for src, dst in ((w_s, w_g), (q_s, qg_g), (k_s, kg_g)):
        plgpu.copy_smem_to_gmem(src.at[j], dst.at[rows, h, slab(j)])
    for j in range(nv):
      plgpu.copy_smem_to_gmem(u_s.at[j], u_g.at[rows, h, slab(j)])
    plgpu.wait_smem_to_gmem(0)

  def compute():
    _wy_compute(h, c, rows, slab, refs, nk, nv, qkv_rows)

  def probe_zeros():
    p_g[h, rows] = zeros((BT,), ROW)

  tiles = [x.at[j] for j in range(nk) for x in (w_s, q_s, k_s)] + [u_s.at[j] for j in range(nv)]
  _schedule(compute, store, tiles, probe_zeros if probe else None,
            live_chunk(cu_g, c, BT) if skip_tail else None, tail_zeros)


def _wy_compute(h, c, rows, slab, refs, nk, nv, qkv_rows=None):
  """The wy kernel's loads and arithmetic for chunk c: w, u, qg, kg into their SMEM tiles; with a
  probe ref, its rows get sum(0 * x) over the row's w, u, qg, kg (float32, before rounding): 0
  where they are all finite, NaN where one is not. qkv_rows (src, count refs): q, k, v are packed,
  chunk c's row r < count[c] at packed row src[c] + r (kda._mosaic_gpu.packed_tile)."""
  (q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, w_g, u_g, qg_g, kg_g, p_g,
   q_s, k_s, v_s, a_s, w_s, u_s, t0, t1, bar) = refs
  if qkv_rows is not None:
    qkv_rows = (qkv_rows[0][c], qkv_rows[1][c])
  qkv = rows if qkv_rows is None else pl.ds(qkv_rows[0], BT)
  copy_chunk_slabs(((q_g, q_s), (k_g, k_s), (v_g, v_s)), qkv, h, bar)
  plgpu.copy_gmem_to_smem(a_g.at[rows, h, :], a_s, bar)
  shape = (BT, SLAB)
  row = _iota(0, shape)
  tile = lambda x_s, j: packed_tile(x_s.at[j], row, qkv_rows)   # slab j of q, k or v, float32
  beta = lax.broadcast_in_dim(_load(b_g.at[h, rows], ROW), shape, [0])
  last = lambda ref, j: last_row(ref, c, h, slab(j), shape)
  seen = []                    # 0 * x of every output (probe): NaN exactly where x is not finite

  def kept(x):
    if p_g is not None:
      seen.append(x * 0.0)
    return x

  def times_a(x, ahead=None):
    """Ainv @ x, x float32 as a hi + lo split (Ainv is bf16: exact), and K slab `ahead`'s gc
    (None past the last), read while the tensor cores run the product."""
    t0[...], t1[...] = _split(x)
    plgpu.commit_smem()
    gc = lambda: (_load(gi_g.at[rows, h, slab(ahead)]), _load(gf_g.at[rows, h, slab(ahead)]))
    return _acc([(a_s, t0), (a_s, t1)], shape, gc if ahead is not None and ahead < nk else lambda: None)

  plgpu.barrier_wait(bar)
  for j in range(nv):
    u, ahead = times_a(beta * tile(v_s, j), 0 if j == nv - 1 else None)
    u_s.at[j][...] = kept(u).astype(BF16)
  for j in range(nk):
    gi, gf = ahead
    eg = jnp.exp(exponent(gi, gf))
    el = jnp.exp(exponent(last(gi_g, j), last(gf_g, j), gi, gf))
    kx, qx = tile(k_s, j), tile(q_s, j)
    kb = beta * kx * eg
    q_s.at[j][...] = kept(qx * eg).astype(BF16)     # qg, kg over q, k: both are in registers now
    k_s.at[j][...] = kept(kx * el).astype(BF16)
    w, ahead = times_a(kb, j + 1)
    w_s.at[j][...] = kept(w).astype(BF16)
  if p_g is not None:
    p_g[h, rows] = jnp.sum(functools.reduce(jnp.add, seen), axis=1)


def _wy_slab_body(*refs, nk, nv, skip_tail=False, tail_zeros=True, probe=False, packed_qkv=False):
  """`_wy_body` for one 64-column slab j of chunk c (Config.per_slab; grid axis "i" = c * S + j with
  S = max(nk, nv), the slabs of a chunk side by side): q, k, v's slab j (slab nk - 1 or nv - 1 where
  j is past K's or V's slabs: the same values stored twice) and Ainv by TMA; u_j = Ainv @ (beta v_j)
  then leaves from v's tile and w_j from the split's hi tile once their products have read them.
  The probe output is [S, HV, Ta], each slab's row sums (`wy_from_saved` adds them)."""
  qkv_rows, cu_g, refs = _leading_refs(refs, skip_tail, probe, packed_qkv)
  (q_g, k_g, v_g, a_g, b_g, gi_g, gf_g, w_g, u_g, qg_g, kg_g, p_g,
   q_s, k_s, v_s, a_s, t0, t1, bar) = refs
  S = max(nk, nv)
  h, i = lax.axis_index("h"), lax.axis_index("i")
  c, j = i // S, i % S
  jk, jv = jnp.minimum(j, nk - 1), jnp.minimum(j, nv - 1)
  rows = pl.ds(pl.multiple_of(c * BT, BT), BT)
  ck, cv = pl.ds(pl.multiple_of(jk * SLAB, SLAB), SLAB), pl.ds(pl.multiple_of(jv * SLAB, SLAB), SLAB)
  w_s = t0

  def store():
    plgpu.commit_smem()
    for src, dst in ((w_s, w_g), (q_s, qg_g), (k_s, kg_g)):
      plgpu.copy_smem_to_gmem(src, dst.at[rows, h, ck])
    plgpu.copy_smem_to_gmem(v_s, u_g.at[rows, h, cv])
    plgpu.wait_smem_to_gmem(0)

  def compute():
    cnt = None if qkv_rows is None else (qkv_rows[0][c], qkv_rows[1][c])     # first packed row, count
    src = rows if cnt is None else pl.ds(cnt[0], BT)
    for g, x_s, cols in ((q_g, q_s, ck), (k_g, k_s, ck), (v_g, v_s, cv)):
      plgpu.copy_gmem_to_smem(g.at[src, h, cols], x_s, bar)
    plgpu.copy_gmem_to_smem(a_g.at[rows, h, :], a_s, bar)
    shape = (BT, SLAB)
    row = _iota(0, shape)
    tile = lambda x_s: packed_tile(x_s, row, cnt)
    beta = lax.broadcast_in_dim(_load(b_g.at[h, rows], ROW), shape, [0])
    seen = None              # 0 * x summed over the outputs (probe): NaN exactly where one is not finite

    def kept(x):
      nonlocal seen
      if p_g is not None:
        seen = x * 0.0 if seen is None else x * 0.0 + seen
      return x

    def times_a(x):
      t0[...], t1[...] = _split(x)
      plgpu.commit_smem()
      return _acc([(a_s, t0), (a_s, t1)], shape)

    # slab jk's gc and its decays while the TMA loads fly (its loads wait on no product)
    gi, gf = _load(gi_g.at[rows, h, ck]), _load(gf_g.at[rows, h, ck])
    last = lambda ref: last_row(ref, c, h, ck, shape)
    eg, el = jnp.exp(exponent(gi, gf)), jnp.exp(exponent(last(gi_g), last(gf_g), gi, gf))
    plgpu.barrier_wait(bar)
    u = times_a(beta * tile(v_s))
    v_s[...] = kept(u).astype(BF16)       # v is in registers no more: its tile takes u
    q_s[...] = kept(tile(q_s) * eg).astype(BF16)
    kx = tile(k_s)
    k_s[...] = kept(kx * el).astype(BF16)
    w = times_a(beta * kx * eg)
    w_s[...] = kept(w).astype(BF16)             # the product has read the split: its hi tile takes w
    if p_g is not None:
      p_g[j, h, rows] = jnp.sum(seen, axis=1)

  def probe_zeros():
    p_g[j, h, rows] = zeros((BT,), ROW)

  _schedule(compute, store, (w_s, q_s, k_s, v_s), probe_zeros if probe else None,
            live_chunk(cu_g, c, BT) if skip_tail else None, tail_zeros)


@functools.lru_cache(maxsize=None)
def _wy_kernel(Ta, HV, K, V, *, interpret, approx_math, skip_tail=False, tail_zeros=True, probe=False,
               packed_qkv=False, per_slab=False):
  out = lambda D: jax.ShapeDtypeStruct((Ta, HV, D), BF16)
  nk, nv = K // SLAB, V // SLAB
  S = max(nk, nv)
  body, grid, names, probe_shape = ((_wy_slab_body, (HV, S * (Ta // BT)), ("h", "i"), (S, HV, Ta)) if per_slab
                                    else (_wy_body, (HV, Ta // BT), ("h", "c"), (HV, Ta)))
  return plgpu.kernel(
      functools.partial(body, nk=nk, nv=nv, skip_tail=skip_tail, tail_zeros=tail_zeros,
                        probe=probe, packed_qkv=packed_qkv),
      out_type=(out(K), out(V), out(K), out(K))                   # w, u, qg, kg
      + ((jax.ShapeDtypeStruct(probe_shape, F32),) if probe else ()),   # the finiteness probe
      grid=grid, grid_names=names,
      scratch_types=_wy_scratch(K, V, packed_qkv, per_slab),
      compiler_params=_params(lane=True, approx_math=approx_math),
      kernel_name="kda_bwd_recompute_wy", interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def wy_from_saved(q, k, v, beta, gc_int, gc_frac, Ainv, aligned_cu=None, *, interpret=False, config=None,
                  tail_zeros=True, probe=False, rows=None):
  """(w, u, qg, kg) [1, Ta, HV, D] bf16 from the saved Ainv: reference.wy_from_inverse's formulas
  on the wy kernel (module docstring). q, k, v, Ainv are cast to bf16. With aligned_cu and
  Config.skip_tail the chunks at or past aligned_cu[-1] store zeros (tail_zeros=False: nothing),
  nothing of them read. probe: a fifth output, [HV, Ta] float32, 0 at the rows whose w, u, qg, kg
  are all finite and NaN elsewhere (0 at the tail). rows (padding.ChunkRows): q, k, v are packed
  [1, T, HV, D], chunk c's row r < count[c] read from packed row src[c] + r and the chunk's other
  rows taken as 0 (the align folded into the loads: the same bits as on their aligned copies)."""
  config = config or Config()
  _, Ta, HV, _ = Ainv.shape
  K, V = k.shape[-1], v.shape[-1]
  bf = lambda x: x[0].astype(BF16)
  skip = config.skip_tail and aligned_cu is not None
  f = _wy_kernel(Ta, HV, K, V, interpret=interpret, approx_math=config.approx_math, skip_tail=skip,
                 tail_zeros=bool(tail_zeros) or not skip, probe=bool(probe), packed_qkv=rows is not None,
                 per_slab=config.per_slab)
  cu = (aligned_cu.astype(jnp.int32),) if skip else ()
  if rows is not None:
    cu = (rows.src.astype(jnp.int32), rows.count.astype(jnp.int32)) + cu
  outs = f(*cu, bf(q), bf(k), bf(v), bf(Ainv), beta[0].astype(F32).T, gc_int[0].astype(F32), gc_frac[0].astype(F32))
  if probe and config.per_slab:
    outs = outs[:4] + (jnp.sum(outs[4], axis=0),)
  return tuple(x[None] for x in outs[:4]) + tuple(outs[4:])


def apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu, *, chunk_size,
          use_gate_in_kernel, lower_bound, interpret=False, config=None, zero_h0=False, rows=None,
          tail_zeros=True, seg=None, probe=False, qkv_packed=False):
  """The stage on the gate, wy and state kernels (Ainv required: the forward's saved inverse).
  zero_h0: initial_state is known to be zero; the state kernel then neither reads it nor stores the
  final state (the stage never returns it). rows (a padding.ChunkRows): g is PACKED [1, T, HV, K]
  (raw, not neutralised; valid is unused) and the gate kernel's packed mode reads it (the align
  folded into its load: the same gc bit for bit). tail_zeros=False: the wy kernel leaves w, u, qg,
  kg and (with rows) the gate kernel gc_int, gc_frac unwritten at the chunks at or past
  aligned_cu[-1] (callers that never read them there: the packed backward). seg (with rows;
  kda.pipeline.segment_rows of a segmented layout): the gate kernel takes the gate as -inf at its
  resets, as the packed forward does (the wy kernel reads the saved Ainv, which has them).
  probe=True: (Out, finite) with finite a () bool, whether every w, u, qg, kg the wy kernel formed
  was finite before rounding (kda.confine: they hold every input of every token), at one row sum per
  token and head. qkv_packed (with rows): q, k, v are packed [1, T, HV, D] as well, and the wy
  kernel reads them so (`wy_from_saved`): their aligned copies are never formed."""
  config = config or Config()
  gkw = dict(chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  if rows is not None:       # the packed g stands in for the aligned one in the shape checks
    reason = supports(q, k, v, g, beta, None, A_log, dt_bias, Ainv, initial_state, aligned_cu, rows=rows,
                      qkv_packed=qkv_packed, **gkw)
  else:
    reason = supports(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, initial_state, aligned_cu,
                      qkv_packed=qkv_packed, **gkw)
  if reason is None and Ainv is None:
    reason = "Ainv (the forward's saved inverse) is required"
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_recompute: {reason}")
  if rows is not None:
    gt = gate_mgpu.packed(g, rows, A_log, dt_bias, interpret=interpret, tail_zeros=tail_zeros,
                          **({} if seg is None else dict(seg=seg)), **gkw)
  elif gate_mgpu.takes(g, valid, A_log, dt_bias, **gkw) is None:
    gt = gate_mgpu.apply(g, valid, A_log, dt_bias, interpret=interpret, **gkw)
  else:                      # e.g. HV * K = 64: the forward's gate stage ran XLA there too
    gt = gate_xla.apply(g, valid, A_log, dt_bias, **gkw)
  w, u, qg, kg, *pr = wy_from_saved(q, k, v, beta, gt.gc_int, gt.gc_frac, Ainv, aligned_cu, interpret=interpret,
                                    config=config, tail_zeros=tail_zeros, probe=probe,
                                    rows=rows if qkv_packed else None)
  elide = dict(zero_h0=True, store_final=False) if zero_h0 else {}
  st = state_mgpu.apply(kg, w, u, gt.gc_int, gt.gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                        interpret=interpret, **elide)
  out = Out(gt.gc_int, gt.gc_frac, w, u, qg, kg, st.h, st.v_new)
  return (out, jnp.all(pr[0] == 0)) if probe else out
