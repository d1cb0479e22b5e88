"""packed_backward: the backward S0-S5 with the packed layout's align and unalign folded into kernels.

g is never aligned (S0's gate kernel reads it packed, S5 reads it and stores dg packed), and the
stages whose kernels take the call store their gradients packed (S3 dv, S4 dq and dk), so no XLA pass
unaligns them. S0's wy kernel, S3 and S4 read q, k, v packed and S1 and S2 read a bf16 do packed,
so where their kernels run no aligned copy of q, k, v or do is formed (beta alone is aligned, in
XLA). The same gradients as the stages on the aligned layout.

apply(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, saved, do, dht, resets=None, probe=False)
  -> kda.pipeline.Grads (probe: with `finite`, from S0's kernel).
"""
from kda.fused.packed_backward import mosaic_gpu  # noqa: E402,F401  (the group's backend)
