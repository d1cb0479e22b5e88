"""Fused groups: one kernel for several consecutive stages, where data would otherwise round-trip
through HBM between them (DESIGN.md, "Fused groups").

A fused kernel takes the inputs of its group's first stage (and what later members read besides)
and returns the fields the pipeline uses of its members' Out records. The composer calls it only
when every member of the group selects the backend it is written for, so swapping one member to
another implementation breaks the group and the unfused stages run; a test checks every fused
kernel against the composition of its members' references.

Groups (one module each, one function per backend, named after it, with its `takes` predicate):
- state_output: state -> output; the state S stays in registers and neither h nor v_new is stored.
- gate_intra: gate -> intra inside the packed forward (kda.pipeline.FUSE_GATE_INTRA, off by
  default); the gate's chunk cumsum runs in intra's scores kernel and gc never reaches HBM.
"""
