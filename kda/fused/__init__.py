"""Fused groups: several consecutive stages in one backend implementation, where data would
otherwise round-trip through HBM between them. A group is a Stage with `members`; its backends
take the inputs of its first member (and what later members read besides) and return what the
pipeline uses of its members' records. The pipeline runs a group's backend only where every member
selects that backend and the group's predicate takes the call, so swapping one member to another
implementation breaks the group and the members run one by one; tests check every group against the
composition of its members' references.

Groups:
- gate_intra: gate -> intra; the activated gate and gc never reach HBM.
- state_output: state -> output; the state stays on chip and neither h nor v_new is stored.
- bwd_walk: bwd_dh -> bwd_wy -> bwd_intra -> bwd_gate in one reverse walk over the chunks; only the
  gradients leave the chip.
- packed_forward: the whole forward with align and unalign folded into the kernels (packed layout).
- packed_backward: the backward S0-S5 with align of g and unalign of the gradients folded in.
"""
from __future__ import annotations

from kda.fused import bwd_walk, gate_intra, packed_backward, packed_forward, state_output
from kda.stages import BACKWARD, FORWARD
from kda.stages.base import Stage

GROUPS = {
    "gate_intra": Stage("gate_intra", members=("gate", "intra"), mosaic_tpu=gate_intra.mosaic_tpu),
    "state_output": Stage("state_output", members=("state", "output"), mosaic_gpu=state_output.mosaic_gpu,
                          mosaic_tpu=state_output.mosaic_tpu, xla=state_output.xla),
    "bwd_walk": Stage("bwd_walk", members=("bwd_dh", "bwd_wy", "bwd_intra", "bwd_gate"), mosaic_tpu=bwd_walk.mosaic_tpu),
    "packed_forward": Stage("packed_forward", members=FORWARD, mosaic_gpu=packed_forward.mosaic_gpu),
    "packed_backward": Stage("packed_backward", members=BACKWARD, mosaic_gpu=packed_backward.mosaic_gpu),
}


def names() -> tuple[str, ...]:
  return tuple(GROUPS)
