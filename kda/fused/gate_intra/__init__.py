"""gate -> intra fused: the gate activation, its chunk cumsum and everything of intra in one
kernel, so the activated gate and gc never go through HBM and no second kernel reads gc.

Members: kda.stages.gate, then kda.stages.intra, and what kda.stages.state reads of gc:

    g_act, gc_int, gc_frac = gate(g, valid, A_log, dt_bias)
    Akk, Aqk, Ainv, w, u, qg, kg = intra(q, k, v, beta, gc_int, gc_frac)
    decay[c] = exp(gc at chunk c's last row)                           (state.chunk_decay)

apply(q, k, v, beta, g, valid, A_log, dt_bias, aligned_cu=None, *, scale, chunk_size,
use_gate_in_kernel, lower_bound) on the aligned inputs of both stages -> a record with gc_int,
gc_frac, Aqk, Ainv, w, u, qg, kg and decay. Backends: mosaic_tpu. (The packed forward on Hopper has
its own fused gate + intra kernels: kda.fused.packed_forward.gate_intra.)
"""
from kda.fused.gate_intra import mosaic_tpu  # noqa: E402,F401  (the group's backend)
