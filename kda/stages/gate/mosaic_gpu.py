"""gate: the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.gate.

Kernel: the gates as a [Ta, C] matrix (C = HV * K, a free reshape), one program (one warpgroup) per
(128-column group j, chunk c). TMA brings the chunk's [BT, 128] tile of raw gates (in their own
dtype) and its [BT] valid flags into SMEM; then the warpgroup walks the rows in order, one thread per
column (`WG_STRIDED` [128] vectors: jnp.cumsum has no Mosaic GPU lowering), and per row activates,
floors, masks, splits into ceil and fraction, and adds both parts to running sums. gc_int is exact;
gc_frac is the float32 sequential sum, where XLA's cumsum (the reference) adds in a tree, so the two
differ by the rounding of the additions. A column group spans one head (K = 128) or two (K = 64);
each column gets its exp(A_log) and dt_bias from C-long vectors the launcher builds (exp(A_log)
formed there, per head, with the reference's XLA op). C must be a multiple of 128 (one thread per
column; `supports` refuses other widths, which the pallas kernel takes).

The activation in ops Mosaic GPU lowers (it has no ceil and no log1p): ceil(x) = r + (r < x) with
r = round-half-even(x), exact for every float32 (|x| >= 2**23 is integral already; NaN stays NaN);
softplus(x) = max(x, 0) + log1p(exp(-|x|)) as jax.nn.softplus forms it, log1p from log and a short
series (`_log1p`, a few ulp); sigmoid is Mosaic GPU's rule for lax.logistic, 1 / (1 + exp(-x)).
The floor, the valid mask (a select: padding gates may be NaN) and the split follow the reference.
The kernel lowers with Lane semantics: its code is the same under Warpgroup semantics, and Lane
skips layout inference, the bulk of the lowering time.

Grid: (C / 128, NTa) with names ("j", "c"): Mosaic GPU launches (g0, g1) as CUDA (y, x), and x
allows 2**31 - 1 programs, so the chunk axis never meets y's limit of 65535.

Stores: by default each row leaves from registers straight to GMEM (512 contiguous bytes per row and
output) and SMEM holds only the input tile (16 KiB bf16, 32 KiB f32) and the flags, so several
programs share an SM. Config(stage_stores=True) gathers the f32 outputs in SMEM tiles (32 KiB each)
and stores them by TMA.

Packed mode (`packed`): g stays packed [1, T, HV, K] and the align is folded into the load. Chunk c's
tile comes by TMA from packed row rows.src[c] (kda.padding.ChunkRows; any row: the tile's SMEM is
plain; rows past T arrive as zeros), and rows r >= rows.count[c] (other sequences' tokens, maybe
NaN) are masked by the same select as valid=False rows; src and count are scalars read from GMEM.
gc_int and gc_frac come out aligned [1, NTa * 64, HV, K], bit for bit those of `apply` on the
aligned gates; the activated g is not written. The scan is split (static unroll) at the six rows
`bounded_chunks` reads (SPAN_ROWS), and each program also stores per-column stats [NTa, 2, C] f32:
[c, 0] the max of the four half-block spans (exponent of gc between those rows; NaN propagates),
[c, 1] the sum of ceil(g)**2 over the chunk (nonzero iff gc_int != 0 at some row). The launcher
reduces them over each head's K columns: `bounded` (every span <= BOUNDED_SPAN, NaN -> 0) and
`two_part` (any nonzero), what `bounded_chunks` and `two_parts_needed` give from gc: they choose the
intra kernel's paths (kda.stages.intra.mosaic_gpu), which imports them from here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32, smem_bytes as _smem_bytes, smem_reason
from kda._mosaic_gpu import params as _params
from kda.padding.pieces import at_reset
from kda.stages.gate import GATE_FLOOR, Out, exponent, floor

BT = 64
COLS = 128                       # columns per program: one per thread of the warpgroup
LINE = plgpu.Layout.WG_STRIDED((COLS,), vec_size=1)
MAX_GRID_Y = 65535
# (a, m, e) rows of `bounded_chunks`: the spans gc[a] - gc[m] and gc[m] - gc[e] of each 32-row block
SPAN_ROWS = ((0, 16, 31), (32, 48, 63))
BOUNDED_SPAN = 80.0              # exp(+-80) is a normal float32 / bf16 number


@dataclasses.dataclass(frozen=True)
class Config:
  """Variants of the gate kernel (the tile is one chunk by 128 columns)."""
  stage_stores: bool = False    # outputs through SMEM + TMA (else registers -> GMEM row stores)
  unroll: int = 4               # rows per iteration of the scan loop (ILP across the exps)

  def __post_init__(self):
    if self.unroll < 1 or BT % self.unroll:
      raise ValueError(f"unroll must divide the chunk's 64 rows, got {self.unroll}")


def scratch(dtype, config, *, packed=False, resets=False):
  """The kernel's scratch_types: the g tile [BT, 128] in g's dtype; the valid flags (aligned) or the
  reset rows (packed with resets) [BT] f32; the outputs' f32 tiles (stage_stores); the barrier."""
  flags = not packed or resets
  out = [plgpu.SMEM((BT, COLS), dtype)] + [plgpu.SMEM((BT,), F32)] * flags
  if config.stage_stores:
    out += [plgpu.SMEM((BT, COLS), F32)] * (2 if packed else 3)
  return out + [plgpu.Barrier(num_arrivals=1 + flags)]


