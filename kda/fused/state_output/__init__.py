"""state -> output fused: the state recurrence and the output in one kernel. The forward needs
neither h nor v_new (the backward recomputes them), so S never leaves the chip and v_new never
reaches HBM.

Members: kda.stages.state, then kda.stages.output. Per chunk c of a sequence, S the [K, V] float32
state entering it (initial_state[n] for the first):

    v_new = u_c - w_c @ S
    o_c   = scale * qg_c @ S + Aqk_c @ v_new
    S     = exp(gc_last)[:, None] * S + kg_c^T @ v_new

In:  kg, w, qg [1, Ta, HV, K], u [1, Ta, HV, V], Aqk [1, Ta, HV, BT], gc_int, gc_frac [1, Ta, HV, K]
     float32 (only each chunk's last row is read; or the decay itself), initial_state
     [N, HV, K, V] float32, aligned_cu [N+1] int32.
Out: (o [1, Ta, HV, V] (packed mode: [1, T, HV, V]), final_state [N, HV, K, V] float32); o is 0 at
     padding tokens and on the chunks past aligned_cu[-1] (packed: at the tokens no sequence owns).
"""
from kda.fused.state_output import mosaic_gpu, mosaic_tpu, xla  # noqa: E402,F401  (the group's backends)
