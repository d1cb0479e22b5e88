"""state -> output fused: the Pallas Mosaic GPU (Hopper) kernel; the math is in kda.fused.state_output.

`apply(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size,
rows=None, T=None)` -> (o [1, Ta, HV, V] float32 (or bf16: Config.out_dtype), final_state
[N, HV, K, V] float32); o is 0 at padding tokens (qg = Aqk = 0 there) and on the chunks past
aligned_cu[-1]. With rows = padding.chunk_rows(layout) and the packed length T (packed mode), o is
[1, T, HV, V] in the packed layout instead, equal bit for bit to padding.unalign_with(layout, o)
of the aligned mode, so the pipeline needs no unalign gather (see "Packed mode" below).

Kernel: one program per (sequence rank r, value head h, V tile of BV = 64 columns), grid
(N, HV, V // BV) longest sequence first, as the state kernel (kda.stages.state.mosaic_gpu, whose
grid, tail and ordering notes hold here too). It walks its sequence's chunks carrying S [K, BV]
float32 in registers; per chunk c, with the next chunk's tiles in flight (two SMEM slots per
input, TMA):

    v_new = u_c - w_c @ bf16(S)                              wgmma [64, K] @ [K, BV]
    o_c   = scale * qg_c @ bf16(S) + Aqk_c @ bf16(v_new)     wgmmas [64, K] @ [K, BV], [64, 64] @ [64, BV]
    S     = decay_c[:, None] * S + kg_c^T @ bf16(v_new)      wgmma [K, 64] @ [64, BV] (kg_s.T view)
    o_c   -> SMEM stage -> TMA store

Two variants (Config.warp_specialized):
- serial: one warpgroup does all four wgmmas per chunk, in two pairs issued together: w @ S and
  qg @ S (one bf16(S) copy feeds both), then Aqk @ v_new and kg^T @ v_new; o is formed and stored
  while the second of these still runs (wgmma_accumulator_load with wait_n=1). With
  Config(input_slots=1) it loads each chunk's tiles when it gets there instead of prefetching
  them, so two programs can share an SM and hide each other's loads.
- warp-specialised: two warpgroups. Warpgroup 0 carries S (v_new, the S update) and publishes
  bf16(S) and bf16(v_new) of chunk c in SMEM slot c % 2 (barrier `ready`); warpgroup 1 loads qg
  and Aqk itself, computes and stores o_c from that slot and hands it back (barrier `free`). With
  two slots warpgroup 0 runs up to two chunks ahead, so the output's wgmmas and stores leave the
  serial chain. Both warpgroups finish on a common barrier (one exiting while the other still
  issues wgmmas faults).

What is bf16: kg, w, u, qg, Aqk (cast in the launcher if they come in float32; the predicate
`supports` refuses float32 ones, as the stages' predicates do), and the wgmma operand copies
bf16(S), bf16(v_new). S, the decay (formed in the launcher from each chunk's last gate row,
[NTa, HV, K]), the accumulators and final_state are float32. The roundings are those of the state
kernel feeding the output kernel with bf16 h and v_new, so o agrees with that composition to
float32 summation order.

Grouped walk (serial variant, Config.group_chunks = G, 8 by default; where P = cdiv(NTa, G) < N):
grid (P, HV, V // BV), program rank r takes group order[r] (the most chunks first), the
consecutive sequences whose first chunk lies in [p * G, (p + 1) * G) (`_mosaic_gpu.sequence_groups`,
N-sized XLA ops). It walks their chunks as one run, sequence by sequence: S from each one's h0,
final_state stored at each one's end, the next chunk's tiles prefetched across the sequence
boundaries, so short sequences do not each pay an empty pipeline; the tail chunks and the packed
gaps go round-robin over the P programs. The arithmetic per chunk is unchanged (the same bits).

Tail: the chunks past aligned_cu[-1] get o = 0 from the kernel (the N programs of each (head,
V tile) take them round-robin with TMA stores of one zeroed SMEM tile, as the state kernel does for
h), so o is defined everywhere without a pass over it in the launcher.

Packed mode (rows, T given): the same arithmetic; only o's store and the zeros differ.
- The launcher gathers from rows, per sequence, its packed rows [start, end) (at its first and last
  chunk) and the packed gaps no sequence owns (`_packed_table`: N + 1 ranges, from a sort of the N
  starts; N-sized XLA ops only). Each program reads its two scalars once, so chunk i goes to packed
  row start + i * BT with count min(end - row, BT) rows.
- The o stage is plain untransformed SMEM (BT, BV) (also for a bf16 o, swizzled in the aligned
  mode): TMA takes it at any packed row (a swizzled tile needs rows that are multiples of 8) and
  any row offset of it is 128-byte aligned (a row is 128 or 256 bytes). Config.stage_o is ignored:
  o always goes through it.
- A chunk's store never writes a packed row past start + count - 1, since the next sequence's
  rows there belong to another program running concurrently. So count is split into its binary
  digits: one statically sized TMA store of 64, 32, 16, 8, 4, 2, 1 rows per set bit, at increasing
  offsets of the stage, each issued under pl.when (kda._mosaic_gpu.store_rows). A full chunk
  (count = 64) is one store; a sequence's last, partial chunk takes at most 6. Register stores
  cannot be masked by row, and TMA's clipping happens only at the array's end.
- The zeros: the tokens no sequence owns (after cu_seqlens[-1], before the first sequence, and the
  gaps between segment_ids runs) are zeroed in the kernel, in place of the aligned mode's tail
  chunks. Rank r zeroes gap r and rank N - 1 also gap N (the end), in pieces of 64 rows (the last
  piece split as above) from a zeroed stage. The gaps are disjoint from every sequence's rows, so
  no program writes another one's rows, and there is no pass over o in the launcher.

Inverse (`inverse=(Ainv, its low bf16 part)`; serial variant only): w, u are kd = beta k exp(gc)
and beta v, and X = Ainv comes as its bf16 split (hi, lo) [Ta, HV, BT], two more tiles per input
slot. Per chunk, after w @ bf16(S):

    y     = u - wS  ->  bf16 split (yh, yl)
    v_new = Xh @ yh + Xh @ yl + Xl @ yh                      three wgmmas [64, 64] @ [64, BV]

then o and S as above: v_new is rounded to bf16 once, as u - w S is (rounding y first would cost
the final state's fidelity). The intra solve (kda.stages.intra.mosaic_gpu, defer) then forms no
w, u, which fits it three CTAs per SM; this kernel pays one more dependent wgmma group per chunk.

SMEM per program (bytes, BT = 64, BV = 64; `scratch`, `smem_bytes`), with the f32 o stage (a bf16 o
saves 8192, stage_o=False 14336; packed mode: the same, except that stage_o=False keeps the stage):
    serial:                   K = 128: 173072, K = 64: 115728
    serial, input_slots=1:    K = 128: 107528, K = 64:  74760
    warp-specialised:         K = 128: 197704, K = 64: 132168
    inverse (serial):         K = 128: 214032
  kg, w, qg, u, Aqk, decay per input slot: 384 K + 16384 + 4 K (each buffer from a 1 KiB boundary);
  X's split 16384 per slot and the right-hand side's low part 8192 (inverse); bf16(S) and
  bf16(v_new): one slot (serial) or two (warp-specialised) x (128 K + 8192); o stage 16384. Two
  programs fit an SM's 228 KiB up to ~115 KiB each.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda import padding
from kda._mosaic_gpu import BF16, F32, MAX_GRID_YZ, bf16_reason, walk_order, with_absent
from kda._mosaic_gpu import params as _params, smem_bytes as _smem_bytes, smem_reason
from kda._mosaic_gpu import swz as _swz
from kda.fused.state_output.kernel import BT, BV, body as _body
from kda.stages.state import chunk_decay
from kda.stages.state import mosaic_gpu as state_mgpu

OUT_DTYPES = {"float32": F32, "bfloat16": BF16}


@dataclasses.dataclass(frozen=True)
class Config:
  """Variants of the fused state -> output kernel; they depend on K, V, BT and dtype only."""
  warp_specialized: bool = False  # warpgroup 0 carries S, warpgroup 1 computes o (module docstring)
  out_dtype: str = "float32"      # o as stored: "float32" or "bfloat16"
  longest_first: bool = True      # rank r of the grid takes the r-th longest sequence
  # serial only: 1 input slot (no prefetch) so that two programs may share an SM instead
  input_slots: int = 2
  stage_o: bool = True            # o through SMEM + TMA (else registers -> GMEM stores; aligned mode only)
  # serial only: > 0 walks groups of consecutive sequences (those starting in the same window of
  # this many chunks) per program where that makes fewer programs than sequences; 0: one per sequence
  group_chunks: int = 8

  def __post_init__(self):
    if self.input_slots not in (1, 2):
      raise ValueError(f"input_slots must be 1 or 2, got {self.input_slots}")
    if self.warp_specialized and self.input_slots != 2:
      raise ValueError("the warp-specialised variant needs input_slots=2")
    if not isinstance(self.group_chunks, int) or isinstance(self.group_chunks, bool) or self.group_chunks < 0:
      raise ValueError(f"group_chunks must be an int >= 0, got {self.group_chunks!r}")
    if self.out_dtype not in OUT_DTYPES:
      raise ValueError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {self.out_dtype!r}")


def scratch(K, config, *, packed=False, inverse=False):
  """The kernel's scratch_types: kg, w [64, K], u [64, BV], the decay rows [K] f32, qg [64, K], Aqk
  [64, 64] (input_slots each), X's split [64, 64] (inverse, per slot) and the right-hand side's low
  part [64, BV] (inverse), bf16(S) [K, BV] and bf16(v_new) [64, BV] (one slot, two when
  warp-specialised), the o stage [64, BV] (plain in packed mode; an 8-row placeholder without
  stage_o), the barriers."""
  split, ns = config.warp_specialized, config.input_slots
  odt = OUT_DTYPES[config.out_dtype]
  pub = 2 if split else 1                    # slots of the published bf16(S), bf16(v_new)
  if split:
    bars = [plgpu.Barrier(num_arrivals=4, num_barriers=2),          # w, kg, u, decay
            plgpu.Barrier(num_arrivals=2, num_barriers=2),          # qg, Aqk
            plgpu.Barrier(num_arrivals=1, num_barriers=2),          # ready: slot published
            plgpu.Barrier(num_arrivals=1, num_barriers=2),          # free: slot consumed
            plgpu.Barrier(num_arrivals=2)]                          # done
  else:
    bars = [plgpu.Barrier(num_arrivals=6 + 2 * inverse, num_barriers=ns)]
  if packed:                                 # untransformed: TMA stores at any row, of any count
    o_stage = plgpu.SMEM((BT, BV), odt)
  elif config.stage_o:
    o_stage = _swz((BT, BV), BF16) if odt == BF16 else plgpu.SMEM((BT, BV), F32)
  else:
    o_stage = plgpu.SMEM((8, BV), odt)                               # unused placeholder
  return [
      _swz((ns, BT, K)), _swz((ns, BT, K)), _swz((ns, BT, BV)),  # kg, w, u
      plgpu.SMEM((ns, K), F32),                                 # decay rows
      _swz((ns, BT, K)), _swz((ns, BT, BT)),                    # qg, Aqk
      *[_swz((ns, BT, BT))] * (2 * inverse),                    # X's split
      *[_swz((BT, BV))] * inverse,                              # the rhs's low part
      _swz((pub, K, BV)), _swz((pub, BT, BV)),                  # bf16(S), bf16(v_new)
      o_stage,
      *bars,
  ]


def smem_bytes(K, config=None, *, packed=False, inverse=False):
  """The SMEM the kernel asks for (as lowered for CUDA)."""
  return _smem_bytes(scratch(K, config or Config(), packed=packed, inverse=bool(inverse)))


def _config(config, out_dtype):
  """The call's Config: `out_dtype` (float32 or bfloat16), where given, overrides config.out_dtype."""
  config = config or Config()
  if out_dtype is not None:
    config = dataclasses.replace(config, out_dtype=jnp.dtype(out_dtype).name)
  return config


