"""The plan of one call: everything static about it, hashable (it keys the jit cache).

A plan holds, per stage, the implementation it asks for (`impl`), and per stage, fused group and
backend the config that tunes it (`config`): the user's where given, else the defaults table's
(kda.tuning). `choose` decides at trace time which implementation runs on the actual arguments:
the plan's, unless its `supports` predicate refuses them; then the reason is a ValueError where an
impl dict named the stage, else the next backend of the platform's order runs.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Mapping, NamedTuple

import jax

from kda import fused, stages, tuning
from kda.stages.base import KERNELS, resolve

from kda.stages import BACKWARD, FORWARD  # noqa: F401  (re-exported)
# The fallback order per platform: a refused backend gives way to the next one the stage has.
ORDER = {
    "gpu": ("mosaic_gpu", "pallas", "xla", "reference"),
    "tpu": ("mosaic_tpu", "xla", "reference"),
    "cpu": ("xla", "reference"),
}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How the composition runs where the kernels allow it.

  packed: the fused groups packed_forward / packed_backward run where they take the call (align and
    unalign folded into the kernels); False keeps the aligned layout everywhere (the same results:
    tools compare the two).
  segment_pieces: with no states in or out and more sequences than this, the sequences run as this
    many longer pieces, each sequence start a reset (kda.padding.pieces), on every backend (the
    packed Hopper kernels take the resets as segment masks, the other stages as -inf gates): fewer
    chunks and less memory for many short sequences. 0 turns it off.
  segment_walks: at least this many serial walks (pieces x value heads), so that few heads do not
    serialise the state kernels.
  short_len: in a call with initial or final states, the sequences of at most this many tokens run
    the recurrence token by token (kda.short), not a chunk each. 0 turns it off.
  defer_qg: where S3 and S4 both run their Hopper kernels, S4 forms dq = dqg exp(gc) and dgc's
    dqg q exp(gc) (kda.steps.defer_qg_kw): S3 reads neither q nor dqg and stores no dq (shape A:
    528 MiB fewer), S4 holds a few more values (ptxas: spill stores 784 -> 948 bytes per thread).
    Off until timed on an H200.
  keep_forward: the custom VJP's forward keeps what it forms of S0's outputs (gc in two parts, w, u,
    qg, kg: kda.steps.Kept), so that S0 runs only its state kernel; the packed forward then runs its
    unfused gate and its w, u solve (kda.fused.packed_forward). The residuals grow by 16 bytes per
    aligned token, head and column with bf16 inputs (K = V): at tools.bench's shapes A, B, C from
    801 / 789 / 773 MiB to 1953 / 1845 / 1797 (jax-linear-attention keeps 1446); the compiled
    forward + backward's temp bytes stay 1918 / 1732 MiB on A and C and grow 1922 -> 1982 on B, whose
    segmented call's finiteness probe (kda.confine) reads the kept w, u, qg, kg (one XLA reduction).
    The call without a gradient is unchanged. Off until timed on an H200.
  """
  packed: bool = True
  segment_pieces: int = 16
  segment_walks: int = 256
  short_len: int = 4
  defer_qg: bool = False
  keep_forward: bool = False

  def __post_init__(self):
    for f in ("segment_pieces", "segment_walks", "short_len"):
      x = getattr(self, f)
      if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{f} must be an int >= 0, got {x!r}")


def platform_of(device=None) -> tuple[str, str]:
  """(platform, generation) of a device (default: jax.default_device's, else the first device): ("gpu",
  "sm90" | "gpu"), ("tpu", "v5e" | "v6e" | "v7x" | "tpu") or ("cpu", "cpu")."""
  device = device or jax.config.jax_default_device or jax.devices()[0]
  if device.platform == "gpu":
    cc = str(getattr(device, "compute_capability", ""))
    return "gpu", "sm90" if cc == "9.0" else "gpu"
  if device.platform == "tpu":
    kind = device.device_kind.lower()
    gen = "v5e" if "v5 lite" in kind or "v5e" in kind else "v6e" if "v6" in kind else "v7x" if "7" in kind else "tpu"
    return "tpu", gen
  return "cpu", "cpu"


