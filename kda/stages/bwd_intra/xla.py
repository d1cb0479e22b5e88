"""bwd_intra: the XLA implementation; the math is in kda.stages.bwd_intra.

The reference forms the pair decays E[i, j] = exp(gc_i - gc_j) of every chunk ([NTa, BT, BT, HV, K]).
Here, as in the intra stage's XLA path (kda.stages.intra.xla, which has the argument), every strict
pair j < i lies in one block of the recursive halving, level s, with i in the block's second half,
j in its first and E[i, j] = F_i C_j (F = exp(gc_i - r), C = exp(r - gc_j), r = gc at the second
half's first row; both <= 1). With P = scale * dAqk and Q = dAkk restricted to the block, each
sum over pairs is a matmul of the block and a factor on the side the sum lands on:

    dqA'_i  = F_i * (P @ (k C))_i                  (the sums over j < i: rows)
    G_i     = F_i * (Q @ (k C))_i
    dkA'_j + dkK2_j = C_j * (P^T @ (q F) + (beta Q)^T @ (k F))_j      (the sums over i > j: columns)

Only dkA' + dkK2 is needed (dk takes their sum, dgc minus it), so the columns take one sum; with q
and k stacked, each level is two matmuls (the rows' P and Q together, the columns' sum over both).
Then with d = scale * diag(dAqk) (the diagonal, decay 1):

    dq    += dqA' + d k          dk += (dkA' + dkK2) + d q + beta G
    dbeta += sum_K(k G)          dgc += q dqA' - k (dkA' + dkK2) + k beta G

The blocks of every level come out of the [BT, BT] cotangents in one gather (intra.xla.blocks); each
level adds its terms into the accumulators' halves in place (dynamic_update_slice), and the levels
run one after the other (an optimization barrier), so one level's factors and operands are live at
a time. No exp(-gc) is formed alone and nothing is divided by beta. Float32, as the reference.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda._xla import compiled
from kda.stages.bwd_intra import Out, summed
from kda.stages.intra import from_chunks, to_chunks
from kda.stages.intra.xla import blocks, factors, first, halves, levels, second, sequential

HI = lax.Precision.HIGHEST


def add_half(acc, x, s, which):
  """acc [NTa, BT, ...] + x [NTa, BT/(2s), s, ...] on level s's first (0) or second (1) halves."""
  h = halves(acc, s)
  a, b = h[:, :, :1], h[:, :, 1:]
  a, b = (a + x[:, :, None], b) if which == 0 else (a, b + x[:, :, None])
  return jnp.concatenate([a, b], 2).reshape(acc.shape)


@compiled
def apply(q, k, beta, gc_int, gc_frac, dAqk, dAkk, dq, dk, dbeta, dgc, aligned_cu=None, *, scale, chunk_size,
          grad_dtype=None):
  """aligned_cu is not used: every chunk is computed (no token at the tail, so no term there).
  grad_dtype: dq's and dk's dtype (float32 unless given)."""
  del aligned_cu
  f32 = jnp.float32
  dAkk = summed(dAkk)
  BT = chunk_size
  q, k, beta, gi, gf, dAqk, dAkk = (to_chunks(x.astype(f32), BT) for x in (q, k, beta, gc_int, gc_frac, dAqk, dAkk))
  P = scale * dAqk                                            # [NTa, BT(i), HV, BT(j)]
  W = jnp.stack([P, dAkk, dAkk * beta[..., None]], 1).transpose(0, 3, 1, 2, 4)   # [NTa, HV, 3, BT, BT]: P, Q, beta Q
  Wb = blocks(W)                                              # {s: [NTa, nb, HV, 3, s, s]}
  X = jnp.stack([q, k], -2)                                   # [NTa, BT, HV, 2, K]
  R = jnp.zeros(k.shape[:3] + (2,) + k.shape[3:], f32)        # rows: dqA', G
  Y = jnp.zeros_like(k)                                       # columns: dkA' + dkK2
  done = ()
  for s in levels(BT):
    # one level at a time (its inputs wait for the level before); the accumulators stay out of the
    # barrier, so that their updates happen in place
    X, k, gi, gf = sequential((X, k, gi, gf), done)
    F, C = factors(gi, gf, s)                                 # [NTa, nb, s, HV, K]
    kC = first(k, s) * C
    rows = jnp.einsum("cmhxij,cmjhk->cmihxk", Wb[s][:, :, :, :2], kC, precision=HI) * F[..., None, :]
    XF = second(X, s) * F[..., None, :]                       # q F, k F
    cols = jnp.einsum("cmhxij,cmihxk->cmjhk", Wb[s][:, :, :, ::2], XF, precision=HI) * C
    R, Y, done = add_half(R, rows, s, 1), add_half(Y, cols, s, 0), (rows, cols)
  dqA, G = R[..., 0, :], R[..., 1, :]
  d = jnp.moveaxis(jnp.diagonal(P, axis1=1, axis2=3), 1, 2)[..., None]   # [NTa, BT, HV, 1]
  bG = beta[..., None] * G
  dq_t = dqA + d * k
  dk_t = Y + d * q + bG
  dbeta_t = jnp.sum(k * G, -1)
  dgc_t = q * dqA - k * Y + k * bG
  add = lambda acc, x: acc.astype(f32) + from_chunks(x)
  out = lambda acc, x: add(acc, x).astype(grad_dtype or f32)
  return Out(out(dq, dq_t), out(dk, dk_t), add(dbeta, dbeta_t), add(dgc, dgc_t))
