"""bwd_intra (S4): the Mosaic TPU kernel; the math is in kda.stages.bwd_intra.

Every chunk is independent. Grid (HV / MB, NTa), both "parallel"; a program takes MB heads of one
chunk as head-first blocks and loops over its heads. The four pair sums of a head,

    dqA'_i = sum_{j<i} sA[i, j] k_j E_ij      G_i    = sum_{j<i} dAkk[i, j] k_j E_ij
    dkA'_j = sum_{i>j} sA[i, j] q_i E_ij      dkK2_j = sum_{i>j} beta_i dAkk[i, j] k_i E_ij

(sA = scale * dAqk, E_ij = exp(gc_i - gc_j) per channel, <= 1) are split over 16-row sub-blocks:

- pairs in different sub-blocks go through the MXU with E factorised at a reference row inside the
  chunk, both factors <= 1 (gc only falls): for row sub-block a with r = gc at its first row,
  E_ij = exp(gc_i - r) * exp(r - gc_j) for every j before it, so
      dqA'[a] += exp(gc_a - r) * (sA[a, :] @ (k * exp(r - gc) on the rows before a, 0 after))
  and G the same with dAkk; for column sub-block b with r' = gc at its last row,
  E_ij = exp(gc_i - r') * exp(r' - gc_j) for every i after it, so
      dkA'[b] += exp(r' - gc_b) * (sA^T @ (q * exp(gc - r') on the rows after b, 0 before))[b]
  and dkK2 the same with beta * dAkk and k. Exponents are masked before exp (no factor > 1 is
  formed), and each is taken from gc's two parts (gate.exponent): gates of -1e4 (floored at -128
  per token) keep float32 accuracy.
- pairs inside a diagonal 16 x 16 sub-block are exact: for each column j of the sub-block (a
  fori_loop) the [16, K] tile E_(.)j = exp(exponent(gc_i, gc_j)) masked to i > j before exp;
  row-side sums accumulate with the column sA[:, j] (a one-hot lane reduction), column-side sums
  reduce over the sub-block's rows.

Then dq += dqA' + diag(sA) k, dk += dkA' + diag(sA) q + beta G + dkK2, dbeta += sum_K(k G),
dgc += q dqA' - k dkA' + k beta G - k dkK2 (the diagonal E = 1 has no gate term).

Blocks: q, k, gc_int, gc_frac, dq, dk, dgc in and out (MB, BT, K); dAqk, dAkk (MB, BT, BT); beta,
dbeta in and out (MB, BT) head groups. Precision: bf16 q -> the cross-sub-block dots take bf16
operands with float32 accumulation; float32 q -> HIGHEST. The diagonal sub-blocks and every
elementwise term are float32. VMEM at K = 128, BT = 64, MB = 16: 10.7 MiB (bf16) / 12.7 MiB.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_intra import Out
from kda.stages.gate import exponent

SB = 16   # sub-block rows


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1   # MB: value heads per program (a divisor of HV)


def vmem_need(MB, K, BT, in_dtype, grad_dtype) -> int:
  b = T.block_bytes
  ins = (2 * b((MB, BT, K), in_dtype) + b((MB, BT), T.F32) + 2 * b((MB, BT, K), T.F32)
         + 2 * b((MB, BT, BT), T.F32) + 2 * b((MB, BT, K), T.F32) + b((MB, BT), T.F32) + b((MB, BT, K), T.F32))
  outs = 2 * b((MB, BT, K), grad_dtype) + b((MB, BT), T.F32) + b((MB, BT, K), T.F32)
  work = 20 * b((BT, max(K, BT)), T.F32)       # one head's ~20 live [BT, K] values
  return 2 * (ins + outs) + work


def default_config(HV, K, BT, in_dtype=T.F32, grad_dtype=T.F32) -> Config:
  per = vmem_need(1, K, BT, in_dtype, grad_dtype)
  return Config(max(T.heads_per_program(HV, per), 1))


def supports(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu=None, *, chunk_size,
             grad_dtype=None, config=None, **_) -> Optional[str]:
  if q.ndim != 4 or q.shape[0] != 1:
    return f"q must be [1, Ta, HV, K], got {q.shape}"
  _, Ta, HV, K = q.shape
  if (r := T.chunk_reason(Ta, chunk_size)) is not None:
    return r
  for name, x, shape in (("k", k, q.shape), ("gc_int", gc_int, q.shape), ("gc_frac", gc_frac, q.shape),
                         ("beta", beta, (1, Ta, HV)), ("dAqk", dAqk, (1, Ta, HV, chunk_size)),
                         ("dAkk", dAkk, (1, Ta, HV, chunk_size)), ("dq", dq, q.shape), ("dk", dk, q.shape),
                         ("dbeta", dbeta, (1, Ta, HV)), ("dgc", dgc, q.shape)):
    if x.shape != shape:
      return f"{name} must have shape {shape}, got {x.shape}"
  named = (("q", q), ("k", k), ("beta", beta), ("gc_int", gc_int), ("gc_frac", gc_frac), ("dAqk", dAqk),
           ("dAkk", dAkk), ("dq", dq), ("dk", dk), ("dbeta", dbeta), ("dgc", dgc))
  if (r := T.dtype_reason(named)) is not None:
    return r
  gd = grad_dtype or T.F32
  cfg = config or default_config(HV, K, chunk_size, q.dtype, gd)
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  need = vmem_need(cfg.heads_per_program, K, chunk_size, q.dtype, gd)
  return T.budget_reason("bwd_intra", need)


def _rows(x, a):
  return x[a * SB:(a + 1) * SB]


def pair_sums(q, k, bcol, gi, gf, sA, dAkk, *, low):
  """(dqA', dkA', G, dkK2) [BT, K] float32 of one chunk and head (module docstring): q, k, gi, gf
  [BT, K] float32 values; bcol [BT, 1]; sA = scale * dAqk, dAkk [BT, BT] float32."""
  BT, K = q.shape
  nb = BT // SB
  row = lax.broadcasted_iota(jnp.int32, (BT, 1), 0)
  bA = bcol * dAkk
  off = {name: [jnp.zeros((SB, K), T.F32)] * nb for name in ("dq", "G", "dk", "K2")}
  for a in range(1, nb):                       # row sub-block a, against the rows before it
    ri, rf = gi[a * SB:a * SB + 1], gf[a * SB:a * SB + 1]
    before = row < a * SB
    kt = jnp.where(before, k * jnp.exp(jnp.where(before, exponent(ri, rf, gi, gf), 0.0)), 0.0)
    ea = jnp.exp(exponent(_rows(gi, a), _rows(gf, a), ri, rf))
    off["dq"][a] = ea * T.mm(_rows(sA, a), kt, T.NN, low)
    off["G"][a] = ea * T.mm(_rows(dAkk, a), kt, T.NN, low)
  for b in range(nb - 1):                      # column sub-block b, against the rows after it
    ri, rf = gi[b * SB + SB - 1:b * SB + SB], gf[b * SB + SB - 1:b * SB + SB]
    after = row >= (b + 1) * SB
    e = jnp.where(after, jnp.exp(jnp.where(after, exponent(gi, gf, ri, rf), 0.0)), 0.0)
    eb = jnp.exp(exponent(ri, rf, _rows(gi, b), _rows(gf, b)))
    off["dk"][b] = eb * _rows(T.mm(sA, q * e, T.TN, low), b)
    off["K2"][b] = eb * _rows(T.mm(bA, k * e, T.TN, low), b)
  diag = [_diagonal(_rows(q, a), _rows(k, a), _rows(bcol, a), _rows(gi, a), _rows(gf, a), _rows(sA, a),
                    _rows(dAkk, a), a) for a in range(nb)]
  cat = lambda name, i: jnp.concatenate([off[name][a] + diag[a][i] for a in range(nb)], axis=0)
  return cat("dq", 0), cat("dk", 2), cat("G", 1), cat("K2", 3)


def _diagonal(q, k, bcol, gi, gf, sA, dAkk, a):
  """The exact pair sums inside diagonal sub-block a: q, k, gi, gf [SB, K]; bcol [SB, 1]; sA, dAkk
  [SB, BT] (the sub-block's rows, all columns). Returns (dqA', G, dkA', dkK2) [SB, K]."""
  K = q.shape[1]
  BT = sA.shape[1]
  i = lax.broadcasted_iota(jnp.int32, (SB, 1), 0)
  lane = lax.broadcasted_iota(jnp.int32, (1, BT), 1)
  pick_row = lambda x, j: jnp.sum(jnp.where(i == j, x, 0.0), axis=0, keepdims=True)   # [1, K]

  def col(j, carry):
    dq, G, dk, K2 = carry
    gij, gfj, kj = pick_row(gi, j), pick_row(gf, j), pick_row(k, j)
    below = i > j
    E = jnp.where(below, jnp.exp(jnp.where(below, exponent(gi, gf, gij, gfj), 0.0)), 0.0)
    sel = lane == a * SB + j
    a_col = jnp.sum(jnp.where(sel, sA, 0.0), axis=1, keepdims=True)       # sA[:, j] over the rows
    m_col = jnp.sum(jnp.where(sel, dAkk, 0.0), axis=1, keepdims=True)
    dq = dq + a_col * E * kj
    G = G + m_col * E * kj
    at_j = i == j
    dk = jnp.where(at_j, jnp.sum(a_col * q * E, axis=0, keepdims=True), dk)
    K2 = jnp.where(at_j, jnp.sum(bcol * m_col * k * E, axis=0, keepdims=True), K2)
    return dq, G, dk, K2
  z = jnp.zeros((SB, K), T.F32)
  return lax.fori_loop(0, SB, col, (z, z, z, z))


def intra_step(q, k, bcol, gi, gf, dAqk, dAkk, dq, dk, dbcol, dgc, *, scale, low):
  """One chunk of one head: the accumulators (dq, dk, dgc [BT, K], dbcol [BT, 1]) plus this stage's
  terms, float32."""
  q, k = q.astype(T.F32), k.astype(T.F32)
  BT = q.shape[0]
  sA = scale * dAqk
  dqA, dkA, G, K2 = pair_sums(q, k, bcol, gi, gf, sA, dAkk, low=low)
  d = jnp.sum(jnp.where(T.tri(BT, lambda r, c: r == c) > 0, sA, 0.0), axis=1, keepdims=True)
  K1 = bcol * G
  dq = dq + dqA + d * k
  dk = dk + dkA + d * q + K1 + K2
  dbcol = dbcol + jnp.sum(k * G, axis=1, keepdims=True)
  dgc = dgc + q * dqA - k * dkA + k * K1 - k * K2
  return dq, dk, dbcol, dgc


def _kernel(q_r, k_r, b_r, gi_r, gf_r, dAqk_r, dAkk_r, dq_r, dk_r, db_r, dgc_r,
            dq_o, dk_o, db_o, dgc_o, *, MB, scale, low):
  def head(m):
    dq, dk, dbcol, dgc = intra_step(
        q_r[m], k_r[m], T.to_col(T.head_row(b_r, m)), gi_r[m], gf_r[m], dAqk_r[m], dAkk_r[m],
        dq_r[m].astype(T.F32), dk_r[m].astype(T.F32), T.to_col(T.head_row(db_r, m)), dgc_r[m], scale=scale,
        low=low)
    dq_o[m], dk_o[m] = dq.astype(dq_o.dtype), dk.astype(dk_o.dtype)
    dgc_o[m] = dgc
    db_o[pl.ds(m, 1), :] = T.to_row(dbcol)
  T.head_loop(MB, head)


def apply(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu=None, *, scale, chunk_size,
          grad_dtype=None, interpret=False, config=None) -> Out:
  """aligned_cu is not used: the tail's chunks hold no token and are computed like the others."""
  T.refuse("bwd_intra", supports(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, chunk_size=chunk_size,
                                 grad_dtype=grad_dtype, config=config))
  del aligned_cu
  BT = chunk_size
  _, Ta, HV, K = q.shape
  NTa = Ta // BT
  gd = jnp.dtype(grad_dtype or T.F32)
  cfg = config or default_config(HV, K, BT, q.dtype, gd)
  MB = cfg.heads_per_program
  low = jnp.dtype(q.dtype) == jnp.dtype(T.BF16)
  tok = lambda D: T.token_block(MB, BT, D)
  sc = T.group_block(MB, BT)
  hf = T.head_first
  f32 = lambda x: x.astype(T.F32)
  args = ([hf(q), hf(k), T.scalars_in(f32(beta), MB, BT)] + [hf(f32(x)) for x in (gc_int, gc_frac, dAqk, dAkk)]
          + [hf(dq), hf(dk), T.scalars_in(f32(dbeta), MB, BT), hf(f32(dgc))])
  in_specs = [tok(K), tok(K), sc, tok(K), tok(K), tok(BT), tok(BT), tok(K), tok(K), sc, tok(K)]
  S = jax.ShapeDtypeStruct
  out_shape = [S((HV, Ta, K), gd), S((HV, Ta, K), gd), S((HV // MB, NTa, MB, BT), T.F32), S((HV, Ta, K), T.F32)]
  nb = BT // SB
  flops = 2 * HV * Ta * K * (2 * SB * (nb - 1) + 2 * BT * (nb - 1)) + 12 * HV * Ta * SB * K
  nbytes = (sum(x.size * x.dtype.itemsize for x in args)
            + sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_shape))
  dq, dk, db, dgc = pl.pallas_call(
      functools.partial(_kernel, MB=MB, scale=scale, low=low),
      grid=(HV // MB, NTa), in_specs=in_specs, out_specs=[tok(K), tok(K), sc, tok(K)], out_shape=out_shape,
      compiler_params=T.compiler_params(("parallel", "parallel"), vmem_need(MB, K, BT, q.dtype, gd)),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=HV * Ta * K * (SB + 2 * nb),
                                    bytes_accessed=nbytes),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_intra",
  )(*args)
  tm = T.token_major
  return Out(tm(dq), tm(dk), T.scalars_out(db), tm(dgc))
