"""state -> output fused, Pallas Mosaic TPU: the state recurrence and the output in one kernel (the
math is in kda.stages.state and kda.stages.output). The forward needs neither h nor v_new (the
backward recomputes them), so the state never leaves VMEM and v_new never reaches HBM.

`apply(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size, ...)`
-> Out(o [1, Ta, HV, V], final_state [N, HV, K, V] float32); o is 0 at padding tokens and on the
chunks past aligned_cu[-1] (qg = Aqk = u = 0 there).

Kernel: the state kernel's grid (HV / MB, NTa), ("parallel", "arbitrary"), its scalar-prefetched
chunk table, its f32 VMEM scratch (MB, Vp, Kp) carrying S^T across the chunk axis and its blocks
(kda.stages.state.mosaic_tpu), plus qg (MB, BT, Kp) and Aqk (MB, BT, BT) in, o (MB, BT, Vp) out.
Per program, with the state kernel's begin_chunk / state_chunk / end_chunk and the output kernel's
output_chunk:

    S at the chunk's start (h0 at a sequence's first chunk, 0 on the tail)
    v_new = u - w @ S
    o     = scale * qg @ S + Aqk @ v_new        the dots' operands are bf16(S), bf16(v_new) for bf16
    S    <- S * decay + v_new^T @ kg            inputs: the very values the unfused pair stores
    final state at a sequence's last chunk

so o equals the unfused state + output kernels' (h and v_new stored in the dot dtype) bit for bit.

VMEM (K = V = 128, BT = 64; kda._mosaic_tpu.budget): the state kernel's blocks without h and v_new,
plus qg, Aqk in and o out: MB = 8 on every generation, 6.8 MiB (bf16) / 8.1 MiB (f32), under the
default scoped limits.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda import _mosaic_tpu as tpu
from kda.stages.output import mosaic_tpu as output_tpu
from kda.stages.state import mosaic_tpu as state_tpu

F32 = tpu.F32
NAME = "state_output"


@dataclasses.dataclass(frozen=True)
class Config:
  """MB value heads per program (rounded down to a divisor of HV); out_dtype: o as stored."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)
  out_dtype: str = "float32"

  def __post_init__(self):
    tpu.check_config(self)
    if self.out_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"out_dtype must be 'float32' or 'bfloat16', got {self.out_dtype!r}")


class Out(NamedTuple):
  o: jax.Array            # [1, Ta, HV, V] out_dtype
  final_state: jax.Array  # [N, HV, K, V] float32


def tiles(MB, BT, Kp, Vp, dtype, out_dtype=F32):
  blocks = [((MB, BT, Kp), dtype)] * 3 + [((MB, BT, Vp), dtype), ((MB, 1, Kp), F32), ((MB, BT, BT), dtype)]
  blocks += [((MB, Vp, Kp), F32)] * 2 + [((MB, BT, Vp), out_dtype)]
  temps = state_tpu.temps(MB, BT, Kp, Vp) + [((MB, BT, Vp), F32)] * 2
  return blocks, [((MB, Vp, Kp), F32)], temps


def default_config(K, V, chunk_size, dtype, gen: Optional[tpu.Generation] = None) -> Config:
  """Heads per program for this generation (kda._mosaic_tpu.default_heads)."""
  gen = gen or tpu.generation()
  return Config(heads=tpu.default_heads(lambda mb: tiles(mb, chunk_size, tpu.lanes(K), tpu.lanes(V), dtype), gen))


