"""bwd_gate (S5): reverse chunk-local cumsum of dgc, then the gate activation's backward.

gc[t] = g_act[c*BT] + ... + g_act[t] within chunk c, so dg_act[t] = dgc[t] + ... + dgc[c*BT + BT-1]
(a reverse cumsum inside the chunk), plus S3's dg_state. The forward zeroes g_act where valid is False and floors it at
gate.GATE_FLOOR (exp of it is 0: a full reset), so dg_act is zeroed there too: the raw gate's
gradient at padding, and at gates at or below the floor (-inf included), is exactly 0. Then, with x = g + dt_bias, a =
exp(A_log) and the sums over every token (and channel for dA_log):

    use_gate_in_kernel=False:  dg = dg_act
    lower_bound unset:  g_act = -a * softplus(x)   dx = -a * sigmoid(x) * dg_act,  dA_log = sum(g_act * dg_act)
    lower_bound set:    g_act = lb * sigmoid(z), z = a * x (x if A_log is None)
                        dz = lb * s * (1 - s) * dg_act (s = sigmoid(z)),  dx = a * dz,  dA_log = sum(z * dz)
    dg = dx,  ddt_bias[h*K + c] = sum_t dx[t, h, c]

In:  g [1, Ta, HV, K] raw (prepared: aligned, gate-neutralised), valid [1, Ta] bool, A_log [HV] or None,
     dt_bias [HV*K] or None, dgc [1, Ta, HV, K] f32 (S3 + S4), dg_state [1, Ta, HV, K] f32 (S3: the
     gradient through kg and the chunk decay, already summed over the gates it passes).
Out: dg [1, Ta, HV, K] float32 (raw-gate cotangent, 0 where valid is False), dA_log [HV] float32 or
     None (None unless use_gate_in_kernel and A_log is given), ddt_bias [HV*K] float32 or None.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from kda.stages.base import Stage

NAME = "bwd_gate"


class Out(NamedTuple):
  dg: jax.Array              # [1, Ta, HV, K] float32
  dA_log: jax.Array | None   # [HV] float32
  ddt_bias: jax.Array | None  # [HV * K] float32


from kda.stages.bwd_gate import mosaic_gpu, mosaic_tpu, reference  # noqa: E402  (they import the names above)

STAGE = Stage(NAME, reference=reference, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu)
