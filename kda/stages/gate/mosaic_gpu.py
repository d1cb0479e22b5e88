"""gate: the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.stages.gate.

Kernel: the gates as a [Ta, C] matrix (C = HV * K, a free reshape), one program (one warpgroup) per
(128-column group j, chunk c). TMA brings the chunk's [BT, 128] tile of raw gates (in their own
dtype) and its [BT] valid flags into SMEM; then the warpgroup walks the rows in order, one thread per
column (`WG_STRIDED` [128] vectors, the row scan of MOSAIC_GPU.md: jnp.cumsum has no Mosaic GPU
lowering), and per row activates, floors, masks, splits into ceil and fraction, and adds both parts
to running sums. gc_int is exact; gc_frac is the float32 sequential sum, where XLA's cumsum (the
reference) adds in a tree, so the two differ by float32 rounding (measured <= 1.4e-6 relative,
test_gate_mosaic.py). A column group spans one head (K = 128) or two (K = 64); each column gets its
exp(A_log) and dt_bias from C-long vectors the launcher builds (exp(A_log) formed there, per head,
with the reference's XLA op).

The activation in ops Mosaic GPU lowers (it has no ceil and no log1p): ceil(x) = r + (r < x) with
r = round-half-even(x), exact for every float32 (|x| >= 2**23 is integral already; NaN stays NaN);
softplus(x) = max(x, 0) + log1p(exp(-|x|)) as jax.nn.softplus forms it, log1p from log and a short
series (`_log1p`, a few ulp); sigmoid is Mosaic GPU's rule for lax.logistic, 1 / (1 + exp(-x)).
The floor, the valid mask (a select: padding gates may be NaN) and the split follow the reference.

Grid: (ceil(C / 128), NTa) with names ("j", "c"): Mosaic GPU launches (g0, g1) as CUDA (y, x), and
x allows 2**31 - 1 programs, so the chunk axis never meets y's limit of 65535. C that is not a
multiple of 128 is zero-padded in the launcher (an XLA copy in and out; the stage's predicate
`takes` refuses those calls, so impl=None runs the pallas kernel there).

Stores: by default each row leaves from registers straight to GMEM (512 contiguous bytes per row and
output) and SMEM holds only the input tile (16 KiB bf16, 32 KiB f32) and the flags, so several
programs share an SM. Config(stage_stores=True) gathers the three f32 outputs in SMEM tiles
(+96 KiB) and stores them by TMA.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda._mosaic_gpu import BF16, F32
from kda._pallas import pad_dim
from kda.stages.gate import Out, floor
COLS = 128                       # columns per program: one per thread of the warpgroup
LINE = plgpu.Layout.WG_STRIDED((COLS,), vec_size=1)
MAX_GRID_Y = 65535


@dataclasses.dataclass(frozen=True)
class Config:
  """Switches of the gate kernel (the tile is one chunk by 128 columns)."""
  stage_stores: bool = False    # outputs through SMEM + TMA (else registers -> GMEM row stores)
  lane_semantics: bool = False  # Mosaic GPU LoweringSemantics.Lane instead of Warpgroup
  unroll: int = 4               # rows per iteration of the scan loop (ILP across the exps)

  def __post_init__(self):
    if self.unroll < 1 or 64 % self.unroll:
      raise ValueError(f"unroll must divide the chunk's 64 rows, got {self.unroll}")


def supports(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if chunk_size != 64:
    return f"chunk_size must be 64, got {chunk_size}"
  if g.ndim != 4 or g.shape[0] != 1:
    return f"g must be [1, Ta, HV, K], got shape {g.shape}"
  _, Ta, HV, K = g.shape
  if Ta % chunk_size:
    return f"Ta must be a multiple of chunk_size {chunk_size}, got {Ta}"
  if -(-HV * K // COLS) > MAX_GRID_Y:
    return f"HV * K / {COLS} must be <= {MAX_GRID_Y} (a CUDA grid y limit), got {HV} * {K}"
  if jnp.dtype(g.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
    return f"g must be bfloat16 or float32, got {jnp.dtype(g.dtype).name}"
  if valid.shape != (1, Ta):
    return f"valid must have shape {(1, Ta)}, got {valid.shape}"
  if use_gate_in_kernel:
    if lower_bound is None and A_log is None:
      return "gate activation without lower_bound requires A_log [HV], got None"
    if A_log is not None and A_log.shape != (HV,):
      return f"A_log must have shape {(HV,)}, got {A_log.shape}"
    if dt_bias is not None and dt_bias.size != HV * K:
      return f"dt_bias must have {HV * K} elements, got shape {dt_bias.shape}"
  return None


def takes(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, **_) -> Optional[str]:
  """The stage's predicate: `supports`, and HV * K a multiple of 128, where the kernel reads and
  writes the arrays in place; for other widths `apply` pads the columns (an XLA copy in, one out),
  which the pallas kernel does without."""
  reason = supports(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                    lower_bound=lower_bound)
  if reason is None and (g.shape[2] * g.shape[3]) % COLS:
    reason = (f"mosaic_gpu gate takes HV * K a multiple of {COLS} (one thread per column), got "
              f"{g.shape[2]} * {g.shape[3]}")
  return reason


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


def _body(*refs, BT, act, lower_bound, has_a, has_bias, stage_stores, unroll):
  # GMEM: g [Ta, C] (input dtype), valid [Ta] f32, (a [C] f32), (bias [C] f32) -> g_act, gc_int,
  # gc_frac [Ta, C] f32. SMEM: the g tile [BT, 128], valid [BT], (three f32 output tiles), a barrier.
  refs = list(refs)
  g_g, valid_g = refs.pop(0), refs.pop(0)
  a_g = refs.pop(0) if has_a else None
  bias_g = refs.pop(0) if has_bias else None
  outs_g, (g_s, valid_s), bar = refs[:3], refs[3:5], refs[-1]
  outs_s = refs[5:8] if stage_stores else None
  j, c = lax.axis_index("j"), lax.axis_index("c")
  start = pl.multiple_of(c * BT, BT)
  cols = pl.ds(pl.multiple_of(j * COLS, COLS), COLS)
  plgpu.copy_gmem_to_smem(g_g.at[pl.ds(start, BT), cols], g_s, bar)
  plgpu.copy_gmem_to_smem(valid_g.at[pl.ds(start, BT)], valid_s, bar)
  a = plgpu.load(a_g.at[cols], layout=LINE, optimized=False) if has_a else None
  bias = plgpu.load(bias_g.at[cols], layout=LINE, optimized=False) if has_bias else None
  plgpu.barrier_wait(bar)

  def step(r, carry):
    acc_i, acc_f = carry
    x = plgpu.load(g_s.at[r], layout=LINE, optimized=False).astype(F32)
    if act:
      if has_bias:
        x = x + bias
      if lower_bound is None:
        x = -a * _softplus(x)
      else:
        x = lower_bound * jax.nn.sigmoid(x if a is None else a * x)
    x = floor(x)
    # a select, not a product: padding gates may be NaN. Broadcast explicitly: Warpgroup semantics
    # has no implicit scalar broadcast.
    x = jnp.where(lax.broadcast(valid_s[r], (COLS,)) > 0.0, x, 0.0)
    whole = _ceil(x)
    acc_i = acc_i + whole
    acc_f = acc_f + (x - whole)
    for k, v in enumerate((x, acc_i, acc_f)):
      if stage_stores:
        outs_s[k].at[r][...] = v
      else:
        outs_g[k][start + r, cols] = v
    return acc_i, acc_f

  zero = plgpu.layout_cast(jnp.zeros((COLS,), F32), LINE)
  lax.fori_loop(0, BT, step, (zero, zero), unroll=unroll)
  if stage_stores:
    plgpu.commit_smem()
    for o_s, o_g in zip(outs_s, outs_g):
      plgpu.copy_smem_to_gmem(o_s, o_g.at[pl.ds(start, BT), cols])
    plgpu.wait_smem_to_gmem(0)


def apply(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound, interpret=False,
          config=None):
  config = config or Config()
  reason = supports(g, valid, A_log, dt_bias, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel,
                    lower_bound=lower_bound)
  if reason is not None:
    raise ValueError(f"mosaic_gpu gate kernel: {reason}")
  BT = chunk_size
  _, Ta, HV, K = g.shape
  C = HV * K
  Cp = -(-C // COLS) * COLS                   # columns padded with zeros, cut off afterwards
  has_a = use_gate_in_kernel and A_log is not None
  has_bias = use_gate_in_kernel and dt_bias is not None
  pad = lambda x: pad_dim(x, x.ndim - 1, Cp)
  args = [pad(g.reshape(Ta, C)), valid[0].astype(F32)]
  if has_a:
    args.append(pad(jnp.repeat(jnp.exp(A_log.astype(F32)), K)))
  if has_bias:
    args.append(pad(dt_bias.astype(F32).reshape(C)))
  sem = plgpu.LoweringSemantics.Lane if config.lane_semantics else plgpu.LoweringSemantics.Warpgroup
  body = lambda *refs: _body(*refs, BT=BT, act=use_gate_in_kernel,
                             lower_bound=None if lower_bound is None else float(lower_bound),
                             has_a=has_a, has_bias=has_bias, stage_stores=config.stage_stores,
                             unroll=config.unroll)
  scratch = [plgpu.SMEM((BT, COLS), g.dtype), plgpu.SMEM((BT,), F32)]
  if config.stage_stores:
    scratch += [plgpu.SMEM((BT, COLS), F32)] * 3
  scratch.append(plgpu.Barrier(num_arrivals=2))   # the g tile and valid
  shape = jax.ShapeDtypeStruct((Ta, Cp), F32)
  f = plgpu.kernel(
      body, out_type=(shape, shape, shape), grid=(Cp // COLS, Ta // BT), grid_names=("j", "c"),
      scratch_types=scratch, compiler_params=plgpu.CompilerParams(lowering_semantics=sem),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return Out(*(x[:, :C].reshape(1, Ta, HV, K) for x in f(*args)))
