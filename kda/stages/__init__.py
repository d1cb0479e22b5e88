"""The stages of the pipeline, in order; `names()` lists them (they double as `impl` keys)."""
from __future__ import annotations

from kda.stages import gate, intra, output, state
from kda.stages.base import IMPLS, Stage, resolve

FORWARD = (gate.STAGE, intra.STAGE, state.STAGE, output.STAGE)
STAGES = {s.name: s for s in FORWARD}


def names() -> tuple[str, ...]:
  return tuple(STAGES)


def get(name: str) -> Stage:
  if name not in STAGES:
    raise ValueError(f"unknown stage {name!r}; stages are {list(STAGES)}")
  return STAGES[name]


__all__ = ["Stage", "IMPLS", "names", "get", "resolve", "STAGES", "FORWARD"]