def smem_bytes(dtype, config=None, *, packed=False, resets=False):
  """The SMEM the kernel asks for (as lowered for CUDA) with gates of `dtype`."""
  return _smem_bytes(scratch(jnp.dtype(dtype), config or Config(), packed=packed, resets=resets))


def _common(g, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, rows_name, config,
            packed, resets=False, any_columns=False) -> Optional[str]:
  """What both modes ask of g [1, rows, HV, K] and the activation's parameters (any_columns: a
  launcher that pads HV * K to a multiple of 128 asks)."""
  if chunk_size != BT:
    return f"chunk_size must be {BT}, got {chunk_size}"
  if g.ndim != 4 or g.shape[0] != 1:
    return f"g must be [1, {rows_name}, HV, K], got shape {g.shape}"
  _, _, HV, K = g.shape
  if (HV * K) % COLS and not any_columns:
    return f"mosaic_gpu gate takes HV * K a multiple of {COLS} (one thread per column), got {HV} * {K}"
  if -(-HV * K // COLS) > MAX_GRID_Y:
    return f"HV * K / {COLS} must be <= {MAX_GRID_Y} (a CUDA grid y limit), got {HV} * {K}"
  if jnp.dtype(g.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
    return f"g must be bfloat16 or float32, got {jnp.dtype(g.dtype).name}"
  if use_gate_in_kernel:
    if lower_bound is None and A_log is None:
      return "gate activation without lower_bound requires A_log [HV], got None"
    if A_log is not None and A_log.shape != (HV,):
      return f"A_log must have shape {(HV,)}, got {A_log.shape}"
    if dt_bias is not None and dt_bias.size != HV * K:
      return f"dt_bias must have {HV * K} elements, got shape {dt_bias.shape}"
  return smem_reason(smem_bytes(g.dtype, config, packed=packed, resets=resets))


def supports(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, config=None,
             any_columns=False, **_) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  reason = _common(g, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                   lower_bound=lower_bound, rows_name="Ta", config=config, packed=False, any_columns=any_columns)
  if reason is not None:
    return reason
  Ta = g.shape[1]
  if Ta % chunk_size:
    return f"Ta must be a multiple of chunk_size {chunk_size}, got {Ta}"
  if valid.shape != (1, Ta):
    return f"valid must have shape {(1, Ta)}, got {valid.shape}"
  return None


def packed_supports(g, rows, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, config=None,
                    seg=None, **_) -> Optional[str]:
  """None if `packed` takes this call (g packed [1, T, HV, K], rows a kda.padding.ChunkRows), else
  the reason in words."""
  reason = _common(g, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                   lower_bound=lower_bound, rows_name="T", config=config, packed=True, resets=seg is not None)
  if reason is not None:
    return reason
  if g.shape[1] == 0:
    return "g must hold at least one token, got T = 0"
  src, count = rows
  if src.ndim != 1 or src.shape[0] == 0 or jnp.dtype(src.dtype) != jnp.dtype(jnp.int32):
    return f"rows.src must be a non-empty [NTa] int32 array, got {jnp.dtype(src.dtype).name}{list(src.shape)}"
  if count.shape != src.shape or jnp.dtype(count.dtype) != jnp.dtype(jnp.int32):
    return (f"rows.count must be a {list(src.shape)} int32 array, got "
            f"{jnp.dtype(count.dtype).name}{list(count.shape)}")
  return None


takes = supports                 # the names kda.stages.gate and kda.pipeline call the predicates by
packed_takes = packed_supports


def _ceil(x):
  r = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
  return jnp.where(r < x, r + 1.0, r)


def _log1p(y):
  """log(1 + y) for y in [0, 1] to a few ulp. Above 1/2, log(1 + y) itself; below, the atanh series
  2 atanh(s) with s = y / (2 + y) <= 1/5 (terms to s**11: truncation < 1e-9 relative), written as
  y * 2 / (2 + y) * (...) so a tiny y never passes through a denormal. No (1 + y) - 1 trick: XLA's
  simplifier folds it to y, which breaks it in the simulator."""
  r = 2.0 / (y + 2.0)
  s = 0.5 * y * r
  s2 = s * s
  p = 1.0 + s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9 + s2 * (1 / 11)))))
  return jnp.where(y > 0.5, jnp.log(y + 1.0), y * r * p)


