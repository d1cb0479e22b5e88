"""bwd_walk: bwd_dh -> bwd_wy -> bwd_intra -> bwd_gate in one reverse walk over each sequence's chunks.

The state cotangent dS [K, V] is carried on chip from a sequence's last chunk to its first; per chunk
the members' bodies run in turn on it (S2: du, dqg, dkg, dw, dgc_last, dS; S3: the WY backward; S4:
the Akk and Aqk paths; S5: the reverse cumsum of dg and the activation's backward), so nothing of
S2, S3 or S4 that only the next stage reads (du, dqg, dkg, dw, dgc_last, dgc, dg_state, dAkk) reaches
HBM.

apply(q, k, v, g, beta, valid, A_log, dt_bias, Ainv, rc, dAqk, dv, do, dht, aligned_cu, *, scale,
chunk_size, use_gate_in_kernel, lower_bound, ...) with rc bwd_recompute's Out and dAqk, dv bwd_dav's
-> a record with dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias. Backends: mosaic_tpu.
"""
from kda.fused.bwd_walk import mosaic_tpu  # noqa: E402,F401  (the group's backend)
