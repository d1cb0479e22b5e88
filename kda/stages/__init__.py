"""The stages of the pipeline, in order (forward, then backward S0-S5); `names()` lists them (they
double as `impl` keys)."""
from __future__ import annotations

from kda.stages import (bwd_dav, bwd_dh, bwd_gate, bwd_intra, bwd_recompute, bwd_wy, gate, intra, output,
                        state)
from kda.stages.base import IMPLS, Stage, resolve

FORWARD = (gate.STAGE, intra.STAGE, state.STAGE, output.STAGE)
BACKWARD = (bwd_recompute.STAGE, bwd_dav.STAGE, bwd_dh.STAGE, bwd_wy.STAGE, bwd_intra.STAGE, bwd_gate.STAGE)
STAGES = {s.name: s for s in FORWARD + BACKWARD}


def names() -> tuple[str, ...]:
  return tuple(STAGES)


def get(name: str) -> Stage:
  if name not in STAGES:
    raise ValueError(f"unknown stage {name!r}; stages are {list(STAGES)}")
  return STAGES[name]


__all__ = ["Stage", "IMPLS", "names", "get", "resolve", "STAGES", "FORWARD", "BACKWARD"]
