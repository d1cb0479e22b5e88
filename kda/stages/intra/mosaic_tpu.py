"""intra: the Pallas Mosaic TPU kernel; the math is in kda.stages.intra.

Kernel: grid (HV / MB, NTa), both "parallel"; program (p, c) takes value heads [p MB, (p+1) MB) of
chunk c, head-first (kda._mosaic_tpu): q, k (MB, BT, Kp) and v (MB, BT, Vp) in the input dtype, beta
(MB, BT, 1) f32, gc_int, gc_frac (MB, BT, Kp) f32 -> Akk, Aqk, Ainv (MB, BT, BT), w, qg, kg (MB, BT, Kp),
u (MB, BT, Vp), all in q's dtype (bf16 for bf16 inputs: the dtype policy). Every value in the body
is batched over the MB heads (a leading dim), so each VPU step works on MB heads at once. No scratch.

`intra_chunk`, the body (kda.fused.gate_intra.mosaic_tpu calls it too), in 16-row sub-blocks b of rows
[r0, r0 + 16), with r = gc[r0] (formed from the two parts with gate.exponent, as every exponent here):
- columns j < r0: A[i, j] = sum_c (x_i e^(gc_i - r))_c (k_j e^(r - gc_j))_c, one NT dot
  [16, Kp] x [BT, Kp] -> [16, BT] per sub-block and matrix (x = k for Akk, q for Aqk), the rows
  j >= r0 of the right factor zeroed. Both factors are <= 1 (gates <= 0), so nothing overflows, and
  where one underflows the true product does too.
- the diagonal 16 x 16 blocks, all sub-blocks at once (rows grouped [MB, BT / 16, 16, Kp]): for
  each column j < 16 of a block, the exact pairwise exponent gc_i - gc_j, masked to i >= j BEFORE
  exp (as intra.pair_decay), times k_j, reduced over lanes against k_i and q_i (f32 on the VPU and
  XLU, for both input dtypes): 16 steps whatever BT.
- Ainv = (I + Akk)^-1 by forward substitution in float32: X = I, then for each column j < BT - 1,
  X -= Akk[:, j] X[j, :] (rank-1 updates on [MB, BT, BT]; row j is final when its turn comes).
- w = Ainv (beta k e^gc), u = Ainv (beta v): NN dots [BT, BT] x [BT, D]; qg = q e^gc,
  kg = k e^(gc_last - gc) elementwise in f32.
Dots take bf16 operands (one MXU pass, f32 accumulation) for bf16 inputs, f32 at HIGHEST otherwise;
the diagonal blocks and the solve are f32 either way.

Padding (q = k = v = beta = 0 there): padding rows and columns of Akk, Aqk are exact zeros, Ainv's
padding rows one-hot (substitution subtracts only zero multiples), w = u = qg = kg = 0. Chunks past
aligned_cu[-1] are computed like any other (zeros in, zeros and one-hot rows out).

VMEM (BT = 64, K = V = 128; kda._mosaic_tpu.budget, `temps` fitted to Mosaic's allocation): per
head 0.5 MiB of double-buffered blocks (bf16) and ~1.5 MiB of values. MB = 8 on every generation:
16.0 MiB (bf16) / 18.5 MiB (f32), limits asked 20 / 23 MiB on v5e and the default 32 MiB on v6e and
v7x; the smallest limits that compile are 15.7 / 18.3 MiB (tools.tpu_aot --min-vmem, v7x).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu as tpu
from kda.stages.gate import exponent
from kda.stages.intra import NAME, Out

F32 = tpu.F32
SUB = tpu.SUB


@dataclasses.dataclass(frozen=True)
class Config:
  """MB value heads per program (rounded down to a divisor of HV)."""
  heads: int = 8
  vmem_limit: Optional[int] = None   # bytes; None: the budget's (kda._mosaic_tpu)

  def __post_init__(self):
    tpu.check_config(self)


class Chunk(NamedTuple):
  """intra_chunk's results, float32, [MB, BT, .]."""
  Akk: object
  Aqk: object
  Ainv: object
  w: object
  u: object
  qg: object
  kg: object


