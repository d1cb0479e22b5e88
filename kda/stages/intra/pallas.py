"""intra: the Pallas kernel, Triton lowering (any CUDA GPU); the math is in kda.stages.intra.

Kernel: grid (NTa, HV), one program per (chunk, head), on [BT, K] / [BT, V] tiles read straight from
the [1, Ta, HV, D] layout, in 16-token sub-blocks I, J (BT / 16 of them):
- off-diagonal pairs I > J: with r = gc at the first row of I, Akk[I, J] = beta_I * (k_I exp(gc_I - r))
  @ (k_J exp(r - gc_J))^T; both exponents are <= 0 (gates are non-positive), so no factor overflows
  and the product is the exact decay. Same for Aqk with q_I.
- diagonal blocks: a reference point inside the block bounds the factors only by the block's gate
  range, so the kernel checks that range: with r = gc at the block's middle row, if both half-block
  ranges are <= DIAG_RANGE (80; always so with safe_gate: 8 * 5 = 40) it takes one dot of
  k exp(gc - r) and k exp(r - gc), every factor within exp(+-80); otherwise (and always with
  Config(diag="pairwise")) the pairwise masked exp, one column j per step: 16 steps of [16, K] work,
  16 * 16 * K exps per block (128K per 64-token chunk at K = 128, against ~56K for the rest).
  Either way every decay is exact for any non-positive gates: no factor overflows, and one
  underflows only where the decay itself is below exp(-87).
- (I + Akk)^-1: the 16x16 diagonal blocks by forward substitution (16 steps, all blocks at once), the
  blocks below by block forward substitution with 16x16 dots; then w, u by 16-row block dots.
- gc in two parts: every exponent above is formed as gate.exponent of both. While every gate of the
  call is above -1 (gc_int == 0 everywhere, the usual case), an XLA conditional launches the same
  kernel on gc_frac alone, which computes the same bits with fewer registers (the two-part exponents
  make the kernel 1.5x slower).
Stores (the dtype policy): with bf16 q and k (and Config.bf16_dots) every output, Akk, Aqk, Ainv,
w, u, qg, kg, is stored bf16, rounded once from the float32 values; with float32 inputs, float32.
K or V that are not powers of two are zero-padded in the launcher and cut off afterwards.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kda import _pallas
from kda._vma import out_struct
from kda.stages.gate import exponent
from kda.stages.intra import NAME, Out

SUB = 16           # sub-block rows: the smallest Triton dot tile
DIAG_RANGE = 80.0  # exp(+-80) stays normal float32 (overflow at 88.7, denormals below -87.3)


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch parameters and dot precisions of the intra kernel (tiles are whole chunks by K or V)."""
  precision: str = "highest"   # float32 dots: the solve always, A / w / u with float32 inputs
  bf16_dots: bool = True       # bf16 inputs: A, w, u dots take bf16 operands (float32 accumulation)
  diag: str = "auto"           # diagonal sub-blocks: "auto" or "pairwise" (module docstring)
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _pallas.check_config(self)
    if self.diag not in ("auto", "pairwise"):
      raise ValueError(f"diag must be 'auto' or 'pairwise', got {self.diag!r}")