def default_impls(names, platform: str, generation: str) -> dict[str, str]:
  """Per stage the first backend of the platform's order that it has (mosaic_gpu on sm_90 only)."""
  order = tuple(i for i in ORDER[platform] if i != "mosaic_gpu" or generation == "sm90")
  return {n: next(i for i in order + ("reference",) if getattr(stages.get(n), i) is not None) for n in names}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call."""
  scale: float
  chunk_size: int
  use_qk_l2norm: bool
  use_gate_in_kernel: bool
  lower_bound: float | None
  impls: tuple[tuple[str, str], ...]
  interpret: bool
  strict: tuple[str, ...] = ()      # stages an impl dict named: a refusing `supports` is an error there
  chained: tuple[str, ...] = ()     # stages whose refusal falls through the platform's order
  zero_initial_state: bool = False  # h0 is zeros made by the api: kernels skip reading it
  final_state_unused: bool = False  # the caller drops the final state (its cotangent is zero)
  platform: str = "cpu"
  generation: str = "cpu"
  configs: tuple[tuple[tuple[str, str], Any], ...] = ()   # ((stage or group, backend), Config)

  def impl(self, name: str) -> str:
    return dict(self.impls)[name]

  def config(self, name: str, impl: str | None = None):
    """The Config of `name` (a stage, a fused group or "pipeline") for backend `impl` (default: the
    plan's impl of the stage; a group's backend must be given)."""
    if name == "pipeline":
      return dict(self.configs).get(("pipeline", ""), PipelineConfig())
    impl = impl or self.impl(name)
    return dict(self.configs).get((name, impl))

  def stage_kwargs(self, name: str) -> dict[str, Any]:
    """The static keyword arguments the pipeline passes to stage `name`."""
    BT, scale = self.chunk_size, self.scale
    gate = dict(chunk_size=BT, use_gate_in_kernel=self.use_gate_in_kernel, lower_bound=self.lower_bound)
    h0 = dict(zero_h0=True) if self.zero_initial_state else {}
    dh = dict(need_dh0=False) if self.zero_initial_state else {}
    if self.final_state_unused:
      dh["dht_zero"] = True
    return {
        "gate": gate, "intra": dict(scale=scale, chunk_size=BT), "state": dict(chunk_size=BT),
        "output": dict(scale=scale, chunk_size=BT), "bwd_recompute": dict(gate, **h0),
        "bwd_dav": dict(chunk_size=BT), "bwd_dh": dict(scale=scale, chunk_size=BT, **dh),
        "bwd_wy": dict(chunk_size=BT), "bwd_intra": dict(scale=scale, chunk_size=BT), "bwd_gate": gate,
        "short": dict(scale=scale),
    }[name]

  def choose(self, name: str, *args, **kwargs) -> str:
    return choose(self, name, *args, **kwargs)

  def run(self, name: str, *args, **kwargs):
    return run(self, name, *args, **kwargs)

  def group_backend(self, name: str, *args, **kwargs) -> str | None:
    return group_backend(self, name, *args, **kwargs)

  def members_select(self, group: str) -> str | None:
    """The backend every member of fused group `group` asks for, where the group has it, else None."""
    g = fused.GROUPS[group]
    impls = {self.impl(m) for m in g.members}
    impl = impls.pop() if len(impls) == 1 else None
    return impl if impl is not None and getattr(g, impl) is not None else None

  def state_kwargs(self) -> dict[str, bool]:
    """The forward state kernels' switches: {} unless a state is elided."""
    kw = {}
    if self.zero_initial_state:
      kw["zero_h0"] = True
    if self.final_state_unused:
      kw["store_final"] = False
    return kw


