"""short: the recurrence token by token over many short sequences at once (kda.short's steps).

A call with states runs its sequences of at most L tokens (PipelineConfig.short_len) as L steps of
the recurrence, not a chunk each. Sequence n's step t, S the [K, V] float32 state entering it:

    Sd  = diag(exp(g_t)) S
    e   = beta_t (v_t - Sd^T k_t)                       [V]
    S'  = Sd + k_t e^T
    o_t = scale S'^T q_t                                [V]

Its backward, dS' the cotangent of S' and do_t of o_t (dS' += scale q_t do_t^T first):

    dq_t = scale S' do_t;   de = dS'^T k_t;   dv_t = beta_t de;   dbeta_t = (v_t - Sd^T k_t) . de
    dp = -beta_t de;   dk_t = dS' e + Sd dp;   dSd = dS' + k_t dp^T
    dg_t = rowsum(dSd * Sd);   dS = diag(exp(g_t)) dSd

In:  q, k, g [N, S, HV, K], v [N, S, HV, V], beta [N, S, HV] float32: step t of sequence n at [n, t];
     h0 [N, HV, K, V] float32; lens [N] int32 or None (all S): sequence n takes its first lens[n]
     steps, its later inputs are not read. Static: scale; skip (the reference skips at run time, by
     a lax.cond, a step no sequence takes: for lengths known only at run time).
Out: o [N, S, HV, V] float32 (0 at steps not taken), final_state [N, HV, K, V] float32;
     differentiable in the float inputs (their gradients 0 at steps not taken).
Every sequence's results and gradients read its own inputs only, so a NaN stays in its sequence.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "short"


class Out(NamedTuple):
  o: jax.Array            # [N, S, HV, V] float32
  final_state: jax.Array  # [N, HV, K, V] float32


from kda.stages.short import mosaic_tpu, pallas, reference  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, pallas=pallas, mosaic_tpu=mosaic_tpu)