def _softplus(x):
  sp = jnp.maximum(x, 0.0) + _log1p(jnp.exp(-jnp.abs(x)))
  return jnp.where(x != x, x, sp)      # NaN in, NaN out (as jnp.logaddexp)


def row_parts(x, real, a=None, bias=None, *, act=False, lower_bound=None):
  """One row of raw gates [COLS] (any float dtype) -> (x, ceil(x)): x activated (if `act`), floored
  and 0 where not real() (a callable giving a bool scalar, formed after the floor: the gate kernel's
  op order); the scan adds ceil(x) to gc_int and x - ceil(x) to gc_frac."""
  x = x.astype(F32)
  if act:
    if bias is not None:
      x = x + bias
    if lower_bound is None:
      x = -a * _softplus(x)
    else:
      x = lower_bound * jax.nn.sigmoid(x if a is None else a * x)
  x = floor(x)
  # a select, not a product: padding gates may be NaN (packed: other sequences' tokens). Broadcast
  # explicitly: Warpgroup semantics has no implicit scalar broadcast.
  x = jnp.where(lax.broadcast(real(), (COLS,)), x, 0.0)
  return x, _ceil(x)


def _body(*refs, BT, act, lower_bound, has_a, has_bias, stage_stores, unroll, packed, tail_zeros=True,
          resets=False):
  # GMEM in: aligned: g [Ta, C] (input dtype), valid [Ta] f32; packed: src [NTa], count [NTa] int32,
  # g [T, C]; then (a [C] f32), (bias [C] f32). GMEM out: aligned: g_act, gc_int, gc_frac [Ta, C] f32;
  # packed: gc_int, gc_frac [Ta, C], stats [NTa, 2, C] f32. SMEM: the g tile [BT, 128], (aligned:
  # valid [BT]), (the row outputs' f32 tiles), a barrier.
  refs = list(refs)
  take = lambda cond: refs.pop(0) if cond else None
  src_g, count_g = take(packed), take(packed)
  reset_g = take(resets)      # packed: [Ta] f32, 1 at a segmented layout's resets (gate -inf there)
  g_g, valid_g = refs.pop(0), take(not packed)
  a_g, bias_g = take(has_a), take(has_bias)
  outs_g = [refs.pop(0) for _ in range(2 if packed else 3)]   # the per-row outputs
  stats_g = take(packed)
  g_s, valid_s = refs.pop(0), take(not packed or resets)
  outs_s = [refs.pop(0) for _ in outs_g] if stage_stores else None
  bar, = refs
  j, c = lax.axis_index("j"), lax.axis_index("c")
  start = pl.multiple_of(c * BT, BT)          # the chunk's first row in the aligned outputs
  cols = pl.ds(pl.multiple_of(j * COLS, COLS), COLS)
  if packed:   # any packed row (plain SMEM takes it); rows past T arrive as zeros, masked anyway
    count = count_g[c]
    plgpu.copy_gmem_to_smem(g_g.at[pl.ds(src_g[c], BT), cols], g_s, bar)
    if resets:
      plgpu.copy_gmem_to_smem(reset_g.at[pl.ds(start, BT)], valid_s, bar)
  else:
    plgpu.copy_gmem_to_smem(g_g.at[pl.ds(start, BT), cols], g_s, bar)
    plgpu.copy_gmem_to_smem(valid_g.at[pl.ds(start, BT)], valid_s, bar)
  a = plgpu.load(a_g.at[cols], layout=LINE, optimized=False) if has_a else None
  bias = plgpu.load(bias_g.at[cols], layout=LINE, optimized=False) if has_bias else None
  plgpu.barrier_wait(bar)

  def step(r, carry):
    acc_i, acc_f, *nz = carry
    x = plgpu.load(g_s.at[r], layout=LINE, optimized=False)
    if resets:
      x = x.astype(F32)
      x = jnp.where(lax.broadcast(valid_s[r] > 0.0, (COLS,)), at_reset(x), x)
    real = (lambda: r < count) if packed else (lambda: valid_s[r] > 0.0)
    x, whole = row_parts(x, real, a, bias, act=act, lower_bound=lower_bound)
    acc_i = acc_i + whole
    acc_f = acc_f + (x - whole)
    for k, v in enumerate((acc_i, acc_f) if packed else (x, acc_i, acc_f)):
      if stage_stores:
        outs_s[k].at[r][...] = v
      else:
        outs_g[k][start + r, cols] = v
    if packed:   # != 0 iff some ceil(x) != 0 so far, i.e. iff gc_int != 0 at some row so far
      nz = [nz[0] + whole * whole]
    return (acc_i, acc_f, *nz)

  def scan(lo, hi, carry):   # rows [lo, hi): a loop over whole unrolls, the rest inline
    main = (hi - lo) // unroll * unroll
    if main:
      carry = lax.fori_loop(lo, lo + main, step, carry, unroll=unroll)
    for r in range(lo + main, hi):
      carry = step(r, carry)
    return carry

  zero = plgpu.layout_cast(jnp.zeros((COLS,), F32), LINE)

  def work():
    if not packed:
      scan(0, BT, (zero, zero))
    else:   # the loop split at the rows bounded_chunks reads, their (gc_int, gc_frac) kept
      carry, at, lo = (zero, zero, zero), {}, 0
      for r in sorted({r for block in SPAN_ROWS for r in block}):
        carry = scan(lo, r + 1, carry)
        at[r], lo = carry[:2], r + 1
      carry = scan(lo, BT, carry)
      span = None
      for a_, m, e in SPAN_ROWS:
        for u, v in ((a_, m), (m, e)):
          s = exponent(*at[u], *at[v])
          span = s if span is None else jnp.maximum(span, s)    # NaN-propagating, as in XLA
      stats_g[c, 0, cols] = span
      stats_g[c, 1, cols] = carry[2]
    if stage_stores:
      plgpu.commit_smem()
      for o_s, o_g in zip(outs_s, outs_g):
        plgpu.copy_smem_to_gmem(o_s, o_g.at[pl.ds(start, BT), cols])
      plgpu.wait_smem_to_gmem(0)

  if packed and not tail_zeros:   # count 0: a tail chunk (no sequence); its gc rows left unwritten
    pl.when(count > 0)(work)

    @pl.when(count == 0)
    def _():                      # the stats the scan gives all-zero gates: bounded, one part
      stats_g[c, 0, cols] = zero
      stats_g[c, 1, cols] = zero
  else:
    work()


