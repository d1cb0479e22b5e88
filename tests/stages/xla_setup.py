"""Shared setup of the tests of the xla implementations: every stage's inputs as the reference pipeline
hands them over (forward and backward records, impl="reference", on a varlen case), and the
comparison of a stage's xla implementation with its reference on those inputs, field by field."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kda import padding, pipeline, stages
from kda import plan as planning
from tests import cases
from tests.stages.test_gate import extreme_gates

# partial chunks, a 1-token and an empty sequence, a whole chunk; make_inputs adds a NaN tail of
# tokens past cu_seqlens[-1] (never read)
LENS = (30, 1, 0, 64, 17)
EXTRA_T = 5
CASES = {
    "f32-BT64": dict(dtype="float32", chunk_size=64),
    "bf16-BT32": dict(dtype="bfloat16", chunk_size=32),
    # 15% of the gates -inf, -1e30, ... -1e4, around the -128 floor: decays that underflow, resets
    "extreme-BT16": dict(dtype="float32", chunk_size=16, extreme=True),
}

# xla against reference, relative to the largest value of the field (atol) and elementwise (rtol).
# Both compute in float32 at HIGHEST precision; the xla paths sum the same products in another
# order, and intra, bwd_intra take each strict pair's decay as exp(a) * exp(b) (a, b <= 0) instead
# of exp(a + b): two more roundings. Measured <= 1.1e-6 of the max over these cases (bwd_intra's
# dgc, whose pair terms cancel between rows i and j); 2e-5 keeps a wide margin while a wrong or
# missing term is O(1).
# bfloat16 inputs: every stage upcasts them to float32 before any arithmetic (exact) and returns
# float32 records here, so the difference is the float32 one: the same 2e-5.
TOL = {"float32": 2e-5, "bfloat16": 2e-5}


class Records(NamedTuple):
  plan: Any
  inputs: dict      # stage name -> the positional arguments the pipeline passed it
  outputs: dict     # stage name -> its reference's Out record on them
  dtype: str        # the inputs' dtype (TOL's key)


@functools.lru_cache(maxsize=None)
def records(case: str) -> Records:
  cfg = CASES[case]
  BT, K, V = cfg["chunk_size"], 32, 16
  inp = cases.make_inputs(11, lens=list(LENS), H=2, HV=2, K=K, V=V, dtype=jnp.dtype(cfg["dtype"]),
                          extra_T=EXTRA_T)
  g = extreme_gates(inp.g, 5) if cfg.get("extreme") else inp.g
  T = inp.q.shape[1]
  layout = padding.layout_from_cu_seqlens(inp.cu_seqlens, T, BT)
  plan = planning.make_plan(scale=K ** -0.5, chunk_size=BT, impl="reference")
  args = (inp.q, inp.k, inp.v, g, inp.beta, inp.initial_state, None, None)
  keys = jax.random.split(jax.random.PRNGKey(12), 2)
  do = jax.random.normal(keys[0], inp.v.shape).astype(inp.v.dtype)
  dht = jax.random.normal(keys[1], inp.initial_state.shape)

  @jax.jit
  def run(args, do, dht):
    _, _, fwd = pipeline.forward(plan, layout, *args, record=True)
    _, bwd = pipeline.backward(plan, layout, *args, pipeline.saved(fwd), do, dht, record=True)
    names = stages.FORWARD + stages.BACKWARD
    return {**fwd["inputs"], **bwd["inputs"]}, {n: {**fwd, **bwd}[n] for n in names}

  inputs, outputs = run(args, do, dht)
  return Records(plan, inputs, outputs, cfg["dtype"])


def stage_kwargs(plan, name):
  return plan.stage_kwargs(name)


def close(name, got, want, tol):
  """chex comparison with atol = tol * max|want| (fields span several magnitudes)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got)), f"{name}: not finite"
  scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
  try:
    chex.assert_trees_all_close(got, want, atol=tol * scale, rtol=tol)
  except AssertionError as e:
    raise AssertionError(f"{name}: rel err {cases.rel_err(got, want):.2e} > {tol}\n{e}") from None


def run_xla(name, case):
  """Stage `name`'s xla record on the case's recorded inputs."""
  rec = records(case)
  st, kw = stages.get(name), stage_kwargs(rec.plan, name)
  return jax.jit(lambda *a: st("xla", *a, **kw))(*rec.inputs[name])


def check_record(name, got, want, case):
  """Two records of stage `name` field by field: same shapes and dtypes, finite, within TOL."""
  tol = TOL[records(case).dtype]
  for field, a, b in zip(type(want)._fields, got, want):
    if b is None:
      assert a is None, f"{name}.{field}: expected None"
      continue
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}.{field}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    close(f"{name}.{field} [{case}]", a, b, tol)


def check_stage(name, case):
  """Stage `name`'s xla record against its reference's on the case's recorded inputs."""
  got = run_xla(name, case)
  check_record(name, got, records(case).outputs[name], case)
  return got