def _inverse_reason(inverse, kg, config, chunk_size):
  """None if the `inverse` mode takes X's split `inverse`, else why."""
  if config.warp_specialized:
    return "inverse (Ainv applied in the kernel) runs the serial variant only"
  want = kg.shape[:3] + (chunk_size,)
  try:
    xh, xl = inverse
  except (TypeError, ValueError):
    return f"inverse must be a pair (Ainv, its low part), got {type(inverse).__name__}"
  for name, x in (("Ainv", xh), ("Ainv's low part", xl)):
    if getattr(x, "shape", None) != want or jnp.dtype(x.dtype) != jnp.dtype(BF16):
      return f"inverse: {name} must be bfloat16 {want}, got {getattr(x, 'dtype', None)} {getattr(x, 'shape', None)}"
  return None


def _kernel_reason(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, config, rows,
                   T, inverse) -> Optional[str]:
  """None if the kernel runs this call (shapes; dtypes bf16 or float32; with `rows`, a ChunkRows of
  int32 [NTa] arrays and a static packed length T; its SMEM), else the reason."""
  reason = state_mgpu.shape_reason(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size)
  if reason is not None:
    return reason
  if rows is not None:
    NTa = kg.shape[1] // chunk_size
    if not isinstance(T, int) or isinstance(T, bool) or T < 0:
      return f"packed mode (rows given) needs the packed length T as a static int >= 0, got {T!r}"
    try:
      src, count = rows
    except (TypeError, ValueError):
      return f"rows must be a padding.ChunkRows (src, count), got {type(rows).__name__}"
    for name, x in (("rows.src", src), ("rows.count", count)):
      if getattr(x, "shape", None) != (NTa,) or jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        return (f"{name} must be int32 [{NTa}] (one per aligned chunk), got "
                f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', None)}")
  elif T is not None:
    return "T is only taken with rows (packed mode)"
  if qg.shape != kg.shape:
    return f"qg must have kg's shape {kg.shape}, got {qg.shape}"
  if Aqk.shape != kg.shape[:3] + (chunk_size,):
    return f"Aqk must have shape {kg.shape[:3] + (chunk_size,)}, got {Aqk.shape}"
  for name, x in (("qg", qg), ("Aqk", Aqk)):
    if jnp.dtype(x.dtype) not in (jnp.dtype(BF16), jnp.dtype(F32)):
      return f"{name} must be bfloat16 or float32, got {jnp.dtype(x.dtype).name}"
  if inverse is not None:
    reason = _inverse_reason(inverse, kg, config, chunk_size)
    if reason is not None:
      return reason
  return smem_reason(smem_bytes(kg.shape[-1], config, packed=rows is not None, inverse=inverse is not None))


def supports(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, config=None,
             out_dtype=None, rows=None, T=None, decay=None, inverse=None, **_) -> Optional[str]:
  """The group's predicate: None if `apply` takes this call, else the reason in words; bf16 kg, w,
  u, qg, Aqk only (the dtype policy's bf16 intermediates). The keywords as `apply`'s."""
  if decay is not None:
    gc_int = gc_frac = jax.ShapeDtypeStruct(kg.shape, F32)
  reason = _kernel_reason(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                          config=_config(config, out_dtype), rows=rows, T=T, inverse=inverse)
  return reason or bf16_reason("state_output", kg=kg, w=w, u=u, qg=qg, Aqk=Aqk)


def _packed_table(rows, aligned_cu, T, BT):
  """[4N + 2] int32 for packed mode: padding.packed_gaps (each sequence's packed rows [start, end),
  then the N + 1 packed gaps [lo, hi) that no sequence owns) concatenated."""
  return jnp.concatenate(padding.packed_gaps(rows, aligned_cu, T, BT))


def apply(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size,
          interpret=False, config=None, out_dtype=None, rows=None, T=None, zero_h0=False,
          store_final=True, decay=None, inverse=None):
  """(o [1, Ta, HV, V], final_state [N, HV, K, V] float32); see the module docstring. `out_dtype`
  (float32 or bfloat16) overrides config.out_dtype: the pipeline asks for v's dtype, as o ends in it.

  Packed mode: with `rows` (padding.chunk_rows(layout), int32 [NTa] src and count) and the packed
  length T (static int), o is [1, T, HV, V] = padding.unalign_with(layout, o of the aligned mode),
  bit for bit: each chunk's o goes from its SMEM stage straight to packed rows src[c] + r,
  r < count[c], and the tokens that no sequence owns are 0 (module docstring, "Packed mode").
  zero_h0: initial_state is known to be zero (not read); store_final=False: the final state is not
  stored (zeros are returned in its place, for callers that drop it). decay ([NTa, HV, K] float32,
  chunk_decay's, e.g. from kda.fused.gate_intra) stands for gc_int, gc_frac, which may then be None.
  inverse ((Ainv, its low bf16 part), each [1, Ta, HV, BT] bf16; the serial variant): w and u are
  kd = beta k exp(gc) and beta v instead, and the kernel forms v_new = Ainv (beta v - kd S) (module
  docstring, "Inverse"). float32 kg, w, u, qg, Aqk are rounded to bf16 (`supports` refuses them)."""
  config = _config(config, out_dtype)
  if decay is not None:
    gc_int = gc_frac = jax.ShapeDtypeStruct(kg.shape, F32)
  reason = _kernel_reason(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                          config=config, rows=rows, T=T, inverse=inverse)
  if reason is not None:
    raise ValueError(f"mosaic_gpu state_output kernel: {reason}")
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  N = aligned_cu.shape[0] - 1
  odt = OUT_DTYPES[config.out_dtype]
  packed = rows is not None
  To = T if packed else Ta                    # o's rows
  if N == 0:                                  # no program to launch; every chunk is tail
    return jnp.zeros((1, To, HV, V), odt), jnp.zeros((0, HV, K, V), F32)
  aligned_cu = aligned_cu.astype(jnp.int32)
  table = (_packed_table(rows, aligned_cu, T, BT),) if packed else ()
  NTa = Ta // BT
  G = 0 if config.warp_specialized else config.group_chunks
  order, bounds = walk_order(aligned_cu, NTa, G, config.longest_first, BT)
  grouped = bounds is not None
  if grouped:
    table = (bounds, *table)
  R = order.shape[0]                         # programs per (head, V tile)
  if decay is None:
    decay = chunk_decay(gc_int, gc_frac, BT)                        # [NTa, HV, K] f32
  kg, w, u, qg, Aqk = (x[0].astype(BF16) for x in (kg, w, u, qg, Aqk))

  if R <= MAX_GRID_YZ:
    grid, names = (R, HV, V // BV), ("r", "h", "v")
  else:
    grid, names = (V // BV, HV, R), ("v", "h", "r")
  split = config.warp_specialized
  inv = inverse is not None
  body = lambda *refs: _body(*refs, scale=float(scale), split=split, stage_o=config.stage_o,
                             packed=packed, inverse=inv, **({"grouped": True} if grouped else {}))
  base = 2 + grouped + packed + 2 * inv      # order, cu (the groups, the packed table; X's split) first
  absent = [base + 6] * zero_h0 + [base + 8] * (not store_final)   # h0_g, ht_g in _body's refs
  if absent:
    body = with_absent(body, absent)
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((To, HV, V), odt),
                *[jax.ShapeDtypeStruct((N, HV, K, V), F32)] * store_final),
      grid=grid, grid_names=names,
      scratch_types=scratch(K, config, packed=packed, inverse=inv),
      compiler_params=_params(False),
      kernel_name="kda_state_output", interpret=plgpu.InterpretGPUParams() if interpret else None,
      **(dict(num_threads=2, thread_name="wg") if split else {}),
  )
  h0 = () if zero_h0 else (initial_state.astype(F32),)
  xs = tuple(x[0].astype(BF16) for x in inverse) if inv else ()
  o, *final = f(order, aligned_cu, *table, kg, w, u, decay, qg, Aqk, *xs, *h0)
  return o[None], (final[0] if store_final else jnp.zeros((N, HV, K, V), F32))
