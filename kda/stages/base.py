"""The Stage interface: a name and a closed set of named implementations.

Every implementation of a stage takes the same arguments and returns the same NamedTuple, so the
composer can swap one for another (`impl={"intra": "reference"}`) and a test can compare them
field by field. Kernel launchers also take `interpret` (decided once, by the composer).

The implementations (IMPLS), each in the stage package's module of that name:
- reference: jnp (`kda/stages/<stage>/reference.py`), every stage has one;
- pallas: a Pallas kernel, Triton lowering (`pallas.py`), any CUDA GPU;
- mosaic_gpu: a Pallas Mosaic GPU kernel (`mosaic_gpu.py`), Hopper and newer.

`supports` maps a backend name to its predicate: called with the same arguments as that
implementation (`interpret` included for kernels), it returns None if the implementation takes
the call and a string saying why not otherwise (e.g. "mosaic_gpu needs bf16 q/k/v, got float32").
A backend without a predicate takes every call (today the mosaic_gpu kernels set one).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

IMPLS = ("reference", "pallas", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  reference: Callable
  pallas: Callable | None = None
  mosaic_gpu: Callable | None = None
  # {backend: predicate} (module docstring); not part of equality or the hash (a dict is unhashable)
  supports: Mapping[str, Callable] | None = dataclasses.field(default=None, compare=False)

  def implementations(self) -> tuple[str, ...]:
    return tuple(i for i in IMPLS if getattr(self, i) is not None)

  def get(self, impl: str) -> Callable:
    if impl not in IMPLS:
      raise ValueError(f"impl for stage {self.name!r} must be one of {IMPLS}, got {impl!r}")
    fn = getattr(self, impl)
    if fn is None:
      raise NotImplementedError(
          f"stage {self.name!r} has no {impl!r} implementation yet (available: "
          f"{', '.join(self.implementations())}); pick impl={{{self.name!r}: 'reference'}}")
    return fn

  def __call__(self, impl: str, *args, interpret: bool = False, **kwargs):
    fn = self.get(impl)
    if impl == "reference":
      return fn(*args, **kwargs)
    return fn(*args, interpret=interpret, **kwargs)


def resolve(impl, names: tuple[str, ...], default: Mapping[str, str],
            available: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, str]:
  """impl (None, one of IMPLS or {stage: impl}) -> {stage: impl} for every stage.

  A string asks for that backend in every stage that has it and the reference elsewhere; a dict is
  strict: naming an implementation a stage lacks is a ValueError naming the stage. `available`
  maps each stage to its implementations (every stage has all of them when omitted).
  """
  has = lambda n, i: available is None or i in available[n]
  if impl is None:
    return dict(default)
  if isinstance(impl, str):
    if impl not in IMPLS:
      raise ValueError(f"impl must be None, one of {IMPLS} or a dict {{stage: impl}}, got {impl!r}")
    return {n: impl if has(n, impl) else "reference" for n in names}
  if isinstance(impl, Mapping):
    unknown = sorted(set(impl) - set(names))
    if unknown:
      raise ValueError(f"impl names unknown stages {unknown}; stages are {list(names)}")
    for n, i in impl.items():
      if i not in IMPLS:
        raise ValueError(f"impl[{n!r}] must be one of {IMPLS}, got {i!r}")
      if not has(n, i):
        raise ValueError(f"impl[{n!r}] = {i!r}: stage {n!r} has no {i!r} implementation (it has "
                         f"{', '.join(available[n])})")
    out = dict(default)
    out.update(impl)
    return out
  raise TypeError(f"impl must be None, a str or a dict, got {type(impl).__name__}")