def make_plan(*, scale, chunk_size, use_qk_l2norm=False, use_gate_in_kernel=False, lower_bound=None,
              impl=None, config=None, interpret=None, zero_initial_state=False, final_state_unused=False,
              dtype="float32", K=128, V=128, device=None) -> Plan:
  """The plan of a call; dtype, K, V key the defaults table (q's dtype and head dims)."""
  platform, generation = platform_of(device)
  names = stages.names()
  impls = resolve(impl, names, default_impls(names, platform, generation),
                  {n: stages.get(n).implementations() for n in names})
  if interpret is None:
    interpret = platform == "cpu"
  strict = tuple(sorted(impl)) if isinstance(impl, Mapping) else ()
  chained = tuple(n for n in names if n not in strict and not isinstance(impl, str))
  key = dict(generation=generation, dtype=str(jax.numpy.dtype(dtype).name), K=int(K), V=int(V),
             chunk_size=int(chunk_size))
  configs = {}
  for op in list(map(stages.get, names)) + list(fused.GROUPS.values()):
    for b in op.implementations():
      c = tuning.default_config(op, b, **key)
      if c is not None:
        configs[(op.name, b)] = c
  configs[("pipeline", "")] = PipelineConfig(**tuning.pipeline_fields(**key))
  for name, c in _user_configs(config, dict(impls)):
    configs[name] = c
  return Plan(float(scale), int(chunk_size), bool(use_qk_l2norm), bool(use_gate_in_kernel),
              None if lower_bound is None else float(lower_bound), tuple(sorted(impls.items())),
              bool(interpret), strict, chained, bool(zero_initial_state), bool(final_state_unused),
              platform, generation, tuple(sorted(configs.items(), key=lambda kv: kv[0])))


def _user_configs(config, impls):
  """config {name: Config} -> [((name, backend), Config)], each checked against the backend that the
  plan runs for `name` (a group: the backend all its members select)."""
  if config is None:
    return []
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be None or a dict {{stage, group or 'pipeline': Config}}, got "
                    f"{type(config).__name__}")
  out = []
  for name, c in config.items():
    if name == "pipeline":
      if not isinstance(c, PipelineConfig):
        raise ValueError(f"config['pipeline'] must be a kda.plan.PipelineConfig, got {type(c).__name__}")
      out.append((("pipeline", ""), c))
      continue
    if name in fused.GROUPS:
      op = fused.GROUPS[name]
      runs = {impls[m] for m in op.members}
      impl = runs.pop() if len(runs) == 1 else None
      if impl is None or getattr(op, impl) is None:
        raise ValueError(f"config[{name!r}] tunes the fused group {name!r}, which does not run: its "
                         f"members select {', '.join(f'{m}={impls[m]}' for m in op.members)}")
    elif name in impls:
      op, impl = stages.get(name), impls[name]
    else:
      raise ValueError(f"config names unknown stage or group {name!r}; stages are {list(impls)}, groups "
                       f"{list(fused.GROUPS)}, and 'pipeline'")
    want = op.config_type(impl)
    if want is None or not isinstance(c, want):
      mine = [b for b in op.implementations() if op.config_type(b) is not None and isinstance(c, op.config_type(b))]
      raise ValueError(f"config[{name!r}] is {type(c).__name__}" + (f" of backend {mine[0]!r}" if mine else "")
                       + f", but {name!r} runs {impl!r}" + (f", whose config is {want.__module__}.Config"
                                                              if want is not None else ", which takes no config"))
    out.append(((name, impl), c))
  return out


def op(name: str):
  """The stage or fused group called `name`."""
  return fused.GROUPS[name] if name in fused.GROUPS else stages.get(name)


def candidates(plan: Plan, name: str) -> tuple[str, ...]:
  """The backends stage `name` may run, in order: the plan's, then (with impl=None or unnamed in an
  impl dict) the rest of the platform's order, else xla and the reference."""
  impl = plan.impl(name)
  order = ORDER[plan.platform]
  if name in plan.chained and impl in order:
    return order[order.index(impl):]
  return (impl,) + tuple(i for i in ("xla", "reference") if i != impl)


