"""gate -> intra fused, inside the packed forward: the gate stage's chunk cumsum runs in intra's
scores kernel, so gc never goes through HBM.

Members: kda.stages.gate (no activation: gates given in log space), then kda.stages.intra, and what
kda.stages.state reads of gc:

    gc_int, gc_frac = the chunk cumsums of ceil(g), g - ceil(g)       (gate, floored at -128)
    Akk, Aqk, Ainv, w, u, qg, kg = intra(q, k, v, beta, gc_int, gc_frac)
    decay[c] = exp(gc at chunk c's last row)                           (state.chunk_decay)

In:  q, k [1, T, HV, K] (K = 128), v [1, T, HV, V], beta [1, T, HV], g [1, T, HV, K] raw log-space
     gates (bf16 or float32), all packed; aligned_cu [N+1] int32 and rows (kda.padding.ChunkRows)
     place each aligned chunk.
Out: (intra's Out [1, Ta, HV, *] bf16, decay [NTa, HV, K] float32), equal bit for bit to the members'
     Mosaic GPU kernels while every gate is above -1 or a chunk is not bounded, within one more
     float32 rounding of gc elsewhere (kda.fused.gate_intra.mosaic_gpu).
"""
from kda.fused.gate_intra import mosaic_gpu  # noqa: E402,F401  (the group's backend)
