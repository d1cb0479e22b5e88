"""The Stage interface: a name and its implementations, one module per backend.

A backend of stage `s` is the module `kda/stages/<s>/<backend>.py`:
- `apply(*args, **stage_kwargs) -> Out`: every implementation of a stage takes the same positional
  arguments and returns the same record (a NamedTuple), so one word swaps them and a test compares
  them field by field. Kernel backends also take `interpret` (decided once, by the plan) and `config`.
- `supports(*args, config, **stage_kwargs) -> None | str` (kernel backends): None if it takes the
  call, else the reason in words (a dtype it does not implement, the shared memory or VMEM its tiles
  need against what the device has).
- `stores(*args, config, **stage_kwargs) -> None | {field: dtype}` (optional, kernel backends): the
  dtypes `apply` stores its record's fields in for these arguments' dtypes, whether or not it takes
  the call. kda.plan.run rounds a fallback's record to them, so the next stages' kernels get the
  operands they take (None or {}: nothing to round).
- `Config`: a frozen, hashable dataclass of the backend's variant choices (tiles, modes). The plan
  carries one per stage and passes it down, so it is part of the jit cache key.

Backends (IMPLS): reference (jnp, readable first: the spec), xla (lean jnp for CPUs and fallbacks),
pallas (Triton, any CUDA GPU), mosaic_gpu (Hopper), mosaic_tpu (TPU). A fused group (kda.fused) is
the same object over several member stages.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Mapping, Optional

IMPLS = ("reference", "xla", "pallas", "mosaic_gpu", "mosaic_tpu")
KERNELS = ("pallas", "mosaic_gpu", "mosaic_tpu")   # take `interpret`


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
  """A stage, or with `members` a fused group of consecutive stages: backend name -> module."""
  name: str
  reference: Any = None
  xla: Any = None
  pallas: Any = None
  mosaic_gpu: Any = None
  mosaic_tpu: Any = None
  members: tuple[str, ...] = ()

  def implementations(self) -> tuple[str, ...]:
    return tuple(i for i in IMPLS if getattr(self, i) is not None)

  def backend(self, impl: str):
    if impl not in IMPLS:
      raise ValueError(f"impl for stage {self.name!r} must be one of {IMPLS}, got {impl!r}")
    mod = getattr(self, impl)
    if mod is None:
      raise NotImplementedError(f"stage {self.name!r} has no {impl!r} implementation (it has "
                                f"{', '.join(self.implementations())}); pick impl={{{self.name!r}: 'reference'}}")
    return mod

  def config_type(self, impl: str):
    """The Config class of backend `impl` (None where it has no tunables)."""
    return getattr(getattr(self, impl, None), "Config", None)

  def supports(self, impl: str, *args, config=None, **kwargs) -> Optional[str]:
    """None if backend `impl` takes these arguments, else why not."""
    mod = self.backend(impl)
    fn = getattr(mod, "takes", None) or getattr(mod, "supports", None)
    return None if fn is None else _call(fn, *args, config=config, **kwargs)

  def stores(self, impl: str, *args, config=None, **kwargs) -> Optional[Mapping[str, Any]]:
    """The dtypes backend `impl` stores its record's fields in for these arguments, where it says."""
    fn = getattr(self.backend(impl), "stores", None)
    return None if fn is None else _call(fn, *args, config=config, **kwargs)

  def __call__(self, impl: str, *args, interpret: bool = False, config=None, **kwargs):
    fn = self.backend(impl).apply
    if impl in KERNELS:
      kwargs["interpret"] = interpret
    return _call(fn, *args, config=config, **kwargs)


def _call(fn, *args, config=None, **kwargs):
  """fn(*args, **kwargs) with `config` passed where fn names it (a reference has none)."""
  if _takes_config(fn):
    kwargs["config"] = config
  return fn(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _takes_config(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return "config" in params


def resolve(impl, names: tuple[str, ...], default: Mapping[str, str],
            available: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, str]:
  """impl (None, one of IMPLS or {stage: impl}) -> {stage: impl} for every stage.

  A string asks for that backend in every stage that has it and the stage's xla implementation (else
  its reference) elsewhere; a dict is strict: naming an implementation a stage lacks is a ValueError
  naming the stage, the others keep `default`. `available` maps each stage to its implementations
  (every stage has all of them when omitted).
  """
  has = lambda n, i: available is None or i in available[n]
  if impl is None:
    return dict(default)
  if isinstance(impl, str):
    if impl not in IMPLS:
      raise ValueError(f"impl must be None, one of {IMPLS} or a dict {{stage: impl}}, got {impl!r}")
    return {n: impl if has(n, impl) else "xla" if has(n, "xla") else "reference" for n in names}
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
