"""state: the Pallas Mosaic TPU kernel; the math is in kda.stages.state.

Kernel: grid (HV / MB, NTa), ("parallel", "arbitrary"): the chunk axis walks every chunk in order,
carrying the float32 states of MB value heads in a VMEM scratch (MB, Vp, Kp), transposed (S^T [V, K],
kda._mosaic_tpu: the decay row exp(gc_last) [1, Kp] then scales its columns by a sublane broadcast).
Scalar prefetch (SMEM, kda._mosaic_tpu.chunk_flags): blk [NTa], the sequence whose initial / final
state block a chunk maps to, and flags [NTa] (FIRST, LAST, TAIL). Per program (p, c):

    FIRST:   S <- h0[blk[c]]       a select: the previous sequence's state (NaN included) is
                                   overwritten, never multiplied by 0
    TAIL:    S <- 0                chunks at or past aligned_cu[-1] belong to no sequence
    h[c]   = S                     (emit_h)
    v_new  = u - w @ S             NT dot [BT, Kp] x [Vp, Kp]
    S      <- S * decay_c + v_new^T @ kg     TN dot [BT, Vp]^T x [BT, Kp]
    LAST:    final[blk[c]] <- S

`begin_chunk`, `state_chunk` and `end_chunk` are the body's three parts; kda.fused.state_output.mosaic_tpu
calls them too. Blocks: kg, w (MB, BT, Kp) and u (MB, BT, Vp) in their dtype; decay (MB, 1, Kp) f32
from [HV, NTa, 1, Kp] (exp of each chunk's last gc row, formed in the launcher: chunk_decay reads only
those rows); h0 and final (MB, Vp, Kp) f32 at block blk[c] (consecutive chunks of a sequence keep the
index, so h0 is fetched once per sequence and final written back once, at its last chunk; the tail's
chunks map to the last sequence, so every block is visited on consecutive steps only); h
(MB, Vp, Kp) per chunk; v_new (MB, BT, Vp). Sequences with no chunk (empty) get final = h0 in the
launcher.

Dots take bf16 operands, bf16(S) and bf16(v_new), for bf16 kg, w, u (one MXU pass, f32 accumulation)
and f32 at HIGHEST otherwise; S and final stay float32. h and v_new are stored in kg's dtype
(Config.h_dtype overrides h's): as bf16 they are the very operands the output kernel's dots round to.

VMEM (K = V = 128, BT = 64, per head; kda._mosaic_tpu.budget): scratch 64 KiB; blocks kg, w, u
48 KiB (bf16) / 96 KiB (f32), h0, final 128 KiB, h 32 / 64 KiB, v_new 16 / 32 KiB, double-buffered;
values ~0.3 MiB. MB = 8 on every generation: 6.1 MiB (bf16) / 7.6 MiB (f32), under the default
scoped limits.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda import _mosaic_tpu as tpu
from kda.stages.state import NAME, Out, chunk_decay

F32 = tpu.F32
MAX_CHUNKS = 1 << 16   # blk and flags: 2 x 4 bytes per chunk of SMEM's 1 MiB, half of it at most


@dataclasses.dataclass(frozen=True)
class Config:
  """MB value heads per program (rounded down to a divisor of HV); h_dtype: h as stored (None: kg's)."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)
  h_dtype: Optional[str] = None

  def __post_init__(self):
    tpu.check_config(self)
    if self.h_dtype not in (None, "float32", "bfloat16"):
      raise ValueError(f"h_dtype must be None, 'float32' or 'bfloat16', got {self.h_dtype!r}")


class Heads(NamedTuple):
  """launch's results, head-first: h [HV, NTa, Vp, Kp] (None unless emit_h), v_new [HV, Ta, Vp]
  (None unless emit_v), final [N, HV, Vp, Kp] f32 (None unless store_final)."""
  h: object
  v_new: object
  final: object


def temps(MB, BT, Kp, Vp):
  return [((MB, Vp, Kp), F32)] * 3 + [((MB, BT, Vp), F32)] * 2


def tiles(MB, BT, Kp, Vp, dtype, h_dtype=None):
  """(blocks, scratch, temps) of one program of the stage kernel."""
  blocks = [((MB, BT, Kp), dtype)] * 2 + [((MB, BT, Vp), dtype), ((MB, 1, Kp), F32)]
  blocks += [((MB, Vp, Kp), F32)] * 2 + [((MB, Vp, Kp), h_dtype or dtype), ((MB, BT, Vp), dtype)]
  return blocks, [((MB, Vp, Kp), F32)], temps(MB, BT, Kp, Vp)


def default_config(K, V, chunk_size, dtype, gen: Optional[tpu.Generation] = None) -> Config:
  """Heads per program for this generation (kda._mosaic_tpu.default_heads)."""
  gen = gen or tpu.generation()
  return Config(heads=tpu.default_heads(lambda mb: tiles(mb, chunk_size, tpu.lanes(K), tpu.lanes(V), dtype), gen))


def begin_chunk(s_ref, h0_ref, flags):
  """Seed the carried state: h0 (zeros where h0_ref is None) at a sequence's first chunk, zeros on
  the tail. Selects, so a previous sequence's state never reaches the next one."""
  @pl.when((flags & tpu.FIRST) != 0)
  def _():
    s_ref[...] = jnp.zeros(s_ref.shape, F32) if h0_ref is None else h0_ref[...]

  @pl.when((flags & tpu.TAIL) != 0)
  def _():
    s_ref[...] = jnp.zeros(s_ref.shape, F32)


def state_chunk(St, kg, w, u, decay, *, mm_dtype):
  """St [MB, Vp, Kp] f32 entering the chunk, kg, w [MB, BT, Kp], u [MB, BT, Vp], decay [MB, 1, Kp] f32
  -> (v_new [MB, BT, Vp] f32, S^T leaving the chunk f32, bf16(v_new) or v_new: the dot operand)."""
  v_new = u.astype(F32) - tpu.dot(w.astype(mm_dtype), St.astype(mm_dtype), tpu.NT)
  vm = v_new.astype(mm_dtype)
  return v_new, St * decay + tpu.dot(vm, kg.astype(mm_dtype), tpu.TN), vm


def end_chunk(ft_ref, s_ref, flags):
  """Store the carried state as the sequence's final state at its last chunk."""
  @pl.when((flags & tpu.LAST) != 0)
  def _():
    ft_ref[...] = s_ref[...]


def supports(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size,
             config=None) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if kg.ndim != 4 or kg.shape[0] != 1 or u.ndim != 4:
    return f"kg, w, u must be [1, Ta, HV, D], got kg {kg.shape}, u {u.shape}"
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  reason = tpu.chunk_reason(chunk_size, Ta)
  for name, x, shape in (("w", w, kg.shape), ("u", u, (1, Ta, HV, V)), ("gc_int", gc_int, kg.shape),
                         ("gc_frac", gc_frac, kg.shape)):
    reason = reason or (None if x.shape == shape else f"{name} must have shape {shape}, got {x.shape}")
  for name, x in (("kg", kg), ("w", w), ("u", u), ("initial_state", initial_state)):
    reason = reason or tpu.float_reason(name, x)
  if reason:
    return reason
  if aligned_cu is None or aligned_cu.ndim != 1 or aligned_cu.shape[0] < 1:
    return "aligned_cu must be an int32 array [N+1]"
  N = aligned_cu.shape[0] - 1
  if Ta // chunk_size > MAX_CHUNKS:
    return f"at most {MAX_CHUNKS} chunks (the chunk table lives in SMEM), got {Ta // chunk_size}"
  if initial_state.shape != (N, HV, K, V):
    return f"initial_state must have shape {(N, HV, K, V)}, got {initial_state.shape}"
  gen = tpu.generation()
  dt = tpu.matmul_dtype(kg.dtype, w.dtype, u.dtype)
  MB = tpu.heads_per_program(HV, (config or default_config(K, V, chunk_size, dt, gen)).heads)
  b = tpu.budget(*tiles(MB, chunk_size, tpu.lanes(K), tpu.lanes(V), dt), gen)
  return tpu.budget_reason(NAME, b, gen)


def _kernel(blk_ref, flag_ref, kg_ref, w_ref, u_ref, dec_ref, *refs, has_h0, emit_h, emit_v, store_final,
            mm_dtype):
  del blk_ref   # read by the index maps
  refs = list(refs)
  h0_ref = refs.pop(0) if has_h0 else None
  h_ref = refs.pop(0) if emit_h else None
  vn_ref = refs.pop(0) if emit_v else None
  ft_ref = refs.pop(0) if store_final else None
  (s_ref,) = refs
  flags = flag_ref[pl.program_id(1)]
  begin_chunk(s_ref, h0_ref, flags)
  St = s_ref[...]
  if emit_h:
    h_ref[...] = St.astype(h_ref.dtype)
  v_new, St, _ = state_chunk(St, kg_ref[...], w_ref[...], u_ref[...], dec_ref[...], mm_dtype=mm_dtype)
  s_ref[...] = St
  if emit_v:
    vn_ref[...] = v_new.astype(vn_ref.dtype)
  if store_final:
    end_chunk(ft_ref, s_ref, flags)


def state_specs(MB, BT, Kp, Vp):
  """BlockSpecs (kg, w, u, decay, h0 / final) of a grid (HV / MB, NTa) with two prefetched arrays."""
  row = lambda D: pl.BlockSpec((MB, BT, D), lambda p, c, blk, fl: (p, c, 0))
  dec = pl.BlockSpec((MB, None, 1, Kp), lambda p, c, blk, fl: (p, c, 0, 0))
  seq = pl.BlockSpec((None, MB, Vp, Kp), lambda p, c, blk, fl: (blk[c], p, 0, 0))
  return row, dec, seq


def launch(kg, w, u, decay, h0, blk, flags, *, N, chunk_size, config, emit_h=True, emit_v=True,
           store_final=True, interpret=False) -> Heads:
  """The kernel on head-first arrays: kg, w [HV, Ta, Kp], u [HV, Ta, Vp], decay [HV, NTa, 1, Kp] f32,
  h0 [N, HV, Vp, Kp] f32 or None (zero initial states), blk, flags [NTa] int32 (chunk_flags), N >= 1."""
  HV, Ta, Kp = kg.shape
  Vp = u.shape[-1]
  BT, gen = chunk_size, tpu.generation()
  NTa = Ta // BT
  MB = tpu.heads_per_program(HV, config.heads)
  row, dec, seq = state_specs(MB, BT, Kp, Vp)
  hdt = jnp.dtype(config.h_dtype or kg.dtype)
  in_specs = [row(Kp), row(Kp), row(Vp), dec] + [seq] * (h0 is not None)
  outs, out_specs = [], []
  if emit_h:
    outs.append(tpu.struct((HV, NTa, Vp, Kp), hdt, kg, w, u))
    out_specs.append(pl.BlockSpec((MB, None, Vp, Kp), lambda p, c, blk, fl: (p, c, 0, 0)))
  if emit_v:
    outs.append(tpu.struct((HV, Ta, Vp), kg.dtype, kg, w, u))
    out_specs.append(row(Vp))
  if store_final:
    outs.append(tpu.struct((N, HV, Vp, Kp), F32, kg, w, u))
    out_specs.append(seq)
  args = [x for x in (kg, w, u, decay, h0) if x is not None]
  b = tpu.budget(*tiles(MB, BT, Kp, Vp, kg.dtype, hdt), gen)
  kernel = functools.partial(_kernel, has_h0=h0 is not None, emit_h=emit_h, emit_v=emit_v,
                             store_final=store_final, mm_dtype=tpu.matmul_dtype(kg.dtype))
  res = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(HV // MB, NTa), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((MB, Vp, Kp), F32)]),
      out_shape=outs,
      compiler_params=tpu.compiler_params(("parallel", "arbitrary"), b, config.vmem_limit),
      cost_estimate=tpu.cost(4 * HV * Ta * Kp * Vp + 2 * HV * NTa * Kp * Vp, 0,
                             tpu.nbytes(*args) + tpu.nbytes(*outs)),
      interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}_tpu")(blk, flags, *args)
  res = list(res)
  return Heads(res.pop(0) if emit_h else None, res.pop(0) if emit_v else None, res.pop(0) if store_final else None)


def prepare(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size, zero_h0, decay=None):
  """Stage-layout inputs -> the launch arguments (head-first kg, w, u in the dot dtype, decay, h0,
  blk, flags). decay ([NTa, HV, K] f32, chunk_decay's) stands for gc_int, gc_frac when given."""
  dt = tpu.matmul_dtype(kg.dtype, w.dtype, u.dtype)
  if decay is None:
    decay = chunk_decay(gc_int, gc_frac, chunk_size)
  blk, flags = tpu.chunk_flags(aligned_cu, kg.shape[1] // chunk_size, chunk_size)
  h0 = None if zero_h0 else tpu.states_to_heads(initial_state)
  return (tpu.to_heads(kg, dt), tpu.to_heads(w, dt), tpu.to_heads(u, dt), tpu.decay_to_heads(decay), h0,
          blk, flags)


def final_states(ft, initial_state, aligned_cu, K, V, zero_h0=False):
  """The kernel's final states [N, HV, Vp, Kp] -> [N, HV, K, V], initial_state where a sequence is
  empty (it owns no chunk, so the kernel never wrote its block)."""
  h0 = jnp.zeros(initial_state.shape, F32) if zero_h0 else initial_state.astype(F32)
  empty = tpu.empty_sequences(aligned_cu)[:, None, None, None]
  return jnp.where(empty, h0, tpu.states_from_heads(ft, K, V))


def apply(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, interpret=False, config=None,
          zero_h0=False, store_final=True):
  """zero_h0: initial_state is known to be zero (not read); store_final=False: final_state is not
  stored (zeros are returned in its place)."""
  reason = supports(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_tpu state kernel: {reason}")
  _, Ta, HV, K = kg.shape
  V, N, NTa = u.shape[-1], aligned_cu.shape[0] - 1, Ta // chunk_size
  dt = tpu.matmul_dtype(kg.dtype, w.dtype, u.dtype)
  config = config or default_config(K, V, chunk_size, dt)
  hdt = jnp.dtype(config.h_dtype or dt)
  if N == 0:                                  # every chunk is tail
    return Out(jnp.zeros((1, NTa, HV, K, V), hdt), jnp.zeros((1, Ta, HV, V), dt), jnp.zeros((0, HV, K, V), F32))
  aligned_cu = aligned_cu.astype(jnp.int32)
  args = prepare(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size, zero_h0)
  r = launch(*args, N=N, chunk_size=chunk_size, config=config, store_final=store_final,
             interpret=interpret)
  final = (final_states(r.final, initial_state, aligned_cu, K, V, zero_h0) if store_final
           else jnp.zeros((N, HV, K, V), F32))
  return Out(tpu.h_from_heads(r.h, K, V), tpu.from_heads(r.v_new, V), final)
