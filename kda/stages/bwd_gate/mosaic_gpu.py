"""bwd_gate (S5): the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.bwd_gate.

Kernel: the forward gate kernel's row scan (kda.stages.gate.mosaic_gpu) run backwards. The [1, Ta,
HV, K] arrays as [Ta, C] matrices (C = HV * K, a free reshape), one program (one warpgroup) per
(128-column group j, chunk c). TMA brings the chunk's [64, 128] tiles of the raw gate g (in its own
dtype), dgc and dg_state (float32) and its [64] valid flags (float32) into plain SMEM; then the
warpgroup walks the rows in REVERSE (r = 63 .. 0, Config.unroll rows per loop iteration), one thread
per column (`WG_STRIDED` [128] vectors), carrying acc = dgc[r] + ... + dgc[63] (the reverse
chunk-local cumsum), and per row:

    dg_act = acc + dg_state[r]
    g_act  = the forward kernel's activation of g[r] (its `_softplus`; sigmoid), before the floor
    live   = valid[r] & (g_act >= GATE_FLOOR)       (gate.passes_floor: NaN and -inf gates are not live)
    use_gate_in_kernel=False:  dg = where(live, dg_act, 0)
    lower_bound unset:  dx = where(live, -a * sigmoid(x) * dg_act, 0),  dA = where(live, g_act * dg_act, 0)
    lower_bound set:    dz = where(live, g_act * (1 - s) * dg_act, 0),  dx = a * dz,  dA = z * dz (0 where dz = 0)

with x = g + dt_bias, a = exp(A_log) (per column, C-long vectors the launcher builds as the gate
launcher does, exp formed there with the reference's XLA op), z = a * x (x without A_log), s =
sigmoid(z), g_act = -a * softplus(x) or lower_bound * s. The selects come after the products, as in
the reference: a floored gate (softplus(x) = inf) gives 0, not inf * 0, and padding rows (valid
False, g maybe NaN) give exactly 0. Each row of dg leaves from registers straight to GMEM (512
contiguous bytes); the program carries per-column sums of dx (for ddt_bias) and of dA (for dA_log)
and stores them as per-(chunk, column) partials [NTa, C] float32 (only those the call needs), which
the launcher sums over the chunks (and, for dA_log, over each head's K columns) in XLA.

Grid: (ceil(C / 128), NTa) with names ("j", "c"), as the forward gate kernel: the chunk axis on
CUDA's x, which has no 65535 limit. C that is not a multiple of 128 is zero-padded in the launcher
(copies in and out; the stage's predicate `supports` refuses those calls, so impl=None runs the
reference there). K itself does not matter: the kernel sees columns.

SMEM per program (`smem_bytes`): the g tile (16 KiB bf16, 32 KiB f32), the dgc and dg_state tiles
(2 x 32 KiB), the flags (each buffer from a 1 KiB boundary) and a barrier: 82952 bytes (bf16 g) /
99336 bytes (f32 g), two CTAs (two warpgroups) per SM. Lane lowering semantics: the same code as
Warpgroup here, lowered without layout inference.

Packed mode (`packed`, the pipeline's packed backward): g is read packed (the chunk's tile by TMA
from packed row src[c] into the plain tile; rows past count[c] are masked as valid=False rows) and
each row of dg goes to packed row src[c] + r (r < count[c]) in g's dtype; program (j, c) then
writes zeros to the gap pieces c, c + NTa, ... (padding.gap_pieces) at its columns, row by row.

Precision: everything is float32 elementwise, so the kernel takes float32 gates too (the stage's
predicate: the gradient is as accurate as the reference's). What differs from the reference: the
reverse cumsum adds the rows in sequence where XLA's cumsum adds in a tree (float32 rounding), the
kernel's softplus (log1p from log and a series, a few ulp) and the order of the dA_log / ddt_bias
sums. With use_gate_in_kernel=False dg is the float32 sequential reverse sum bit for bit. With
lower_bound and A_log, a raw gate of +-inf (z = +-inf, dz = 0) adds 0 to dA_log, the limit of
z * s (1 - s), as the reference does (not inf * 0 = NaN).
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

from kda._mosaic_gpu import F32
from kda._mosaic_gpu import params as _params
from kda._pallas import pad_dim
from kda._mosaic_gpu import smem_bytes as _smem_bytes, smem_reason
from kda.stages.bwd_gate import Out
from kda.stages.gate import mosaic_gpu as gate_kernel, passes_floor
from kda.stages.gate.mosaic_gpu import COLS, LINE, _softplus

BT = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the bwd_gate kernel (the tile is one chunk by 128 columns)."""
  unroll: int = 4               # rows per iteration of the reverse scan (ILP across the exps)

  def __post_init__(self):
    if self.unroll < 1 or BT % self.unroll:
      raise ValueError(f"unroll must divide the chunk's {BT} rows, got {self.unroll}")


