"""Fused groups: several consecutive stages in one backend implementation, where data would
otherwise round-trip through HBM between them. A group is a Stage with `members`; its backends
take the inputs of its first member (and what later members read besides) and return what the
pipeline uses of its members' records. The pipeline runs a group's backend only where every member
selects that backend and the group's predicate takes the call, so swapping one member to another
implementation breaks the group and the members run one by one; tests check every group against the
composition of its members' references.

Groups:
- state_output: state -> output; the state stays on chip and neither h nor v_new is stored.
- packed_forward: the whole forward with align and unalign folded into the kernels (packed layout).
- packed_backward: the backward S0-S5 with align of g and unalign of the gradients folded in.
"""
from __future__ import annotations

import types

from kda.fused import state_output as _state_output
from kda.fused.packed_backward import mosaic_gpu as _packed_backward_mgpu
from kda.fused.packed_forward import mosaic_gpu as _packed_forward_mgpu
from kda.stages import BACKWARD, FORWARD
from kda.stages.base import Stage

GROUPS = {
    "state_output": Stage("state_output", members=("state", "output"), mosaic_gpu=types.SimpleNamespace(
        apply=_state_output.mosaic_gpu, supports=_state_output.takes, Config=_state_output.Config)),
    "packed_forward": Stage("packed_forward", members=FORWARD, mosaic_gpu=_packed_forward_mgpu),
    "packed_backward": Stage("packed_backward", members=BACKWARD, mosaic_gpu=_packed_backward_mgpu),
}


def names() -> tuple[str, ...]:
  return tuple(GROUPS)