def temps(MB, BT, Kp, Vp):
  """What intra_chunk's values take in VMEM besides the blocks, as (shape, dtype) pairs: fitted to
  Mosaic's own allocation (the smallest vmem_limit_bytes that compiles, tools.tpu_aot --min-vmem:
  15.7 MiB at MB = 8, BT = 64, K = V = 128, bf16, of which 4 MiB are blocks), ~1.5 MiB per head there
  against the ~0.45 MiB of values the body names: the unrolled sub-block and solve steps keep more
  alive than their results."""
  return [((MB, BT, Kp), F32)] * 24 + [((MB, BT, Vp), F32)] * 8 + [((MB, BT, BT), F32)] * 16


def tiles(MB, BT, Kp, Vp, dtype):
  """(blocks, scratch, temps) of one program."""
  blocks = [((MB, BT, Kp), dtype)] * 2 + [((MB, BT, Vp), dtype), ((MB, BT, 1), F32)]
  blocks += [((MB, BT, Kp), F32)] * 2
  blocks += [((MB, BT, BT), dtype)] * 3 + [((MB, BT, Kp), dtype)] * 3 + [((MB, BT, Vp), dtype)]
  return blocks, [], temps(MB, BT, Kp, Vp)


def default_config(K, V, chunk_size, dtype, gen: Optional[tpu.Generation] = None) -> Config:
  """Heads per program for this generation (kda._mosaic_tpu.default_heads)."""
  gen = gen or tpu.generation()
  return Config(heads=tpu.default_heads(lambda mb: tiles(mb, chunk_size, tpu.lanes(K), tpu.lanes(V), dtype), gen))


def _diagonal(q, k, gi, gf):
  """The diagonal 16 x 16 blocks of every sub-block at once, [MB, BT, BT] each: (Akk part without
  beta, strictly lower; Aqk part without scale, lower); 0 off the diagonal blocks. Rows are grouped
  [MB, BT / 16, 16, Kp], so column j of each block pairs with row j of the same block."""
  MB, BT, Kp = k.shape
  NB = BT // SUB
  q, k, gi, gf = (x.reshape(MB, NB, SUB, Kp) for x in (q, k, gi, gf))
  i = tpu.iota((1, 1, SUB, 1), 2)
  shape = (MB, NB, SUB, BT)
  col = tpu.iota(shape, 3) - SUB * tpu.iota(shape, 1)               # column within the row's block
  ak = aq = jnp.zeros(shape, F32)
  for j in range(SUB):
    on = i >= j
    d = jnp.exp(jnp.where(on, exponent(gi, gf, gi[:, :, j:j + 1], gf[:, :, j:j + 1]), 0.0))
    kd = k[:, :, j:j + 1] * d                                        # k_j e^(gc_i - gc_j) on rows i
    ak = jnp.where((col == j) & (i > j), jnp.sum(k * kd, axis=-1, keepdims=True), ak)
    aq = jnp.where((col == j) & on, jnp.sum(q * kd, axis=-1, keepdims=True), aq)
  return ak.reshape(MB, BT, BT), aq.reshape(MB, BT, BT)