def _scratch(g_dtype, flags):
  """The kernel's scratch types: the g tile in g's dtype, (flags: the [64] valid or reset flags),
  the dgc and dg_state tiles and a barrier (one arrival per TMA copy)."""
  return ([plgpu.SMEM((BT, COLS), g_dtype)] + ([plgpu.SMEM((BT,), F32)] if flags else [])
          + [plgpu.SMEM((BT, COLS), F32), plgpu.SMEM((BT, COLS), F32),
             plgpu.Barrier(num_arrivals=4 if flags else 3)])


def smem_bytes(g_dtype, packed=False, resets=False):
  """Shared memory per program (kda._mosaic_gpu.smem_bytes of the scratch the launcher allocates)."""
  return _smem_bytes(_scratch(jnp.dtype(g_dtype), not packed or resets))


def _columns_reason(g):
  if (g.shape[2] * g.shape[3]) % COLS:
    return (f"mosaic_gpu bwd_gate takes HV * K a multiple of {COLS} (one thread per column), got "
            f"{g.shape[2]} * {g.shape[3]}")
  return None


def _reason(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound):
  """What the kernel can run (any HV * K: the launcher pads the columns); `apply` raises with it."""
  reason = gate_kernel.supports(g, valid, A_log, dt_bias, chunk_size=chunk_size,
                                use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, any_columns=True)
  if reason is not None:      # the forward kernel's: chunk 64, g [1, Ta, HV, K], valid, the activation's
    return reason
  for name, x in (("dgc", dgc), ("dg_state", dg_state)):
    if x.shape != g.shape or jnp.dtype(x.dtype) != jnp.dtype(F32):
      return f"{name} must be float32{list(g.shape)} (g's shape), got {jnp.dtype(x.dtype).name}{list(x.shape)}"
  return smem_reason(smem_bytes(g.dtype), "bwd_gate")


def supports(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound,
             config=None, **_) -> Optional[str]:
  """The stage's predicate: None if the kernel takes this call, else the reason in words. Beyond
  what the kernel can run, HV * K must be a multiple of 128 (else `apply` pads the columns, copies
  the reference does without). Float32 gates are taken: the kernel's math is float32 elementwise,
  as accurate as the reference's (no bf16 operands anywhere)."""
  del config                      # no switch changes what the kernel takes
  return _reason(g, valid, A_log, dt_bias, dgc, dg_state, chunk_size=chunk_size,
                 use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound) or _columns_reason(g)


takes = supports                  # the name kda.stages.bwd_gate registers