class Choice(NamedTuple):
  """One decision made while a call traced: stage or fused group `name` runs `backend` (None: a
  group that does not take the call, so its members run) after the backends in `refused`, each
  with its predicate's reason."""
  name: str
  backend: str | None
  refused: tuple[tuple[str, str], ...] = ()


_choices: contextvars.ContextVar = contextvars.ContextVar("kda_plan_choices", default=None)


@contextlib.contextmanager
def recording():
  """`with kda.plan.recording() as choices:` around the tracing of a call (`jax.make_jaxpr`,
  `.lower`, or its first call) lists in `choices` every `Choice` made, in order, the probes of a
  fused group's predicate included. It observes only: results and the jit key do not change, and a
  call jax has already traced makes no choice again."""
  log: list[Choice] = []
  token = _choices.set(log)
  try:
    yield log
  finally:
    _choices.reset(token)


def _record(choice: Choice) -> None:
  log = _choices.get()
  if log is not None:
    log.append(choice)


def _choice(plan: Plan, name: str, *args, **kwargs) -> Choice:
  st = stages.get(name)
  refused = []
  for cand in candidates(plan, name):
    if getattr(st, cand) is None:
      continue
    why = st.supports(cand, *args, config=plan.config(name, cand), **kwargs)
    if why is None:
      choice = Choice(name, cand, tuple(refused))
      _record(choice)
      return choice
    refused.append((cand, why))
    if name in plan.strict:
      raise ValueError(f"impl[{name!r}] = {plan.impl(name)!r}: {why}")
  choice = Choice(name, "reference", tuple(refused))
  _record(choice)
  return choice


def choose(plan: Plan, name: str, *args, **kwargs) -> str:
  """The implementation stage `name` runs on these arguments (module docstring)."""
  return _choice(plan, name, *args, **kwargs).backend


def run(plan: Plan, name: str, *args, **kwargs):
  """Stage `name` on these arguments, with the implementation `choose` picks.

  Where that is a fallback (a backend before it refused), its record is rounded to the dtypes the
  first refused backend that declares `stores` (kda.stages.base) would have stored for these
  arguments: with bf16 inputs a Mosaic GPU kernel stores its intermediates in bf16 and the next
  stages' kernels take only those (float32 ones would have come from float32 inputs, which keep
  float32: `stores` names nothing for them). So a plan that mixes kernels and fallbacks hands each
  kernel the operands the all-kernel plan would, at the accuracy the kernels already have. A plan
  without refusals (impl="reference", "xla", the CPU's default) is never rounded."""
  choice = _choice(plan, name, *args, **kwargs)
  st, impl = stages.get(name), choice.backend
  out = st(impl, *args, interpret=plan.interpret, config=plan.config(name, impl), **kwargs)
  for refused, _ in choice.refused:
    dtypes = st.stores(refused, *args, config=plan.config(name, refused), **kwargs)
    if dtypes is not None:
      return _rounded(out, dtypes)
  return out


def _rounded(out, dtypes):
  """Record `out` with each field named in `dtypes` cast to that dtype (None fields kept)."""
  cast = {f: getattr(out, f).astype(d) for f, d in dtypes.items() if getattr(out, f) is not None}
  return out._replace(**cast) if cast else out


def group_backend(plan: Plan, name: str, *args, **kwargs) -> str | None:
  """The backend fused group `name` runs on these arguments, or None (run its members): every member
  must select that backend and the group's predicate take the call."""
  g = fused.GROUPS[name]
  impl = plan.members_select(name)
  if impl is None:
    return None
  why = g.supports(impl, *args, config=plan.config(name, impl), **kwargs)
  _record(Choice(name, None, ((impl, why),)) if why is not None else Choice(name, impl))
  return None if why is not None else impl


def unchecked_kernels(plan: Plan, names) -> bool:
  """Whether stages `names` run kernels that shard_map's vma checks reject: Pallas' interpreter and
  plgpu.kernel do not take varying inputs (kda._vma.unchecked)."""
  kernels = {plan.impl(n) for n in names} & set(KERNELS)
  return bool(kernels) and (plan.interpret or "mosaic_gpu" in kernels)