def supports(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, chunk_size, config=None,
             **_) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words (gc_int, gc_frac may be
  ShapeDtypeStructs where `decay` stands for them)."""
  reason = state_tpu.supports(kg, w, u, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                              config=state_tpu.Config(heads=1))
  if reason:
    return reason
  _, Ta, HV, K = kg.shape
  V = u.shape[-1]
  for name, x, shape in (("qg", qg, kg.shape), ("Aqk", Aqk, (1, Ta, HV, chunk_size))):
    reason = reason or (None if x.shape == shape else f"{name} must have shape {shape}, got {x.shape}")
    reason = reason or tpu.float_reason(name, x)
  if reason:
    return reason
  gen = tpu.generation()
  dt = tpu.matmul_dtype(kg.dtype, w.dtype, u.dtype, qg.dtype, Aqk.dtype)
  MB = tpu.heads_per_program(HV, (config or default_config(K, V, chunk_size, dt, gen)).heads)
  b = tpu.budget(*tiles(MB, chunk_size, tpu.lanes(K), tpu.lanes(V), dt), gen)
  return tpu.budget_reason(NAME, b, gen)


def _kernel(blk_ref, flag_ref, kg_ref, w_ref, u_ref, dec_ref, qg_ref, a_ref, *refs, has_h0, store_final, scale,
            mm_dtype):
  del blk_ref   # read by the index maps
  refs = list(refs)
  h0_ref = refs.pop(0) if has_h0 else None
  o_ref = refs.pop(0)
  ft_ref = refs.pop(0) if store_final else None
  (s_ref,) = refs
  flags = flag_ref[pl.program_id(1)]
  state_tpu.begin_chunk(s_ref, h0_ref, flags)
  St = s_ref[...]
  _, St_next, vm = state_tpu.state_chunk(St, kg_ref[...], w_ref[...], u_ref[...], dec_ref[...], mm_dtype=mm_dtype)
  o_ref[...] = output_tpu.output_chunk(qg_ref[...], St, a_ref[...], vm, scale=scale,
                                       mm_dtype=mm_dtype).astype(o_ref.dtype)
  s_ref[...] = St_next
  if store_final:
    state_tpu.end_chunk(ft_ref, s_ref, flags)


def launch(kg, w, u, decay, h0, blk, flags, qg, Aqk, *, N, scale, chunk_size, config, out_dtype=F32,
           store_final=True, interpret=False):
  """The kernel on head-first arrays (state_tpu.launch's, plus qg [HV, Ta, Kp] and Aqk [HV, Ta, BT])
  -> (o [HV, Ta, Vp], final [N, HV, Vp, Kp] f32 or None)."""
  HV, Ta, Kp = kg.shape
  Vp = u.shape[-1]
  BT, gen = chunk_size, tpu.generation()
  MB = tpu.heads_per_program(HV, config.heads)
  row, dec, seq = state_tpu.state_specs(MB, BT, Kp, Vp)
  in_specs = [row(Kp), row(Kp), row(Vp), dec, row(Kp), row(BT)] + [seq] * (h0 is not None)
  outs = [tpu.struct((HV, Ta, Vp), out_dtype, kg, w, u, qg, Aqk)]
  out_specs = [row(Vp)]
  if store_final:
    outs.append(tpu.struct((N, HV, Vp, Kp), F32, kg, w, u))
    out_specs.append(seq)
  args = [x for x in (kg, w, u, decay, qg, Aqk, h0) if x is not None]
  b = tpu.budget(*tiles(MB, BT, Kp, Vp, kg.dtype, out_dtype), gen)
  kernel = functools.partial(_kernel, has_h0=h0 is not None, store_final=store_final, scale=float(scale),
                             mm_dtype=tpu.matmul_dtype(kg.dtype))
  res = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(HV // MB, Ta // BT), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((MB, Vp, Kp), F32)]),
      out_shape=outs,
      compiler_params=tpu.compiler_params(("parallel", "arbitrary"), b, config.vmem_limit),
      cost_estimate=tpu.cost(2 * HV * Ta * Vp * (3 * Kp + BT), 0, tpu.nbytes(*args) + tpu.nbytes(*outs)),
      interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}_tpu")(blk, flags, *args)
  return res[0], (res[1] if store_final else None)


def apply(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, *, scale, chunk_size, interpret=False,
          config=None, out_dtype=None, zero_h0=False, store_final=True, decay=None) -> Out:
  """See the module docstring. out_dtype (float32 or bfloat16) overrides config.out_dtype; zero_h0:
  initial_state is known to be zero (not read); store_final=False: the final state is not stored
  (zeros are returned in its place); decay ([NTa, HV, K] f32, state.chunk_decay's, e.g. from
  kda.fused.gate_intra.mosaic_tpu) stands for gc_int, gc_frac, which may then be None."""
  if decay is not None:
    gc_int = gc_frac = jax.ShapeDtypeStruct(kg.shape, F32)
  reason = supports(kg, w, u, qg, Aqk, gc_int, gc_frac, initial_state, aligned_cu, chunk_size=chunk_size,
                    config=config)
  if reason is not None:
    raise ValueError(f"mosaic_tpu state_output kernel: {reason}")
  _, Ta, HV, K = kg.shape
  V, N = u.shape[-1], aligned_cu.shape[0] - 1
  dt = tpu.matmul_dtype(kg.dtype, w.dtype, u.dtype, qg.dtype, Aqk.dtype)
  config = config or default_config(K, V, chunk_size, dt)
  odt = jnp.dtype(out_dtype or config.out_dtype)
  if N == 0:
    return Out(jnp.zeros((1, Ta, HV, V), odt), jnp.zeros((0, HV, K, V), F32))
  aligned_cu = aligned_cu.astype(jnp.int32)
  args = state_tpu.prepare(kg.astype(dt), w.astype(dt), u.astype(dt), gc_int, gc_frac, initial_state, aligned_cu,
                           chunk_size, zero_h0, decay)
  o, ft = launch(*args, tpu.to_heads(qg, dt), tpu.square_to_heads(Aqk.astype(dt)), N=N, scale=scale,
                 chunk_size=chunk_size, config=config, out_dtype=odt, store_final=store_final,
                 interpret=interpret)
  final = (state_tpu.final_states(ft, initial_state, aligned_cu, K, V, zero_h0) if store_final
           else jnp.zeros((N, HV, K, V), F32))
  return Out(tpu.from_heads(o, V), final)
