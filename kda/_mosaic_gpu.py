"""What the Pallas Mosaic GPU (Hopper) kernels share: layouts, SMEM tiles, wgmma helpers, limits.

Register arrays live in the WGMMA layout, SMEM tiles are tiled and swizzled along their minor dim
for TMA and wgmma operands, and accumulators are read back into registers (which waits for the
wgmma). `smem_bytes` sizes a kernel's scratch the way Mosaic GPU lays it out, so that a launcher
and its predicate share one figure.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda import _lowering_cache, _precompile
from kda.padding.layout import search_left

_lowering_cache.install()   # each kda kernel lowered once per process, whatever program calls it
_precompile.install()       # kda's kernels compile on worker threads while the program lowers

F32, BF16 = jnp.float32, jnp.bfloat16
WG = plgpu.Layout.WGMMA              # register layout of a [M, N] wgmma tile (M % 64 == 0)
ROW = plgpu.Layout.WGMMA.reduce(1)   # [M] vector, one value per row of a WGMMA [M, N] tile
COL = plgpu.Layout.WGMMA.reduce(0)   # [N] vector, one value per column
HEAD_DIMS = (64, 128)                # K and V the kernels take
MAX_GRID_YZ = 65535                  # CUDA's limit on grid y and z (Mosaic GPU's g0, g1)
SMEM_LIMIT = 232448                  # shared memory one block may opt in to on the H100 / H200 (227 KiB)
SMEM_ALIGN = 1024                    # Mosaic GPU starts every SMEM scratch buffer at a multiple of this
BARRIER_BYTES = 8                    # one mbarrier


def params(lane, **kw):
  """plgpu.CompilerParams with Lane lowering semantics if `lane`, else Warpgroup; kw as theirs.
  Lane lowers without layout inference (most of the CUDA lowering time of a large kernel), but
  stores a register array to SMEM through a swap that loads the old value first (one ldmatrix per
  stmatrix): the kernels whose Lane code is the same as their Warpgroup code take Lane."""
  sem = plgpu.LoweringSemantics.Lane if lane else plgpu.LoweringSemantics.Warpgroup
  return plgpu.CompilerParams(lowering_semantics=sem, **kw)


def smem_bytes(scratch, reduction=False):
  """The SMEM a kernel with these scratch_types asks for, laid out as Mosaic GPU lays it out: each
  SMEM buffer (a RefUnion: its largest member group) from a SMEM_ALIGN boundary, then the barriers;
  `reduction`: the body reduces across warps, whose scratch (CompilerParams.reduction_scratch_bytes)
  comes on top."""
  size = barriers = 0
  for leaf in jax.tree.leaves(scratch):
    if isinstance(leaf, plgpu.Barrier):
      n = leaf.num_barriers
      barriers += math.prod(n) if isinstance(n, tuple) else n
    else:
      size += -(-math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // SMEM_ALIGN) * SMEM_ALIGN
  if reduction:
    size += -(-plgpu.CompilerParams().reduction_scratch_bytes // SMEM_ALIGN) * SMEM_ALIGN
  return size + BARRIER_BYTES * barriers


def smem_reason(need, kernel=None):
  """None if a kernel asking for `need` bytes of SMEM fits one block, else the reason with the figures."""
  if need > SMEM_LIMIT:
    return f"{f'the {kernel} kernel ' if kernel else ''}needs {need} bytes of shared memory, the limit is {SMEM_LIMIT}"
  return None


def swz(shape, dtype=BF16, cols=None):
  """SMEM tiled + swizzled along its minor dim, as TMA and wgmma operands want it; `cols` caps the
  tile width (so column-slab views stay whole tiles)."""
  item = jnp.dtype(dtype).itemsize
  sw = plgpu.find_swizzle(min(shape[-1], cols or shape[-1]) * item * 8)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, sw // item)),
                                              plgpu.SwizzleTransform(sw)))


def load(ref, layout=WG):
  """SMEM or GMEM ref -> registers in `layout`."""
  return plgpu.load(ref, layout=layout, optimized=False)


def acc(pairs, shape, during=None):
  """sum(a @ b for a, b in pairs) on the tensor cores (SMEM operands, .T views allowed), float32
  result in registers. during: a function called after the wgmmas are issued and before their
  result is read, so its work (loads of later operands; it must not write SMEM the products read)
  runs while the tensor cores do; then (result, during's value) is returned."""
  def scoped(acc_ref):
    for a, b in pairs:
      plgpu.wgmma(acc_ref, a, b)
    if during is None:
      return acc_ref[...]        # reading the accumulator waits for the wgmmas
    extra = during()
    return acc_ref[...], extra
  return pl.run_scoped(scoped, plgpu.ACC(shape, F32))


def mm(a, b, shape):
  """a @ b on the tensor cores, float32 result in registers."""
  return acc([(a, b)], shape)


def iota(dim, shape):
  """int32 index along `dim` of a WGMMA-layout [M, N] array."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WG)


def split(x, parts=2):
  """float32 x -> `parts` bf16 terms summing to x, to ~2^-16 relative for (hi, lo) and ~2^-24 for
  three: operands of exact-ish wgmmas."""
  out = []
  for _ in range(parts - 1):
    hi = x.astype(BF16)
    out.append(hi)
    x = x - hi.astype(F32)
  return (*out, x.astype(BF16))


def head_dims_reason(K, V):
  """None if the kernels take head dims K, V, else the reason."""
  if K not in HEAD_DIMS:
    return f"K must be one of {HEAD_DIMS}, got {K}"
  if V not in HEAD_DIMS:
    return f"V must be one of {HEAD_DIMS}, got {V}"
  return None


def bf16_reason(kernel, **named):
  """The dtype policy of the kernels whose operands are bf16: None if every named array is bf16,
  else the reason (float32 ones would be rounded to bf16, below the float32 accuracy promised for
  float32 inputs)."""
  if all(jnp.dtype(x.dtype) == jnp.dtype(BF16) for x in named.values()):
    return None
  return (f"mosaic_gpu {kernel} takes bfloat16 {', '.join(named)} (float32 would be rounded to bfloat16), "
          f"got {', '.join(f'{n} {jnp.dtype(x.dtype).name}' for n, x in named.items())}")


def tile_shapes(chunk_size, k_name, kx, v_name, vx):
  """The predicates' common prologue: chunk 64, `kx` [1, Ta, HV, K], `vx` [1, Ta, HV, V] with K, V
  head dims the kernels take -> (reason or None, (Ta, HV, K, V) or None)."""
  if chunk_size != 64:
    return f"chunk_size must be 64, got {chunk_size}", None
  if kx.ndim != 4 or kx.shape[0] != 1:
    return f"{k_name} must be [1, Ta, HV, K], got shape {kx.shape}", None
  _, Ta, HV, K = kx.shape
  if vx.ndim != 4 or vx.shape[:3] != (1, Ta, HV):
    return f"{v_name} must be [1, Ta, HV, V] with {k_name}'s Ta, HV, got {vx.shape}", None
  V = vx.shape[-1]
  reason = head_dims_reason(K, V)
  return reason, (None if reason else (Ta, HV, K, V))


def tail_share(cu_g, N, NTa, r, BT=64, programs=None):
  """(first, count): the chunks at or past aligned_cu[-1] (read from the GMEM ref cu_g [N+1]) that
  grid rank r of `programs` (None: N) takes, round-robin, the last rank first: chunks first,
  first + programs, ..., count of them."""
  P = N if programs is None else programs
  first = cu_g[N] // BT + (P - 1 - r)
  return first, jnp.maximum(NTa - first + P - 1, 0) // P


def aligned_cu_reason(aligned_cu):
  """The predicates' check of aligned_cu: None if it is a 1-D integer array, else the reason."""
  if aligned_cu.ndim != 1 or not jnp.issubdtype(aligned_cu.dtype, jnp.integer):
    return f"aligned_cu must be a 1-D integer array, got {aligned_cu.dtype}{list(aligned_cu.shape)}"
  return None


def live_chunk(cu_g, c, BT=64):
  """Whether chunk c lies before aligned_cu[-1] (cu_g: aligned_cu's GMEM ref [N+1]); the chunks at
  or past it hold no token (the tail of a static-bound layout)."""
  return c < cu_g[cu_g.shape[0] - 1] // BT


def skipping_tail(body, zeros, BT=64, axis="c"):
  """A kernel body taking aligned_cu's GMEM ref [N+1] first: `body(*refs)` on the chunks before
  aligned_cu[-1] (grid axis `axis` is the chunk), `zeros(*refs)` (the outputs' zeros, nothing read)
  on the chunks at or past it, which hold no token (the tail of a static-bound layout); zeros None:
  nothing there (the outputs' tail rows stay unwritten, for callers that never read them)."""
  def wrapped(cu_g, *refs):
    live = live_chunk(cu_g, lax.axis_index(axis), BT)
    pl.when(live)(lambda: body(*refs))
    if zeros is not None:
      pl.when(jnp.logical_not(live))(lambda: zeros(*refs))
  return wrapped


def with_absent(body, absent):
  """A kernel body whose refs at the (ascending) positions `absent` are None: those inputs or
  outputs are left out of the kernel (a state known to be zero, a result nobody reads)."""
  def wrapped(*refs):
    refs = list(refs)
    for i in sorted(absent):
      refs.insert(i, None)
    return body(*refs)
  return wrapped


def zeros(shape, layout=None, dtype=F32):
  """Zeros in registers (float32 unless `dtype`), WGMMA layout (or `layout`)."""
  return plgpu.layout_cast(jnp.zeros(shape, dtype), layout or WG)


def sequence_order(aligned_cu, longest_first=True):
  """[N] int32: the sequence each grid rank takes, the longest first (stable), so the programs of
  the longest sequence start first and the short ones fill in behind them."""
  N = aligned_cu.shape[0] - 1
  if not longest_first:
    return jnp.arange(N, dtype=jnp.int32)
  return jnp.argsort(aligned_cu[:-1] - aligned_cu[1:], stable=True).astype(jnp.int32)


def sequence_groups(aligned_cu, NTa, G, BT=64):
  """Grouped walks: None where G is 0 or P = cdiv(NTa, G) is not below N, else ([P] int32 the groups
  by descending chunk count, [P + 1] int32 each group's first sequence, then N). Group p holds the
  consecutive sequences whose first chunk lies in [p * G, (p + 1) * G), so its program walks at most
  G chunks plus its last sequence's, and P programs replace N; N-sized XLA ops."""
  N = aligned_cu.shape[0] - 1
  if not G or -(-NTa // G) >= N:
    return None
  P = -(-NTa // G)
  c0 = aligned_cu[:-1] // BT
  lo = search_left(c0, jnp.arange(P, dtype=jnp.int32) * G).astype(jnp.int32)
  bounds = jnp.concatenate([lo, jnp.full((1,), N, jnp.int32)])
  work = aligned_cu[bounds[1:]] - aligned_cu[bounds[:-1]]
  return jnp.argsort(-work, stable=True).astype(jnp.int32), bounds


def walk_order(aligned_cu, NTa, G, longest_first=True, BT=64):
  """A walk kernel's (order, bounds): sequence_groups' groups where they apply (G chunks a window),
  else (sequence_order, None), one program per sequence."""
  groups = sequence_groups(aligned_cu, NTa, G, BT)
  return groups if groups is not None else (sequence_order(aligned_cu, longest_first), None)


def walk_range(order_g, grp_g, cu_g, r):
  """A walk program's (first sequence, end sequence, bos, eos): rank r takes the group order_g[r],
  the sequences [grp[g], grp[g + 1]) (grouped: grp_g the [P + 1] ref of sequence_groups), else the
  one sequence order_g[r] (grp_g None; end sequence None); bos, eos from cu_g (aligned_cu): their
  chunks' rows."""
  if grp_g is None:
    n = order_g[r]
    return n, None, cu_g[n], cu_g[n + 1]
  g = order_g[r]
  n_lo, n_hi = grp_g[g], grp_g[g + 1]
  return n_lo, n_hi, cu_g[n_lo], cu_g[n_hi]


def copy_chunk_slabs(pairs, rows, h, bar, slab=64):
  """TMA one chunk's rows of head h into SMEM by 64-column slabs: each (gmem [Ta, HV, D], smem
  [D // slab, BT, slab]) pair, every copy arriving on `bar` (one arrival per slab)."""
  for g, s in pairs:
    for j in range(s.shape[0]):
      plgpu.copy_gmem_to_smem(g.at[rows, h, pl.ds(j * slab, slab)], s.at[j], bar)


def last_row(ref, c, h, cols, shape, BT=64):
  """Row BT - 1 of chunk c (head h, columns cols) of a GMEM [Ta, HV, D] ref, broadcast over the rows
  of a WGMMA `shape` tile (e.g. gc at the chunk's last token)."""
  return lax.broadcast_in_dim(load(ref.at[c * BT + BT - 1, h, cols], COL), shape, [1])


def store_rows(stage, dst, row, n):
  """TMA stores of stage rows [0, n) to dst(pl.ds(row, n)) for a traced n in [0, stage rows]: one
  statically sized store per set bit of n (64, 32, ..., 1 rows) at increasing offsets, each under
  pl.when, so that no row past row + n - 1 is written (another program's sequence may start there).
  The stage is plain SMEM (TMA takes any row count and GMEM row there)."""
  b = stage.shape[0]
  while b >= 1:
    off = n & ~(2 * b - 1)                              # the higher bits' rows, stored before

    @pl.when((n & b) != 0)
    def _(b=b, off=off):
      plgpu.copy_smem_to_gmem(stage.at[pl.ds(off, b)], dst(pl.ds(row + off, b)))
    b //= 2


def stage_rows(stage, x, dst, row, n):
  """Registers x -> the plain SMEM stage -> rows [row, row + n) of dst (`store_rows`), after the
  stage's previous stores have read it."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  stage[...] = x.astype(stage.dtype)
  plgpu.commit_smem()
  store_rows(stage, dst, row, n)


def zero_gap_pieces(pieces_g, c, programs, stage, dsts):
  """Program c of `programs` writes zeros to the packed gap pieces c, c + programs, ... of
  padding.gap_pieces (pieces_g [2, P] int32 in GMEM: first row, count; the used pieces come first)
  in every dst(ds) of `dsts`, from the plain SMEM stage (zeroed here only by a program that has a
  piece): tokens of no sequence get exact zeros."""
  P = pieces_g.shape[1]

  def piece(m, carry):
    p = c + m * programs
    first, n = pieces_g[0, p], pieces_g[1, p]
    for dst in dsts:
      store_rows(stage, dst, first, n)
    return carry

  @pl.when((c < P) & (pieces_g[1, jnp.minimum(c, P - 1)] > 0))
  def _():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = plgpu.layout_cast(jnp.zeros(stage.shape, F32), WG).astype(stage.dtype)
    plgpu.commit_smem()
    lax.fori_loop(0, (P - c + programs - 1) // programs, piece, 0)


def packed_tile(tile_s, row, rows=None):
  """A [64, 64] tile of a chunk in registers, float32. rows (src, count[, clean]): the tile came from
  packed rows src.. src + 63 (a TMA load into plain SMEM: any row), of which only r < count are the
  chunk's; the others (another sequence's tokens, maybe NaN, or the TMA's zero fill past T) become
  0, as the aligned layout's padding is; with a clean flag that is not 0, so do the non-finite
  values (kda.confine's rerun, on inputs as it cleans them). row: the tile's row iota (WGMMA
  layout)."""
  x = load(tile_s).astype(F32)
  return x if rows is None else kept_rows(x, row, rows)


def clean_flag(clean=None):
  """The clean flag kernels read ([1] int32 GMEM): 1 where `clean` (a bool, traced or not)."""
  return jnp.asarray(False if clean is None else clean, jnp.int32).reshape(1)


def kept_rows(x, row, rows):
  """x (registers) with its rows past rows[1] (count) set to 0 and, where a clean flag rows[2] is
  given and not 0, its non-finite values too (`packed_tile`)."""
  keep = row < rows[1]
  if len(rows) > 2:
    keep = keep & ((jnp.abs(x) < jnp.inf) | (rows[2] == 0))
  return jnp.where(keep, x, jnp.zeros((), x.dtype))


def packed_chunk(stage, src_g, cnt_g, pieces_g, cu_g, c, body, tail, dsts, BT=64):
  """Chunk c of a kernel whose packed outputs leave through the plain SMEM `stage`: on the chunks
  before aligned_cu[-1], body(store) with store(dst, x) putting the registers x of the chunk's rows
  r < count[c] on packed rows src[c] + r of dst(ds) (`stage_rows`); on the others tail() (None:
  nothing); then the program zeroes its gap pieces (`zero_gap_pieces`) in every dst of `dsts` and
  waits for its TMA stores. src_g, cnt_g: padding.ChunkRows' [NTa] refs, pieces_g: gap_pieces'."""
  src, cnt = src_g[c], cnt_g[c]
  live = live_chunk(cu_g, c, BT)
  pl.when(live)(lambda: body(lambda dst, x: stage_rows(stage, x, dst, src, cnt)))
  if tail is not None:
    pl.when(jnp.logical_not(live))(tail)
  zero_gap_pieces(pieces_g, c, src_g.shape[0], stage, dsts)
  plgpu.wait_smem_to_gmem(0)          # every TMA store has landed before the program exits


# Pairs: a float32 [Ta, HV, D] operand held as its two bf16 terms (`split`) per chunk and head, in a
# bf16 [NTa, HV, 2 * BT, D] array: rows [0, BT) of [c, h] are chunk c's hi terms, rows [BT, 2 BT)
# its lo terms (~2^-17 relative together). Where D == 2 * BT that is the shape and dtype of a
# per-chunk [K, V] bf16 state (S0's h, S2's dh), so a kernel can store a pair over a state whose
# chunk it has already read.

def pair_tile(tile, BT=64):
  """A pair's [2 BT, cols] tile (GMEM or SMEM ref) -> float32 [BT, cols], hi + lo (WGMMA layout)."""
  hi, lo = (load(tile.at[pl.ds(i * BT, BT)]).astype(F32) for i in range(2))
  return hi + lo


def pair_load(ref, c, h, cols, BT=64):
  """Chunk c, head h, columns `cols` of a pair ref, float32 [BT, cols] (WGMMA layout)."""
  return pair_tile(ref.at[c, h, :, cols], BT)


def pair_store(ref, c, h, cols, x, BT=64):
  """float32 x [BT, cols] (registers) into chunk c, head h, columns `cols` of a pair ref."""
  for i, part in enumerate(split(x)):
    ref[c, h, pl.ds(i * BT, BT), cols] = part


# Slab pairs (pairs="slabs", D == 2 * BT): the same array, columns slab s of chunk c's term in rows
# [s BT, (s + 1) BT) of [c, h], its hi terms in columns [0, BT), its lo terms in [BT, 2 BT): the
# bytes of the state's key rows of slab s, so a program that has read those rows of a state can
# store its slab's pair over them while another program reads the other slab's rows.

def slab_pair_tile(ref, c, h, cols, BT=64):
  """Chunk c, head h, columns `cols` (one BT-wide slab) of a slab-pair ref, float32 [BT, BT]."""
  block = ref.at[c, h, cols]
  return load(block.at[:, pl.ds(0, BT)]).astype(F32) + load(block.at[:, pl.ds(BT, BT)]).astype(F32)


def slab_pair_store(ref, c, h, cols, x, BT=64):
  """float32 x [BT, BT] into chunk c, head h, columns `cols` (one slab) of a slab-pair ref."""
  for i, part in enumerate(split(x)):
    ref[c, h, cols, pl.ds(i * BT, BT)] = part


def term_load(ref, c, h, rows, cols, pairs, BT=64):
  """Chunk c (its rows `rows`), head h, columns `cols` of a float32 term, float32 [BT, cols] (WGMMA
  layout): from its pair ref where `pairs` (its slab-pair ref where pairs == "slabs"), else from
  the rows of a [Ta, HV, D] ref."""
  if pairs == "slabs":
    return slab_pair_tile(ref, c, h, cols, BT)
  return pair_load(ref, c, h, cols, BT) if pairs else load(ref.at[rows, h, cols])


def term_store(ref, c, h, rows, cols, x, pairs, BT=64):
  """float32 x [BT, cols] into chunk c (its rows `rows`), head h, columns `cols` of a term: its pair
  ref where `pairs` (pair_store; slab_pair_store where pairs == "slabs"), else the rows of a
  [Ta, HV, D] ref."""
  if pairs == "slabs":
    slab_pair_store(ref, c, h, cols, x, BT)
  elif pairs:
    pair_store(ref, c, h, cols, x, BT)
  else:
    ref[rows, h, cols] = x


def to_pairs(x, BT=64, slabs=False):
  """[1, Ta, HV, D] float32 -> its pairs [1, NTa, HV, 2 BT, D] bf16 (the layout above; slabs: the
  slab-pair layout, D == 2 BT)."""
  _, Ta, HV, D = x.shape
  c = x.astype(F32).reshape(Ta // BT, BT, HV, D).transpose(0, 2, 1, 3)       # [NTa, HV, BT, D]
  hi = c.astype(BF16)
  lo = (c - hi.astype(F32)).astype(BF16)
  if not slabs:
    return jnp.concatenate([hi, lo], axis=2)[None]
  by_slab = lambda t: t.reshape(Ta // BT, HV, BT, D // BT, BT).transpose(0, 1, 3, 2, 4)   # [.., s, row, col]
  return jnp.concatenate([by_slab(hi), by_slab(lo)], axis=-1).reshape(1, Ta // BT, HV, 2 * BT, D)


def from_pairs(p, BT=64, slabs=False):
  """Pairs [1, NTa, HV, 2 BT, D] bf16 -> [1, Ta, HV, D] float32 (hi + lo; slabs: slab pairs)."""
  _, NTa, HV, _, D = p.shape
  if slabs:
    b = p[0].reshape(NTa, HV, D // BT, BT, 2, BT).astype(F32)                 # [.., s, row, hi|lo, col]
    x = (b[..., 0, :] + b[..., 1, :]).transpose(0, 1, 3, 2, 4).reshape(NTa, HV, BT, D)
  else:
    x = p[0, :, :, :BT].astype(F32) + p[0, :, :, BT:].astype(F32)
  return x.transpose(0, 2, 1, 3).reshape(1, NTa * BT, HV, D)
