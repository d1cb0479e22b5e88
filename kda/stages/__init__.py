"""The stages of the pipeline, in order (forward, then backward S0-S5), and `short` (the recurrence
of a call's short sequences, beside the pipeline); `names()` lists them (they double as `impl` and
`config` keys)."""
from __future__ import annotations

from kda.stages import (bwd_dav, bwd_dh, bwd_gate, bwd_intra, bwd_recompute, bwd_wy, gate, intra, output,
                        short, state)
from kda.stages.base import IMPLS, Stage, resolve

STAGES = {s.name: s for s in (gate.STAGE, intra.STAGE, state.STAGE, output.STAGE, bwd_recompute.STAGE,
                              bwd_dav.STAGE, bwd_dh.STAGE, bwd_wy.STAGE, bwd_intra.STAGE, bwd_gate.STAGE,
                              short.STAGE)}
FORWARD = ("gate", "intra", "state", "output")
BACKWARD = ("bwd_recompute", "bwd_dav", "bwd_dh", "bwd_wy", "bwd_intra", "bwd_gate")


def names() -> tuple[str, ...]:
  return tuple(STAGES)


def get(name: str) -> Stage:
  if name not in STAGES:
    raise ValueError(f"unknown stage {name!r}; stages are {list(STAGES)}")
  return STAGES[name]


__all__ = ["Stage", "IMPLS", "names", "get", "resolve", "STAGES", "FORWARD", "BACKWARD"]
