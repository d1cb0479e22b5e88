"""The composer: packed inputs -> align -> gate -> intra -> state -> output -> unalign.

Every stage is called through its Stage object with the implementation chosen in `Plan.impls`,
so a single stage can be swapped between its kernel and its jnp reference. With `record=True`
every stage's output record is returned as well (tools.trace, per-stage debugging).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kda import padding
from kda.padding import Layout
from kda.stages import gate, intra, output, state
from kda.stages.base import resolve

FORWARD_STAGES = ("gate", "intra", "state", "output")


def default_impls(names, backend: str | None = None) -> dict[str, str]:
  """Kernels on an accelerator, the jnp reference on a CPU (where kernels only interpret)."""
  from kda import stages
  backend = backend or jax.default_backend()
  out = {}
  for n in names:
    has_kernel = stages.get(n).pallas is not None
    out[n] = "pallas" if (backend != "cpu" and has_kernel) else "reference"
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call (hashable: it keys the jit cache)."""
  scale: float
  chunk_size: int
  use_qk_l2norm: bool
  use_gate_in_kernel: bool
  lower_bound: float | None
  impls: tuple[tuple[str, str], ...]
  interpret: bool

  def impl(self, name: str) -> str:
    return dict(self.impls)[name]


def make_plan(*, scale, chunk_size, use_qk_l2norm=False, use_gate_in_kernel=False, lower_bound=None,
              impl=None, interpret=None) -> Plan:
  from kda import stages
  names = stages.names()
  impls = resolve(impl, names, default_impls(names))
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return Plan(float(scale), int(chunk_size), bool(use_qk_l2norm), bool(use_gate_in_kernel),
              None if lower_bound is None else float(lower_bound), tuple(sorted(impls.items())),
              bool(interpret))


def l2norm(x):
  """x / sqrt(sum(x**2, -1) + 1e-6) in float32, back in x's dtype."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def _run(plan: Plan, name: str, *args, **kwargs):
  from kda import stages
  return stages.get(name)(plan.impl(name), *args, interpret=plan.interpret, **kwargs)


def forward_kwargs(plan: Plan, name: str) -> dict[str, Any]:
  """The static keyword arguments forward() passes to stage `name` (tools.stages reuses them)."""
  BT = plan.chunk_size
  return {
      "gate": dict(chunk_size=BT, use_gate_in_kernel=plan.use_gate_in_kernel, lower_bound=plan.lower_bound),
      "intra": dict(scale=plan.scale, chunk_size=BT),
      "state": dict(chunk_size=BT),
      "output": dict(scale=plan.scale, chunk_size=BT),
  }[name]


def prepare(plan: Plan, layout: Layout, q, k, v, g, beta):
  """Packed [1, T, ...] inputs -> aligned, l2-normalised, head-mapped, gate-neutralised inputs."""
  q, k, v, g, beta = (padding.align_with(layout, x) for x in (q, k, v, g, beta))
  valid = padding.valid_mask(layout)[None]                       # [1, Ta]
  if plan.use_qk_l2norm:                                         # after align: padding stays 0
    q, k = l2norm(q), l2norm(k)
  rep = v.shape[2] // q.shape[2]
  if rep > 1:                                                    # GVA: value head j reads head j // rep
    q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
  if plan.use_gate_in_kernel:
    g = padding.neutralize_gate(g, valid)
  return q, k, v, g, beta, valid


def forward(plan: Plan, layout: Layout, q, k, v, g, beta, initial_state, A_log, dt_bias, *,
            record: bool = False):
  """Packed inputs [1, T, ...] -> (o [1, T, HV, V] in v's dtype, final_state [N, HV, K, V] f32, records).

  records maps each stage name to its output record (and "valid" to the [1, Ta] real-token mask,
  "inputs" to {stage: positional args}, the keywords being forward_kwargs) when `record` is set,
  else it is empty.
  """
  q, k, v, g, beta, valid = prepare(plan, layout, q, k, v, g, beta)
  inputs = {}

  def run(name, *args):
    inputs[name] = args
    return _run(plan, name, *args, **forward_kwargs(plan, name))

  gt = run("gate", g, valid, A_log, dt_bias)
  it = run("intra", q, k, v, beta, gt.gc)
  st = run("state", it.kg, it.w, it.u, gt.gc, initial_state, layout.aligned_cu)
  ot = run("output", it.qg, st.h, it.Aqk, st.v_new)
  o = padding.unalign_with(layout, ot.o).astype(v.dtype)
  records: dict[str, Any] = {}
  if record:
    records = {"valid": valid, "gate": gt, "intra": it, "state": st, "output": ot, "inputs": inputs}
  return o, st.final_state, records