def _launch(g2, lead, A_log, dt_bias, *, NTa, HV, K, use_gate_in_kernel, lower_bound, config, interpret,
            packed, tail_zeros=True, resets=False):
  """The kernel on g2 [rows, C] after the `lead` args -> its outputs."""
  C = g2.shape[1]
  has_a = use_gate_in_kernel and A_log is not None
  has_bias = use_gate_in_kernel and dt_bias is not None
  args = [*lead, g2] if packed else [g2, *lead]   # packed: src, count first; aligned: valid after g
  if has_a:
    args.append(jnp.repeat(jnp.exp(A_log.astype(F32)), K))
  if has_bias:
    args.append(dt_bias.astype(F32).reshape(HV * K))
  body = functools.partial(_body, BT=BT, act=use_gate_in_kernel,
                           lower_bound=None if lower_bound is None else float(lower_bound),
                           has_a=has_a, has_bias=has_bias, stage_stores=config.stage_stores,
                           unroll=config.unroll, packed=packed, tail_zeros=tail_zeros, resets=resets)
  out_type = [jax.ShapeDtypeStruct((NTa * BT, C), F32)] * (2 if packed else 3)
  if packed:
    out_type.append(jax.ShapeDtypeStruct((NTa, 2, C), F32))
  f = plgpu.kernel(
      body, out_type=tuple(out_type), grid=(C // COLS, NTa), grid_names=("j", "c"),
      scratch_types=scratch(g2.dtype, config, packed=packed, resets=resets), compiler_params=_params(True),
      kernel_name="kda_gate", interpret=plgpu.InterpretGPUParams() if interpret else None)
  return f(*args)


def apply(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, interpret=False,
          config=None):
  config = config or Config()
  reason = supports(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                    lower_bound=lower_bound, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_gpu gate kernel: {reason}")
  _, Ta, HV, K = g.shape
  outs = _launch(g.reshape(Ta, HV * K), [valid[0].astype(F32)], A_log, dt_bias, NTa=Ta // chunk_size, HV=HV,
                 K=K, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, config=config,
                 interpret=interpret, packed=False)
  return Out(*(x.reshape(1, Ta, HV, K) for x in outs))


def bounded_chunks(gc_int, gc_frac):
  """[HV * NTa] int32, row-major (head, chunk): 1 where every 16-token half of both 32-token blocks
  of the chunk spans at most BOUNDED_SPAN of gc in every channel (the rows of SPAN_ROWS), so that
  the intra kernel's two-level path keeps every factor within exp(+-BOUNDED_SPAN); 0 elsewhere (NaN
  gates included). gc_int, gc_frac: [1, Ta, HV, K]."""
  gi, gf = (x.astype(F32).reshape((-1, BT) + x.shape[2:]) for x in (gc_int, gc_frac))   # [NTa, BT, HV, K]
  at = lambda r: (gi[:, r], gf[:, r])
  span = jnp.zeros(gi.shape[:1] + gi.shape[2:], F32)
  for a, m, e in SPAN_ROWS:
    span = jnp.maximum(span, jnp.maximum(exponent(*at(a), *at(m)), exponent(*at(m), *at(e))))
  ok = jnp.all(span <= BOUNDED_SPAN, axis=-1)                           # [NTa, HV]; NaN -> False
  return ok.T.reshape(-1).astype(jnp.int32)


def two_parts_needed(gc_int):
  """[HV * NTa] int32, row-major (head, chunk): 1 where the chunk's gc_int is not 0 (NaN included),
  i.e. where the intra kernel needs both parts of gc."""
  gi = gc_int.astype(F32).reshape((-1, BT) + gc_int.shape[2:])          # [NTa, BT, HV, K]
  return jnp.any(gi != 0, axis=(1, 3)).T.reshape(-1).astype(jnp.int32)


def reset_free(gc_int, seg):
  """gc_int [1, Ta, HV, K] without the -128 steps of a segmented layout's resets (seg:
  kda.pipeline.segment_rows): + 128 n per row, exact."""
  return gc_int - GATE_FLOOR * seg[0][None, :, None, None]


def reset_rows(seg):
  """[Ta] float32, 1 at the aligned rows of a segmented layout's resets (seg: kda.pipeline.segment_rows,
  whose count n steps up there), else 0."""
  n = seg[0].reshape(-1, 64)
  return (n > jnp.pad(n[:, :-1], ((0, 0), (1, 0)))).astype(F32).reshape(-1)


class PackedOut(NamedTuple):
  gc_int: jax.Array    # [1, Ta, HV, K] float32, as Out.gc_int of `apply` on the aligned gates
  gc_frac: jax.Array   # [1, Ta, HV, K] float32
  bounded: jax.Array   # [HV * NTa] int32, bounded_chunks(gc_int, gc_frac)
  two_part: jax.Array  # [HV * NTa] int32, two_parts_needed(gc_int)


def packed(g, rows, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, interpret=False,
           config=None, tail_zeros=True, seg=None):
  """The gate stage on PACKED gates g [1, T, HV, K] (bf16 or float32), the align folded into the
  kernel's load: rows is kda.padding.chunk_rows(layout) (NTa chunks). -> PackedOut: gc_int, gc_frac
  [1, NTa * 64, HV, K] equal to `apply` on padding.align_with(layout, g) (neutralised if
  use_gate_in_kernel) and padding.valid_mask(layout); bounded and two_part for the intra kernel,
  from the kernel's per-(chunk, column) stats. The activated g is not written. tail_zeros=False
  leaves gc_int, gc_frac unwritten at the tail chunks (rows.count 0: past aligned_cu[-1]), for
  callers whose consumers never read them there; the stats are the same. seg (kda.pipeline.segment_rows
  of a segmented layout): the gate is kda.padding.pieces.at_reset at its resets (`reset_rows`: -inf,
  a NaN or +inf kept), and bounded and two_part are as if each
  reset's -128 step were not in gc_int (the intra kernel takes seg and masks its pairs instead):
  the ceil(g)**2 sums less GATE_FLOOR**2 per reset (exact integers), bounded from gc_int + 128 n."""
  config = config or Config()
  reason = packed_supports(g, rows, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                           lower_bound=lower_bound, config=config, seg=seg)
  if reason is not None:
    raise ValueError(f"mosaic_gpu gate kernel: {reason}")
  _, T, HV, K = g.shape
  C, NTa = HV * K, rows.src.shape[0]
  g2 = g.reshape(T, C)
  lead = [rows.src, rows.count] + ([] if seg is None else [reset_rows(seg)])
  gi, gf, stats = _launch(g2, lead, A_log, dt_bias, NTa=NTa, HV=HV, K=K,
                          use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, config=config,
                          interpret=interpret, packed=True, tail_zeros=bool(tail_zeros), resets=seg is not None)
  span, nz = (stats[:, i].reshape(NTa, HV, K) for i in (0, 1))
  Ta = NTa * chunk_size
  gi, gf = (x.reshape(1, Ta, HV, K) for x in (gi, gf))
  if seg is None:
    bounded = jnp.all(span <= BOUNDED_SPAN, axis=-1).T.reshape(-1).astype(jnp.int32)   # NaN -> 0
  else:
    nz = nz - GATE_FLOOR ** 2 * seg[0].reshape(NTa, chunk_size)[:, -1, None, None]
    bounded = bounded_chunks(reset_free(gi, seg), gf)
  two_part = jnp.any(nz != 0, axis=-1).T.reshape(-1).astype(jnp.int32)   # NaN -> 1
  return PackedOut(gi, gf, bounded, two_part)
