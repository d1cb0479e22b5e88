"""bwd_dh (S2): the Mosaic TPU kernel; the math is in kda.stages.bwd_dh.

One reverse walk over the chunks with the state cotangent in VMEM. Grid (HV / MB, NTa) with
("parallel", "arbitrary"): grid step c visits chunk c' = NTa - 1 - c (every index map reverses it),
so each sequence's chunks are visited last to first, the program carries dS [MB, K, V] float32 in a
VMEM scratch from one step to the next, and per head of the program

    dS_next = dht[n]             at the last chunk of sequence n   (a select: the carry is dropped,
            = 0                  at the tail past aligned_cu[-1]    so a NaN never crosses sequences)
            = carry              otherwise
    du      = dv + kg @ dS_next                 dqg = scale * do @ h^T
    dkg     = v_new @ dS_next^T                 dw  = -du @ h^T
    dgc_last = exp(gc_last) * sum_V(h * dS_next)
    carry   = exp(gc_last)[:, None] * dS_next + scale * qg^T @ do - w^T @ du
    dh0[n]  = carry              at the first chunk of sequence n

Scalar prefetch (SMEM): the chunk -> sequence map (the tail mapped to the last sequence, so its dht /
dh0 blocks follow that sequence's and every block is revisited on consecutive steps only) and
per-chunk FIRST / LAST / TAIL bits (kda._mosaic_tpu_bwd.chunk_flags). dht and dh0 are (MB, K, V)
blocks of [N, HV, K, V] picked by that map. Empty sequences own no chunk, so the kernel never writes
their dh0 block: it is set to dht by a select outside the kernel.

Blocks (head-first, MB heads): qg, kg, w, dqg, dkg, dw (MB, BT, K); v_new, do, dv, du (MB, BT, V);
h (MB, K, V) straight from S0's [1, NTa, HV, K, V]; exp(gc_last) in and dgc_last out as head-group
rows (MB, K) (kda._mosaic_tpu_bwd.rows_in), turned into columns and back in VMEM.
Precision: bf16 do -> bf16 MXU operands with float32 accumulation (dS stays float32 in VMEM);
float32 do -> HIGHEST. VMEM at K = V = 128, BT = 64, MB = 16: 17 MiB (h, dht, dh0 and the scratch
are 64 KiB per head each).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_dh import Out
from kda.stages.state import chunk_decay


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1   # MB: value heads per program (a divisor of HV)


def vmem_need(MB, K, V, BT, dtypes) -> int:
  """dtypes: (qg, kg, w, v_new, do, dv) dtypes."""
  qg, kg, w, vn, do, dv = dtypes
  b = T.block_bytes
  ins = (b((MB, BT, K), qg) + b((MB, BT, K), kg) + b((MB, BT, K), w) + b((MB, BT, V), vn)
         + b((MB, BT, V), do) + b((MB, BT, V), dv) + 2 * b((MB, K, V), T.F32) + b((MB, K), T.F32))
  outs = b((MB, BT, V), T.F32) + 3 * b((MB, BT, K), T.F32) + b((MB, K), T.F32) + b((MB, K, V), T.F32)
  work = 6 * b((max(BT, K), max(K, V)), T.F32)     # one head's dS_next, products, operand casts
  return 2 * (ins + outs) + b((MB, K, V), T.F32) + work


def default_config(HV, K, V, BT, dtypes=(T.F32,) * 6) -> Config:
  per = vmem_need(1, K, V, BT, dtypes)
  return Config(max(T.heads_per_program(HV, per), 1))


def _dtypes(qg, kg, w, v_new, do, dv):
  return tuple(jnp.dtype(x.dtype) for x in (qg, kg, w, v_new, do, dv))


def supports(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, *, chunk_size, config=None,
             **_) -> Optional[str]:
  if qg.ndim != 4 or qg.shape[0] != 1 or v_new.ndim != 4:
    return f"qg must be [1, Ta, HV, K] and v_new [1, Ta, HV, V], got {qg.shape}, {v_new.shape}"
  _, Ta, HV, K = qg.shape
  V = v_new.shape[-1]
  if (r := T.chunk_reason(Ta, chunk_size)) is not None:
    return r
  NTa = Ta // chunk_size
  for name, x, shape in (("kg", kg, qg.shape), ("w", w, qg.shape), ("gc_int", gc_int, qg.shape),
                         ("gc_frac", gc_frac, qg.shape), ("h", h, (1, NTa, HV, K, V)),
                         ("v_new", v_new, (1, Ta, HV, V)), ("do", do, v_new.shape), ("dv", dv, v_new.shape)):
    if x.shape != shape:
      return f"{name} must have shape {shape}, got {x.shape}"
  if (r := T.aligned_cu_reason(aligned_cu)) is not None:
    return r
  if dht.shape != (aligned_cu.shape[0] - 1, HV, K, V):
    return f"dht must be [N, HV, K, V] = {(aligned_cu.shape[0] - 1, HV, K, V)}, got {dht.shape}"
  named = (("qg", qg), ("kg", kg), ("w", w), ("gc_int", gc_int), ("gc_frac", gc_frac), ("h", h),
           ("v_new", v_new), ("do", do), ("dv", dv), ("dht", dht))
  if (r := T.dtype_reason(named)) is not None:
    return r
  dts = _dtypes(qg, kg, w, v_new, do, dv)
  cfg = config or default_config(HV, K, V, chunk_size, dts)
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  need = vmem_need(cfg.heads_per_program, K, V, chunk_size, dts)
  return T.budget_reason("bwd_dh", need)


def dh_step(S, dSn, qg, kg, w, v_new, do, dv, dec, *, scale, low):
  """One chunk of one head: the vjp terms and the state cotangent entering the chunk.
  S, dSn [K, V] f32; qg, kg, w [BT, K]; v_new, do, dv [BT, V]; dec [K, 1] = exp(gc_last).
  Returns (du, dqg, dkg, dw, dgc_last [K, 1], dS [K, V])."""
  S = S.astype(T.F32)
  du = dv.astype(T.F32) + T.mm(kg, dSn, T.NN, low)
  dqg = scale * T.mm(do, S, T.NT, low)
  dkg = T.mm(v_new, dSn, T.NT, low)
  dw = -T.mm(du, S, T.NT, low)
  dgl = dec * jnp.sum(S * dSn, axis=1, keepdims=True)
  dS = dec * dSn + scale * T.mm(qg, do, T.TN, low) - T.mm(w, du, T.TN, low)
  return du, dqg, dkg, dw, dgl, dS


def walk_flags(flag_ref, NT):
  """(first, last, owned) of the chunk this grid step visits: chunk NT - 1 - c (the reverse walk)."""
  f = flag_ref[NT - 1 - pl.program_id(1)]
  return (f & T.FIRST) != 0, (f & T.LAST) != 0, (f & T.TAIL) == 0


def carried(dS_r, m, seed, last, owned):
  """Head m's dS_next: `seed` (dht[n], or zeros) at a sequence's last chunk, 0 on the tail, else the
  carry. Selects: whatever the scratch holds (a previous sequence's NaN, or nothing yet) is dropped."""
  return jnp.where(last, seed, jnp.where(owned, dS_r[m], 0.0))


def carry(dS_r, dh0_r, m, dS, first):
  """Keep head m's dS for the previous chunk; store it as dh0 at the sequence's first chunk."""
  dS_r[m] = dS
  if dh0_r is not None:
    @pl.when(first)
    def _():
      dh0_r[m] = dS


def walk_specs(MB, BT, NTa):
  """BlockSpec builders of the reverse walk, grid (HV / MB, NTa) with (seq, flags) prefetched:
  token blocks (MB, BT, D), per-chunk rows (MB, D), h (MB, K, V) of [1, NTa, HV, K, V], and the
  per-sequence state blocks (MB, K, V) of [N, HV, K, V] at seq[chunk]."""
  rev = lambda c, *_: NTa - 1 - c
  tok = lambda D: T.token_block(MB, BT, D, rev)
  row = lambda D: T.group_block(MB, D, rev)
  hblk = lambda K, V: pl.BlockSpec((None, None, MB, K, V), lambda hb, c, s, f: (0, rev(c), hb, 0, 0))
  state = lambda K, V: pl.BlockSpec((None, MB, K, V), lambda hb, c, s, f: (s[rev(c)], hb, 0, 0))
  return tok, row, hblk, state


def _kernel(seq_ref, flag_ref, *refs, MB, NT, scale, low, has_dht, has_dh0):
  del seq_ref   # used by the index maps only
  refs = list(refs)
  qg_r, kg_r, w_r, h_r, vn_r, do_r, dv_r, dec_r = refs[:8]
  dht_r = refs[8] if has_dht else None
  outs = refs[8 + has_dht:]
  dh0_r = outs[0] if has_dh0 else None
  du_r, dqg_r, dkg_r, dw_r, dgl_r, dS_r = outs[has_dh0:]
  first, last, owned = walk_flags(flag_ref, NT)

  def head(m):
    seed = dht_r[m] if has_dht else jnp.zeros(dS_r.shape[1:], T.F32)
    dSn = carried(dS_r, m, seed, last, owned)
    du, dqg, dkg, dw, dgl, dS = dh_step(h_r[m], dSn, qg_r[m], kg_r[m], w_r[m], vn_r[m], do_r[m], dv_r[m],
                                        T.to_col(T.head_row(dec_r, m)), scale=scale, low=low)
    du_r[m], dqg_r[m], dkg_r[m], dw_r[m] = du, dqg, dkg, dw
    dgl_r[pl.ds(m, 1), :] = T.to_row(dgl)
    carry(dS_r, dh0_r, m, dS, first)
  T.head_loop(MB, head)


def apply(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, *, scale, chunk_size,
          dht_zero=False, need_dh0=True, interpret=False, config=None) -> Out:
  """dht_zero: dht is known to be zero (not read); need_dh0=False: dh0 is not stored (zeros)."""
  T.refuse("bwd_dh", supports(qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu, chunk_size=chunk_size,
                              config=config))
  BT = chunk_size
  _, Ta, HV, K = qg.shape
  V = v_new.shape[-1]
  NTa, N = Ta // BT, aligned_cu.shape[0] - 1
  dts = _dtypes(qg, kg, w, v_new, do, dv)
  cfg = config or default_config(HV, K, V, BT, dts)
  MB = cfg.heads_per_program
  low = jnp.dtype(do.dtype) == jnp.dtype(T.BF16)
  has_dht, has_dh0 = not dht_zero and N > 0, need_dh0 and N > 0
  seq, flags = T.chunk_flags(aligned_cu, NTa, BT)
  dec = T.rows_in(chunk_decay(gc_int, gc_frac, BT)[None], MB)       # [HV / MB, NTa, MB, K]
  tok, rows, hspec, sspec = walk_specs(MB, BT, NTa)
  row, hblk, state = rows(K), hspec(K, V), sspec(K, V)
  in_specs = [tok(K), tok(K), tok(K), hblk, tok(V), tok(V), tok(V), row] + [state] * has_dht
  args = [T.head_first(x) for x in (qg, kg, w)] + [h] + [T.head_first(x) for x in (v_new, do, dv)] + [dec]
  args += [dht.astype(T.F32)] * has_dht
  out_shape = ([jax.ShapeDtypeStruct((N, HV, K, V), T.F32)] * has_dh0
               + [jax.ShapeDtypeStruct((HV, Ta, V), T.F32)] + [jax.ShapeDtypeStruct((HV, Ta, K), T.F32)] * 3
               + [jax.ShapeDtypeStruct((HV // MB, NTa, MB, K), T.F32)])
  out_specs = [state] * has_dh0 + [tok(V), tok(K), tok(K), tok(K), row]
  nbytes = sum(x.size * x.dtype.itemsize for x in args) + sum(4 * o.size for o in out_shape)
  outs = pl.pallas_call(
      functools.partial(_kernel, MB=MB, NT=NTa, scale=scale, low=low, has_dht=has_dht, has_dh0=has_dh0),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(HV // MB, NTa), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((MB, K, V), T.F32)]),
      out_shape=out_shape,
      compiler_params=T.compiler_params(("parallel", "arbitrary"), vmem_need(MB, K, V, BT, dts)),
      cost_estimate=pl.CostEstimate(flops=2 * HV * Ta * K * V * 6, transcendentals=0, bytes_accessed=nbytes),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_dh",
  )(seq, flags, *args)
  dh0 = outs[0] if has_dh0 else jnp.zeros((N, HV, K, V), T.F32)
  du, dqg, dkg, dw, dgl = outs[has_dh0:]
  if has_dh0:   # empty sequences own no chunk: their initial state is their final state
    lens = jnp.diff(jnp.asarray(aligned_cu, jnp.int32))
    dh0 = jnp.where((lens == 0)[:, None, None, None], dht.astype(T.F32), dh0)
  elif need_dh0:
    dh0 = dht.astype(T.F32)
  return Out(dh0, T.token_major(du), T.token_major(dqg), T.token_major(dkg), T.token_major(dw),
             T.rows_out(dgl))
