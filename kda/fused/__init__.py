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

import types

from kda.fused import bwd_tpu as _bwd_walk_tpu
from kda.fused import gate_intra_tpu as _gate_intra_tpu
from kda.fused import state_output as _state_output
from kda.fused import state_output_tpu as _state_output_tpu
from kda.fused.packed_backward import mosaic_gpu as _packed_backward_mgpu
from kda.fused.packed_forward import mosaic_gpu as _packed_forward_mgpu
from kda.stages import BACKWARD, FORWARD
from kda.stages.base import Stage

GROUPS = {
    "gate_intra": Stage("gate_intra", members=("gate", "intra"), mosaic_tpu=_gate_intra_tpu),
    "state_output": Stage("state_output", members=("state", "output"), mosaic_gpu=types.SimpleNamespace(
        apply=_state_output.mosaic_gpu, supports=_state_output.takes, Config=_state_output.Config),
                          mosaic_tpu=_state_output_tpu),
    "bwd_walk": Stage("bwd_walk", members=("bwd_dh", "bwd_wy", "bwd_intra", "bwd_gate"), mosaic_tpu=_bwd_walk_tpu),
    "packed_forward": Stage("packed_forward", members=FORWARD, mosaic_gpu=_packed_forward_mgpu),
    "packed_backward": Stage("packed_backward", members=BACKWARD, mosaic_gpu=_packed_backward_mgpu),
}


def names() -> tuple[str, ...]:
  return tuple(GROUPS)
