"""bwd_wy (S3): the Mosaic TPU kernel; the math is in kda.stages.bwd_wy.

Every chunk is independent. Grid (HV / MB, NTa), both "parallel"; a program takes MB heads of one
chunk as head-first blocks and loops over its heads. Per head, with eg = exp(gc),
el = exp(gc_last - gc) (exponents from gc's two parts, gate.exponent; gc_last read as the block's
last row):

    dkb = Ainv^T @ dw,  dvb = Ainv^T @ du                         MXU, transposed-LHS dots
    dAkk = strict_tril(-Ainv^T @ (dw @ kb^T + du @ vb^T) @ Ainv^T)  four dots
    dq = dqg * eg,  dk = dkg * el + dkb * beta * eg,  dv = dvb * beta
    dbeta = sum_K(dkb * k * eg) + sum_V(dvb * v)                  lane reductions -> (BT, 1)
    dgc = dqg * qg + dkb * kb
    dg_state = strict_tril(1) @ (dkg * kg) + dgc_last             exclusive cumsum: a 0/1 dot, HIGHEST

Blocks: q, k, gc_int, gc_frac, dqg, dkg, dw and dq, dk, dgc, dg_state (MB, BT, K); v, du, dv
(MB, BT, V); Ainv, dAkk (MB, BT, BT); beta, dbeta (MB, BT) and dgc_last (MB, K) as head groups
(kda._mosaic_tpu_bwd.rows_in; beta turned into a column in VMEM). Chunks past aligned_cu[-1]
hold zeros (gc flat 0 there), so their outputs are zeros except dg_state = dgc_last = 0 there too.
Precision: bf16 q -> bf16 MXU operands (Ainv, dw, du, kb, vb, dAinv rounded), float32 accumulation;
float32 q -> HIGHEST. The cumsum dot is HIGHEST in both. VMEM at K = V = 128, BT = 64, MB = 16:
14.5 MiB (bf16) / 16.5 MiB.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_wy import Out
from kda.stages.gate import exponent


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1   # MB: value heads per program (a divisor of HV)


def vmem_need(MB, K, V, BT, in_dtype, dv_dtype) -> int:
  b = T.block_bytes
  ins = (2 * b((MB, BT, K), in_dtype) + b((MB, BT, V), in_dtype) + b((MB, BT), T.F32)
         + 2 * b((MB, BT, K), T.F32) + b((MB, BT, BT), T.F32) + 3 * b((MB, BT, K), T.F32)
         + b((MB, BT, V), T.F32) + b((MB, K), T.F32))
  outs = (4 * b((MB, BT, K), T.F32) + b((MB, BT, V), dv_dtype) + b((MB, BT), T.F32)
          + b((MB, BT, BT), T.F32))
  work = 16 * b((BT, max(K, V, BT)), T.F32)     # one head's ~16 live [BT, D] values
  return 2 * (ins + outs) + work


def default_config(HV, K, V, BT, in_dtype=T.F32, dv_dtype=T.F32) -> Config:
  per = vmem_need(1, K, V, BT, in_dtype, dv_dtype)
  return Config(max(T.heads_per_program(HV, per), 1))


def supports(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *,
             chunk_size, dv_dtype=None, config=None, **_) -> Optional[str]:
  if q.ndim != 4 or q.shape[0] != 1 or v.ndim != 4:
    return f"q must be [1, Ta, HV, K] and v [1, Ta, HV, V], got {q.shape}, {v.shape}"
  _, Ta, HV, K = q.shape
  V = v.shape[-1]
  if (r := T.chunk_reason(Ta, chunk_size)) is not None:
    return r
  for name, x, shape in (("k", k, q.shape), ("gc_int", gc_int, q.shape), ("gc_frac", gc_frac, q.shape),
                         ("beta", beta, (1, Ta, HV)), ("Ainv", Ainv, (1, Ta, HV, chunk_size)),
                         ("dqg", dqg, q.shape), ("dkg", dkg, q.shape), ("dw", dw, q.shape),
                         ("du", du, v.shape), ("dgc_last", dgc_last, (1, Ta // chunk_size, HV, K))):
    if x.shape != shape:
      return f"{name} must have shape {shape}, got {x.shape}"
  named = (("q", q), ("k", k), ("v", v), ("beta", beta), ("gc_int", gc_int), ("gc_frac", gc_frac),
           ("Ainv", Ainv), ("dqg", dqg), ("dkg", dkg), ("dw", dw), ("du", du), ("dgc_last", dgc_last))
  if (r := T.dtype_reason(named)) is not None:
    return r
  if dv_dtype is not None and (r := T.dtype_reason((("dv_dtype", jnp.zeros((), dv_dtype)),))) is not None:
    return r
  cfg = config or default_config(HV, K, V, chunk_size, q.dtype, dv_dtype or T.F32)
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  need = vmem_need(cfg.heads_per_program, K, V, chunk_size, q.dtype, dv_dtype or T.F32)
  return T.budget_reason("bwd_wy", need)


def wy_step(q, k, v, b, gi, gf, gi_last, gf_last, Ainv, dqg, dkg, dw, du, dgl, *, low):
  """One chunk of one head (module docstring): q, k, gi, gf, dqg, dkg, dw [BT, K]; v, du [BT, V];
  b [BT, 1]; gi_last, gf_last, dgl [1, K]; Ainv [BT, BT].
  Returns (dq, dk, dv, dbeta [BT, 1], dgc, dg_state, dAkk), float32."""
  BT = q.shape[0]
  q, k, v = (x.astype(T.F32) for x in (q, k, v))
  eg = jnp.exp(exponent(gi, gf))
  el = jnp.exp(exponent(gi_last, gf_last, gi, gf))
  ke = k * eg
  kb, vb = b * ke, b * v
  dkb = T.mm(Ainv, dw, T.TN, low)
  dvb = T.mm(Ainv, du, T.TN, low)
  dAinv = T.mm(dw, kb, T.NT, low) + T.mm(du, vb, T.NT, low)
  M = T.mm(Ainv, T.mm(dAinv, Ainv, T.NT, low), T.TN, low)
  dAkk = jnp.where(T.tri(BT, lambda r, c: r > c) > 0, -M, 0.0)
  dq = dqg * eg
  dk = dkg * el + dkb * b * eg
  dv = dvb * b
  dbeta = jnp.sum(dkb * ke, axis=1, keepdims=True) + jnp.sum(dvb * v, axis=1, keepdims=True)
  dgc = dqg * (q * eg) + dkb * kb
  dg_state = T.exact(T.tri(BT, lambda r, c: r > c), dkg * (k * el), T.NN) + dgl
  return dq, dk, dv, dbeta, dgc, dg_state, dAkk


def _kernel(q_r, k_r, v_r, b_r, gi_r, gf_r, A_r, dqg_r, dkg_r, dw_r, du_r, dgl_r,
            dq_o, dk_o, dv_o, db_o, dgc_o, dgs_o, dAkk_o, *, MB, BT, low):
  last = pl.ds(BT - 1, 1)

  def head(m):
    dq, dk, dv, dbeta, dgc, dgs, dAkk = wy_step(
        q_r[m], k_r[m], v_r[m], T.to_col(T.head_row(b_r, m)), gi_r[m], gf_r[m], gi_r[m, last, :],
        gf_r[m, last, :], A_r[m], dqg_r[m], dkg_r[m], dw_r[m], du_r[m], T.head_row(dgl_r, m), low=low)
    dq_o[m], dk_o[m], dgc_o[m], dgs_o[m], dAkk_o[m] = dq, dk, dgc, dgs, dAkk
    db_o[pl.ds(m, 1), :] = T.to_row(dbeta)
    dv_o[m] = dv.astype(dv_o.dtype)
  T.head_loop(MB, head)


def apply(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, aligned_cu=None, *, chunk_size,
          dv_dtype=None, interpret=False, config=None) -> Out:
  """aligned_cu is not used: the tail's chunks hold zeros and are computed like the others."""
  T.refuse("bwd_wy", supports(q, k, v, beta, gc_int, gc_frac, Ainv, dqg, dkg, dw, du, dgc_last, chunk_size=chunk_size,
                              dv_dtype=dv_dtype, config=config))
  del aligned_cu
  BT = chunk_size
  _, Ta, HV, K = q.shape
  V = v.shape[-1]
  NTa = Ta // BT
  dv_dtype = jnp.dtype(dv_dtype or T.F32)
  cfg = config or default_config(HV, K, V, BT, q.dtype, dv_dtype)
  MB = cfg.heads_per_program
  low = jnp.dtype(q.dtype) == jnp.dtype(T.BF16)
  tok = lambda D: T.token_block(MB, BT, D)
  hf = T.head_first
  args = ([hf(x) for x in (q, k, v)] + [T.scalars_in(beta.astype(T.F32), MB, BT)]
          + [hf(x) for x in (gc_int, gc_frac, Ainv, dqg, dkg, dw, du)] + [T.rows_in(dgc_last.astype(T.F32), MB)])
  in_specs = ([tok(K), tok(K), tok(V), T.group_block(MB, BT), tok(K), tok(K), tok(BT), tok(K), tok(K), tok(K),
               tok(V), T.group_block(MB, K)])
  S = jax.ShapeDtypeStruct
  out_shape = [S((HV, Ta, K), T.F32), S((HV, Ta, K), T.F32), S((HV, Ta, V), dv_dtype),
               S((HV // MB, NTa, MB, BT), T.F32), S((HV, Ta, K), T.F32), S((HV, Ta, K), T.F32),
               S((HV, Ta, BT), T.F32)]
  out_specs = [tok(K), tok(K), tok(V), T.group_block(MB, BT), tok(K), tok(K), tok(BT)]
  flops = 2 * HV * Ta * BT * (2 * K + 2 * V + K + V + 2 * BT) + 2 * HV * Ta * BT * K
  nbytes = (sum(x.size * x.dtype.itemsize for x in args)
            + sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_shape))
  dq, dk, dv, dbeta, dgc, dgs, dAkk = pl.pallas_call(
      functools.partial(_kernel, MB=MB, BT=BT, low=low),
      grid=(HV // MB, NTa), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=T.compiler_params(("parallel", "parallel"), vmem_need(MB, K, V, BT, q.dtype, dv_dtype)),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=2 * HV * Ta * K, bytes_accessed=nbytes),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_wy",
  )(*args)
  tm = T.token_major
  return Out(tm(dq), tm(dk), tm(dv), T.scalars_out(dbeta), tm(dgc), tm(dgs), tm(dAkk))
