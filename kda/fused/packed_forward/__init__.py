"""packed_forward: the whole forward (align, gate, intra, state, output, unalign) on the packed layout.

The kernels read the packed inputs [1, T, ...] and write o packed: kda.padding.ChunkRows places each
aligned chunk in the packed buffer (rows r < count[c] read packed token src[c] + r), so neither the
aligned copies of the inputs nor the aligned o exist. Same arithmetic as the members' kernels on the
aligned layout; the pipeline takes it where every forward stage selects a backend that has it and
its predicate takes the call, and otherwise runs the stages on the aligned layout.

apply(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, resets=None) ->
  (o [1, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32, {"intra": intra's Out}).
"""
from kda.fused.packed_forward import mosaic_gpu  # noqa: E402,F401  (the group's backend)