def _body(*refs, act, lower_bound, has_a, has_bias, unroll, packed, resets=False):
  # GMEM in: (packed: src, count [NTa] int32, pieces [2, P] int32), g [Ta, C] (packed: [T, C]; its
  # dtype), (aligned: valid [Ta] f32), dgc, dg_state [Ta, C] f32, (a [C] f32), (bias [C] f32). GMEM
  # out: dg [Ta, C] (packed: [T, C]), (ddt_bias partials [NTa, C]), (dA_log partials [NTa, C]).
  # SMEM: the g, dgc, dg_state tiles [BT, 128], (aligned: valid [BT]), a barrier.
  refs = list(refs)
  take = lambda cond: refs.pop(0) if cond else None
  src_g, cnt_g, pieces_g = take(packed), take(packed), take(packed)
  reset_g = take(resets)      # packed: [Ta] f32, 1 at a segmented layout's resets: dg 0 there
  g_g, valid_g = refs.pop(0), take(not packed)
  dgc_g, dgs_g = refs.pop(0), refs.pop(0)
  a_g, bias_g = take(has_a), take(has_bias)
  dg_g = refs.pop(0)
  sdx_g, sda_g = take(has_bias), take(has_a)
  g_s, valid_s = refs.pop(0), take(not packed or resets)
  dgc_s, dgs_s, bar = refs
  j, c = lax.axis_index("j"), lax.axis_index("c")
  start = pl.multiple_of(c * BT, BT)
  cols = pl.ds(pl.multiple_of(j * COLS, COLS), COLS)
  rows = pl.ds(start, BT)
  line = lambda ref: plgpu.load(ref, layout=LINE, optimized=False)
  if packed:   # g at any packed row (plain SMEM takes it; rows past T arrive as zeros, masked anyway)
    src, cnt = src_g[c], cnt_g[c]
    plgpu.copy_gmem_to_smem(g_g.at[pl.ds(src, BT), cols], g_s, bar)
    if resets:
      plgpu.copy_gmem_to_smem(reset_g.at[rows], valid_s, bar)
  else:
    plgpu.copy_gmem_to_smem(g_g.at[rows, cols], g_s, bar)
    plgpu.copy_gmem_to_smem(valid_g.at[rows], valid_s, bar)
  plgpu.copy_gmem_to_smem(dgc_g.at[rows, cols], dgc_s, bar)
  plgpu.copy_gmem_to_smem(dgs_g.at[rows, cols], dgs_s, bar)
  a = line(a_g.at[cols]) if has_a else None
  bias = line(bias_g.at[cols]) if has_bias else None
  plgpu.barrier_wait(bar)

  def step(i, carry):
    r = BT - 1 - i
    acc, sdx, sda = carry
    acc = acc + line(dgc_s.at[r])
    dg_act = acc + line(dgs_s.at[r])
    x = line(g_s.at[r]).astype(F32)
    if act:
      if has_bias:
        x = x + bias
      if lower_bound is None:
        g_act = -a * _softplus(x)
      else:
        z = x if a is None else a * x
        s = jax.nn.sigmoid(z)
        g_act = lower_bound * s
    else:
      g_act = x
    # Broadcast explicitly: Warpgroup semantics has no implicit scalar broadcast.
    real = (r < cnt) if packed else (valid_s[r] > 0.0)
    if resets:    # a gate of -inf there in the forward: not live
      real = real & (valid_s[r] <= 0.0)
    live = lax.broadcast(real, (COLS,)) & passes_floor(g_act)
    mask = lambda v: jnp.where(live, v, 0.0)     # a select, after the products (NaN, inf * 0)
    if not act:
      dx = mask(dg_act)
    elif lower_bound is None:
      dx = mask(-a * jax.nn.sigmoid(x) * dg_act)
      dA = mask(g_act * dg_act) if has_a else None
    else:
      dz = mask(g_act * (1.0 - s) * dg_act)
      dx = dz if a is None else a * dz
      dA = jnp.where(dz != 0.0, z * dz, 0.0) if has_a else None   # z = +-inf: the limit 0, not inf * 0
    if packed:   # the chunk's token r is packed row src + r; rows past cnt are another's
      @pl.when(r < cnt)
      def _():
        dg_g[src + r, cols] = dx.astype(dg_g.dtype)
    else:
      dg_g[start + r, cols] = dx
    return acc, (sdx + dx if has_bias else sdx), (sda + dA if has_a else sda)

  zero = plgpu.layout_cast(jnp.zeros((COLS,), F32), LINE)
  _, sdx, sda = lax.fori_loop(0, BT, step, (zero, zero, zero), unroll=unroll)
  if packed:   # tokens of no sequence: zeros, program c taking gap pieces c, c + NTa, ...
    NTa, P = src_g.shape[0], pieces_g.shape[1]
    zero_out = zero.astype(dg_g.dtype)

    def piece(m, carry):
      p = c + m * NTa
      first = pieces_g[0, p]

      def row(i, carry):
        dg_g[first + i, cols] = zero_out
        return carry

      return lax.fori_loop(0, pieces_g[1, p], row, carry)

    lax.fori_loop(0, (P - c + NTa - 1) // NTa, piece, 0)
  if has_bias:
    sdx_g[c, cols] = sdx
  if has_a:
    sda_g[c, cols] = sda


def apply(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound,
          interpret=False, config=None):
  """The stage on the kernel, aligned; any HV * K (columns padded to a multiple of 128)."""
  reason = _reason(g, valid, A_log, dt_bias, dgc, dg_state, chunk_size=chunk_size,
                   use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_gate kernel: {reason}")
  _, Ta, HV, K = g.shape
  return _launch(g, [valid[0].astype(F32)], A_log, dt_bias, dgc, dg_state, rows_out=Ta, out_dtype=F32,
                 use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, interpret=interpret,
                 config=config, packed=False)


def packed_supports(g, rows, pieces, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel,
                    lower_bound, config=None, seg=None, **_) -> Optional[str]:
  """None if `packed` takes this call, else the reason in words: the gate kernel's `packed_takes`
  (g packed [1, T, HV, K], rows a ChunkRows, HV * K a multiple of 128), dgc and dg_state float32
  [1, NTa * 64, HV, K], pieces [2, P] int32, the SMEM (seg: the reset flags' tile counted)."""
  del config                      # no switch changes what the kernel takes
  reason = gate_kernel.packed_takes(g, rows, A_log, dt_bias, chunk_size=chunk_size,
                                    use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  if reason is not None:
    return reason
  want = (1, rows.src.shape[0] * chunk_size) + g.shape[2:]
  for name, x in (("dgc", dgc), ("dg_state", dg_state)):
    if x.shape != want or jnp.dtype(x.dtype) != jnp.dtype(F32):
      return f"{name} must be float32{list(want)}, got {jnp.dtype(x.dtype).name}{list(x.shape)}"
  if pieces.ndim != 2 or pieces.shape[0] != 2 or jnp.dtype(pieces.dtype) != jnp.dtype(jnp.int32):
    return f"pieces must be a [2, P] int32 array, got {jnp.dtype(pieces.dtype).name}{list(pieces.shape)}"
  return smem_reason(smem_bytes(g.dtype, packed=True, resets=seg is not None), "bwd_gate")


def packed(g, rows, pieces, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound,
           interpret=False, config=None, seg=None):
  """The stage on PACKED gates g [1, T, HV, K], the unalign of dg folded into the kernel's stores:
  rows = padding.chunk_rows(layout), pieces = padding.gap_pieces(rows, aligned_cu, T, 64); dgc,
  dg_state aligned [1, NTa * 64, HV, K] float32 as for `apply`. -> Out with dg packed [1, T, HV, K]
  in g's dtype: `apply`'s dg on the aligned, neutralised g, unaligned (token r of chunk c at packed
  row src[c] + r, r < count[c]) and rounded, exactly 0 at tokens of no sequence (the pieces). seg
  (kda.pipeline.segment_rows of a segmented layout): dg 0 at its resets, whose gate the forward
  took as -inf (kda.stages.gate.mosaic_gpu.packed(seg=))."""
  reason = packed_supports(g, rows, pieces, A_log, dt_bias, dgc, dg_state, chunk_size=chunk_size,
                           use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, seg=seg)
  if reason is not None:
    raise ValueError(f"mosaic_gpu bwd_gate kernel: {reason}")
  lead = [rows.src, rows.count, pieces] + ([] if seg is None else [gate_kernel.reset_rows(seg)])
  return _launch(g, lead, A_log, dt_bias, dgc, dg_state, rows_out=g.shape[1],
                 out_dtype=g.dtype, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                 interpret=interpret, config=config, packed=True, resets=seg is not None)


def _launch(g, lead, A_log, dt_bias, dgc, dg_state, *, rows_out, out_dtype, use_gate_in_kernel, lower_bound,
            interpret, config, packed, resets=False):
  config = config or Config()
  HV, K = g.shape[2:]
  C, NTa = HV * K, dgc.shape[1] // BT
  Cp = -(-C // COLS) * COLS
  wide = lambda x: pad_dim(x.reshape(-1, C), 1, Cp)   # -> [rows, Cp]: columns padded with zeros, cut off after
  has_a = use_gate_in_kernel and A_log is not None
  has_bias = use_gate_in_kernel and dt_bias is not None
  args = [*lead, wide(g)] if packed else [wide(g), *lead]     # packed: src, count, pieces first
  args += [wide(dgc), wide(dg_state)]
  if has_a:
    args.append(wide(jnp.repeat(jnp.exp(A_log.astype(F32)), K))[0])
  if has_bias:
    args.append(wide(dt_bias.astype(F32))[0])
  out_type = ([jax.ShapeDtypeStruct((rows_out, Cp), out_dtype)]
              + [jax.ShapeDtypeStruct((NTa, Cp), F32)] * (has_bias + has_a))
  body = functools.partial(_body, act=use_gate_in_kernel, has_a=has_a, has_bias=has_bias, unroll=config.unroll,
                           lower_bound=None if lower_bound is None else float(lower_bound), packed=packed,
                           resets=resets)
  f = plgpu.kernel(body, out_type=tuple(out_type), grid=(Cp // COLS, NTa), grid_names=("j", "c"),
                   scratch_types=_scratch(g.dtype, not packed or resets),
                   compiler_params=_params(lane=True),      # Lane: no layout inference (module docstring)
                   kernel_name="kda_bwd_gate_packed" if packed else "kda_bwd_gate",
                   interpret=plgpu.InterpretGPUParams() if interpret else None)
  dg, *parts = f(*args)
  dg = dg[:, :C].reshape(1, rows_out, HV, K)
  ddt_bias = jnp.sum(parts.pop(0)[:, :C], axis=0) if has_bias else None
  dA_log = jnp.sum(parts.pop(0)[:, :C].reshape(NTa, HV, K), axis=(0, 2)) if has_a else None
  return Out(dg, dA_log, ddt_bias)