def chunk_scores(q, k, beta, gi, gf, *, scale, mm_dtype):
  """q, k [MB, BT, Kp] f32, beta [MB, BT, 1], gi, gf [MB, BT, Kp] -> (Akk, Aqk) [MB, BT, BT] f32."""
  MB, BT, Kp = k.shape
  ak, aq = _diagonal(q, k, gi, gf)
  if BT > SUB:
    grouped = lambda x: x.reshape(MB, BT // SUB, SUB, Kp)
    gi4, gf4 = grouped(gi), grouped(gf)
    # e^(gc_i - r), r = gc at the first row of i's sub-block: <= 1
    left = jnp.exp(exponent(gi4, gf4, gi4[:, :, :1], gf4[:, :, :1])).reshape(MB, BT, Kp)
    kl, ql = (k * left).astype(mm_dtype), (q * left).astype(mm_dtype)
    j = tpu.iota((1, BT, 1), 1)
    off_k, off_q = [jnp.zeros((MB, SUB, BT), F32)], [jnp.zeros((MB, SUB, BT), F32)]
    for b in range(1, BT // SUB):
      r0 = b * SUB
      ri, rf = gi[:, r0:r0 + 1], gf[:, r0:r0 + 1]
      before = j < r0                                                # e^(r - gc_j) <= 1 for j < r0
      right = jnp.where(before, k * jnp.exp(jnp.where(before, exponent(ri, rf, gi, gf), 0.0)), 0.0)
      right = right.astype(mm_dtype)
      off_k.append(tpu.dot(kl[:, r0:r0 + SUB], right, tpu.NT))
      off_q.append(tpu.dot(ql[:, r0:r0 + SUB], right, tpu.NT))
    ak = ak + jnp.concatenate(off_k, axis=1)
    aq = aq + jnp.concatenate(off_q, axis=1)
  return ak * beta, aq * scale


def unit_lower_inverse(A):
  """(I + A)^-1 for strictly lower A [MB, BT, BT] f32, by forward substitution."""
  MB, BT, _ = A.shape
  X = (tpu.iota((MB, BT, BT), 1) == tpu.iota((MB, BT, BT), 2)).astype(F32)
  for j in range(BT - 1):                  # row j of X is final; take it out of the rows below
    X = X - A[:, :, j:j + 1] * X[:, j:j + 1, :]
  return X


def intra_chunk(q, k, v, beta, gi, gf, *, scale, mm_dtype) -> Chunk:
  """One chunk of MB heads (module docstring): q, k [MB, BT, Kp], v [MB, BT, Vp] any float dtype,
  beta [MB, BT, 1] f32, gi, gf [MB, BT, Kp] f32 -> Chunk of float32 values."""
  q, k, v = (x.astype(F32) for x in (q, k, v))
  BT = k.shape[1]
  Akk, Aqk = chunk_scores(q, k, beta, gi, gf, scale=scale, mm_dtype=mm_dtype)
  Ainv = unit_lower_inverse(Akk)
  e_start = jnp.exp(exponent(gi, gf))
  e_last = jnp.exp(exponent(gi[:, BT - 1:BT], gf[:, BT - 1:BT], gi, gf))
  A = Ainv.astype(mm_dtype)
  w = tpu.dot(A, (beta * k * e_start).astype(mm_dtype), tpu.NN)
  u = tpu.dot(A, (beta * v).astype(mm_dtype), tpu.NN)
  return Chunk(Akk, Aqk, Ainv, w, u, q * e_start, k * e_last)


def flops(HV, Ta, BT, Kp, Vp):
  """MXU and VPU work of intra_chunk over [HV, Ta] (a CostEstimate's flops)."""
  n = HV * Ta
  return n * (2 * 2 * BT * Kp + 6 * SUB * Kp + 2 * BT * BT + 2 * BT * (Kp + Vp) + 8 * Kp)


def supports(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size,
             config=None) -> Optional[str]:
  """None if `apply` takes this call, else the reason in words."""
  if k.ndim != 4 or k.shape[0] != 1 or v.ndim != 4:
    return f"q, k, v must be [1, Ta, HV, D], got k {k.shape}, v {v.shape}"
  _, Ta, HV, K = k.shape
  V = v.shape[-1]
  reason = tpu.chunk_reason(chunk_size, Ta)
  for name, x, shape in (("q", q, k.shape), ("v", v, (1, Ta, HV, V)), ("beta", beta, (1, Ta, HV)),
                         ("gc_int", gc_int, k.shape), ("gc_frac", gc_frac, k.shape)):
    reason = reason or (None if x.shape == shape else f"{name} must have shape {shape}, got {x.shape}")
    reason = reason or tpu.float_reason(name, x, (F32,) if name.startswith("gc") else (F32, tpu.BF16))
  if reason:
    return reason
  gen = tpu.generation()
  MB = tpu.heads_per_program(HV, (config or default_config(K, V, chunk_size, q.dtype, gen)).heads)
  b = tpu.budget(*tiles(MB, chunk_size, tpu.lanes(K), tpu.lanes(V), q.dtype), gen)
  return tpu.budget_reason(NAME, b, gen)


def _kernel(q_ref, k_ref, v_ref, b_ref, gi_ref, gf_ref, *out_refs, scale, mm_dtype):
  r = intra_chunk(q_ref[...], k_ref[...], v_ref[...], b_ref[...], gi_ref[...], gf_ref[...], scale=scale,
                  mm_dtype=mm_dtype)
  for ref, x in zip(out_refs, r):
    ref[...] = x.astype(ref.dtype)


def launch(q, k, v, beta, gi, gf, *, scale, chunk_size, config, interpret=False):
  """The kernel on head-first arrays: q, k [HV, Ta, Kp], v [HV, Ta, Vp], beta [HV, Ta, 1] f32,
  gi, gf [HV, Ta, Kp] f32 -> Chunk of head-first arrays in q's dtype (Akk, Aqk, Ainv [HV, Ta, BT])."""
  HV, Ta, Kp = k.shape
  Vp = v.shape[-1]
  BT, gen = chunk_size, tpu.generation()
  MB = tpu.heads_per_program(HV, config.heads)
  row = lambda D: pl.BlockSpec((MB, BT, D), lambda p, c: (p, c, 0))
  odt = q.dtype
  outs = [tpu.struct((HV, Ta, D), odt, q, k, v) for D in (BT, BT, BT, Kp, Vp, Kp, Kp)]
  args = (q, k, v, beta, gi, gf)
  b = tpu.budget(*tiles(MB, BT, Kp, Vp, odt), gen)
  kernel = functools.partial(_kernel, scale=float(scale), mm_dtype=tpu.matmul_dtype(q.dtype, k.dtype, v.dtype))
  res = pl.pallas_call(
      kernel, grid=(HV // MB, Ta // BT),
      in_specs=[row(Kp), row(Kp), row(Vp), row(1), row(Kp), row(Kp)],
      out_specs=[row(o.shape[-1]) for o in outs], out_shape=outs,
      compiler_params=tpu.compiler_params(("parallel", "parallel"), b, config.vmem_limit),
      cost_estimate=tpu.cost(flops(HV, Ta, BT, Kp, Vp), HV * Ta * (SUB + BT // SUB + 3) * Kp,
                             tpu.nbytes(*args) + tpu.nbytes(*outs)),
      interpret=tpu.interpret_params(interpret), name=f"kda_{NAME}_tpu")(*args)
  return Chunk(*res)


def apply(q, k, v, beta, gc_int, gc_frac, aligned_cu=None, *, scale, chunk_size, interpret=False, config=None):
  del aligned_cu   # every chunk is computed (past aligned_cu[-1]: zeros and a one-hot Ainv, as the reference)
  reason = supports(q, k, v, beta, gc_int, gc_frac, scale=scale, chunk_size=chunk_size, config=config)
  if reason is not None:
    raise ValueError(f"mosaic_tpu intra kernel: {reason}")
  K, V = k.shape[-1], v.shape[-1]
  config = config or default_config(K, V, chunk_size, q.dtype)
  dt = tpu.matmul_dtype(q.dtype, k.dtype, v.dtype)
  r = launch(tpu.to_heads(q, dt), tpu.to_heads(k, dt), tpu.to_heads(v, dt), tpu.column_to_heads(beta),
             tpu.to_heads(gc_int), tpu.to_heads(gc_frac), scale=scale, chunk_size=chunk_size,
             config=config, interpret=interpret)
  sq = lambda x: jnp.swapaxes(x, 0, 1)[None]
  return Out(sq(r.Akk), sq(r.Aqk), sq(r.Ainv), tpu.from_heads(r.w, K), tpu.from_heads(r.u, V),
             tpu.from_heads(r.qg, K), tpu.from_heads(r.kg, K))