def _kernel(q_ref, k_ref, v_ref, b_ref, gi_ref, gf_ref, akk_ref, aqk_ref, ainv_ref, w_ref, u_ref, qg_ref,
            kg_ref, *, scale, mm_dtype, precision, diag, two_part):
  # refs (one chunk of one head): q, k, gc_int, gc_frac, w, qg, kg [BT, K]; v, u [BT, V]; beta [BT, 1];
  # Akk, Aqk, Ainv [BT, BT]. Dots: the solve is float32 at `precision`; A, w and u dots take
  # mm_dtype operands (bf16 for bf16 inputs: tensor cores, float32 accumulation), else `precision`.
  # Everything is computed in float32 and rounded once, on the store, to the outputs' dtype.
  BT = k_ref.shape[0]
  NS = BT // SUB
  f32 = jnp.float32
  mm_prec = precision if mm_dtype == f32 else None
  blk = lambda I: pl.ds(I * SUB, SUB)
  dot = lambda a, b, prec: jnp.dot(a, b, precision=prec, preferred_element_type=f32)
  dot_nt = lambda a, b: lax.dot_general(a.astype(mm_dtype), b.astype(mm_dtype), _pallas.NT_DIMS,
                                        precision=mm_prec, preferred_element_type=f32)
  row = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  col = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  row1 = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
  col1 = lax.broadcasted_iota(jnp.int32, (1, SUB), 1)
  zeros = jnp.zeros((SUB, SUB), f32)
  load = lambda ref, I: ref[blk(I), :].astype(f32)
  def put(ref, idx, x):      # every output in its stored dtype (bf16 for bf16 inputs)
    ref[idx] = x.astype(ref.dtype)
  row_at = lambda t: pl.ds(t, 1)
  if two_part:
    gc = lambda rows: (gi_ref[rows, :], gf_ref[rows, :])   # the two parts of gc at `rows`
    diff = lambda a, b: exponent(*a, *b)                   # gc_a - gc_b
    whole = lambda a: exponent(*a)
  else:   # gc_int is 0 everywhere (the launcher checked): gc is gc_frac, the same decays bit for bit
    gc = lambda rows: gf_ref[rows, :]
    diff = lambda a, b: a - b
    whole = lambda a: a

  akk = {}
  for I in range(NS):
    m_beta = load(b_ref, I)                               # [SUB, 1]
    m_k, m_q, m_g = load(k_ref, I), load(q_ref, I), gc(blk(I))
    r = gc(row_at(I * SUB))                               # [1, K] reference: I's first row
    e_i = jnp.exp(diff(m_g, r))                           # rows at or after r: <= 1
    m_kl, m_ql = m_k * e_i, m_q * e_i
    for J in range(I):
      m_kr = load(k_ref, J) * jnp.exp(diff(r, gc(blk(J))))   # columns before r: <= 1
      akk[I, J] = m_beta * dot_nt(m_kl, m_kr)
      put(aqk_ref, (blk(I), blk(J)), scale * dot_nt(m_ql, m_kr))

    def pairwise(I=I, m_k=m_k, m_q=m_q, m_g=m_g):
      def column(s, carry):
        # column j = I*SUB + s, exp of the masked difference: exact for any gates
        a_kk, a_qk = carry
        j = I * SUB + s
        m = row1 >= s
        kd = jnp.where(m, jnp.exp(jnp.where(m, diff(m_g, gc(row_at(j))), 0.0)), 0.0)
        kd = kd * k_ref[pl.ds(j, 1), :].astype(f32)
        a_kk = jnp.where(col == s, jnp.sum(m_k * kd, axis=1, keepdims=True), a_kk)
        a_qk = jnp.where(col == s, jnp.sum(m_q * kd, axis=1, keepdims=True), a_qk)
        return a_kk, a_qk
      return lax.fori_loop(0, SUB, column, (zeros, zeros))

    mid = gc(row_at(I * SUB + SUB // 2))                 # [1, K]

    def factored(m_k=m_k, m_q=m_q, m_g=m_g, mid=mid):
      # reference at the middle row: factors lie in [exp(-DIAG_RANGE), exp(DIAG_RANGE)] (checked);
      # the pairs above the diagonal may overflow, they are masked out below
      e_i = jnp.exp(diff(m_g, mid))
      m_kr = m_k * jnp.exp(diff(mid, m_g))
      return dot_nt(m_k * e_i, m_kr), dot_nt(m_q * e_i, m_kr)

    if diag == "pairwise":
      a_kk, a_qk = pairwise()
    else:
      half_range = jnp.maximum(diff(r, mid), diff(mid, gc(row_at(I * SUB + SUB - 1))))
      a_kk, a_qk = lax.cond(jnp.max(jnp.max(half_range, axis=1), axis=0) <= DIAG_RANGE,
                            factored, pairwise)
    akk[I, I] = jnp.where(row > col, a_kk, 0.0) * m_beta
    put(aqk_ref, (blk(I), blk(I)), jnp.where(row >= col, a_qk, 0.0) * scale)
    for J in range(I + 1):
      put(akk_ref, (blk(I), blk(J)), akk[I, J])
    for J in range(I + 1, NS):
      for ref in (akk_ref, aqk_ref, ainv_ref):
        put(ref, (blk(I), blk(J)), zeros)

  def subst(i, xs):
    # row i of every (I + Akk[I, I])^-1 at once; rows >= i of x are still 0
    out = []
    for I, x in enumerate(xs):
      a_i = jnp.sum(jnp.where(row == i, akk[I, I], 0.0), axis=0, keepdims=True)   # [1, SUB]
      x_i = jnp.where(col1 == i, 1.0, 0.0) - jnp.sum(jnp.transpose(a_i) * x, axis=0, keepdims=True)
      out.append(jnp.where(row == i, x_i, x))
    return tuple(out)

  diag_inv = lax.fori_loop(0, SUB, subst, (zeros,) * NS)
  ainv = {}
  for I in range(NS):                                     # block forward substitution
    ainv[I, I] = diag_inv[I]
    for J in range(I):
      acc = dot(akk[I, J], ainv[J, J], precision)
      for P in range(J + 1, I):
        acc = acc + dot(akk[I, P], ainv[P, J], precision)
      ainv[I, J] = -dot(diag_inv[I], acc, precision)
    for J in range(I + 1):
      put(ainv_ref, (blk(I), blk(J)), ainv[I, J])

  for I in range(NS):
    # the right-hand sides are rebuilt per block row: a few exps more, far fewer live registers
    m_w = m_u = None
    for J in range(I + 1):
      m_beta = load(b_ref, J)
      m_x = ainv[I, J].astype(mm_dtype)
      m_w_j = dot(m_x, (m_beta * load(k_ref, J) * jnp.exp(whole(gc(blk(J))))).astype(mm_dtype),
                  mm_prec)
      m_u_j = dot(m_x, (m_beta * load(v_ref, J)).astype(mm_dtype), mm_prec)
      m_w = m_w_j if m_w is None else m_w + m_w_j
      m_u = m_u_j if m_u is None else m_u + m_u_j
    put(w_ref, (blk(I), slice(None)), m_w)
    put(u_ref, (blk(I), slice(None)), m_u)

  b_g = gc(pl.ds(0, BT))
  put(qg_ref, ..., q_ref[...].astype(f32) * jnp.exp(whole(b_g)))
  put(kg_ref, ..., k_ref[...].astype(f32) * jnp.exp(diff(gc(row_at(BT - 1)), b_g)))


def launch(q, k, v, beta, gi, gf, *, two_part, scale, chunk_size, interpret=False, config=None):
  """One kernel on q, k, gi, gf [1, Ta, HV, Kp], v [1, Ta, HV, Vp], beta [1, Ta, HV, 1] (K, V
  already padded to powers of two): both parts of gc (two_part), or gc_frac alone (gc_int == 0
  everywhere) -> (Akk, Aqk, Ainv, w, u, qg, kg), w, u, qg, kg still padded."""
  config = config or Config()
  BT = chunk_size
  _, Ta, HV, Kp = k.shape
  Vp = v.shape[-1]
  bf16 = q.dtype == jnp.bfloat16 and k.dtype == jnp.bfloat16 and config.bf16_dots
  kernel = functools.partial(_kernel, scale=float(scale), mm_dtype=jnp.bfloat16 if bf16 else jnp.float32,
                             precision=_pallas.dot_precision(config.precision, interpret),
                             diag=config.diag, two_part=two_part)
  tile = lambda d: pl.BlockSpec((None, BT, None, d), lambda c, h: (0, c, h, 0))
  # the dtype policy: bf16 inputs -> bf16 intermediates, float32 ones stay float32
  out_dtype = jnp.bfloat16 if bf16 else jnp.float32
  shape = lambda d: out_struct((1, Ta, HV, d), out_dtype, q, k, v, beta, gi, gf)
  return pl.pallas_call(
      kernel, grid=(Ta // BT, HV),
      in_specs=[tile(Kp), tile(Kp), tile(Vp), tile(1), tile(Kp), tile(Kp)],
      out_specs=[tile(BT)] * 3 + [tile(Kp), tile(Vp), tile(Kp), tile(Kp)],
      out_shape=[shape(BT)] * 3 + [shape(Kp), shape(Vp), shape(Kp), shape(Kp)],
      compiler_params=None if interpret else _pallas.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret, name=f"kda_{NAME}{'' if two_part else '_frac'}")(q, k, v, beta, gi, gf)


def supports(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, config=None):
  """None if the kernel takes the call, else why not. Triton stages a chunk's dot operands in
  shared memory: q, k and the two gate parts as [BT, Kp] tiles, float32 unless the dots take bf16
  operands. At Kp = 256 in float32 they exceed the 227 KiB a block may have on an H200 (Triton
  asked for 245760 bytes at K = V = 256, float16 inputs); bf16 tiles take half."""
  config = config or Config()
  Kp = max(_pallas.next_pow2(k.shape[-1]), 16)
  bf16 = q.dtype == jnp.bfloat16 and k.dtype == jnp.bfloat16 and config.bf16_dots
  if not bf16 and Kp > 128:
    return (f"pallas intra: [{chunk_size}, {Kp}] float32 dot tiles (q, k dtype {q.dtype}, {k.dtype}) need "
            "more shared memory than a block may have; K <= 128 or bf16 q and k")
  return None


def apply(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, interpret=False,
          config=None):
  del aligned_cu   # every chunk is computed
  config = config or Config()
  BT = chunk_size
  if BT < SUB or BT & (BT - 1):
    raise ValueError(f"chunk_size must be a power of two >= {SUB}, got {BT}")
  K, V = k.shape[-1], v.shape[-1]
  f32 = jnp.float32
  Kp, Vp = max(_pallas.next_pow2(K), 16), max(_pallas.next_pow2(V), 16)
  q, k, gi, gf = (_pallas.pad_dim(x, 3, Kp) for x in (q, k, gc_int.astype(f32), gc_frac.astype(f32)))
  v = _pallas.pad_dim(v, 3, Vp)
  call = lambda two_part: lambda *args: launch(*args, two_part=two_part, scale=scale, chunk_size=BT,
                                               interpret=interpret, config=config)
  # while every gate is above -1 (gc_int == 0, the usual case) the kernel on gc_frac alone computes
  # the same bits with fewer registers
  args = (q, k, v, beta[..., None], gi, gf)
  outs = lax.cond(jnp.any(gi != 0), call(True), call(False), *args)
  Akk, Aqk, Ainv, w, u, qg, kg = outs
  if Kp != K:
    w, qg, kg = w[..., :K], qg[..., :K], kg[..., :K]
  if Vp != V:
    u = u[..., :V]
  return Out(Akk, Aqk, Ainv, w, u, qg, kg)
