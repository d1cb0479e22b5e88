"""The Stage interface: the backends it names, impl selection, supports predicates, fallbacks and
configs carried by the plan."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import kda
from kda import fused, stages
from kda import plan as planning
from kda.stages.base import IMPLS, Stage
from tests import cases


def test_every_stage_is_a_package_with_its_backends():
  for name in stages.names():
    st = stages.get(name)
    pkg = getattr(stages, name)
    assert pkg.STAGE is st and pkg.NAME == name
    assert st.reference is pkg.reference
    for impl in IMPLS[1:]:
      assert (getattr(st, impl) is None) == (not hasattr(pkg, impl)), (name, impl)
      mod = getattr(st, impl)
      if mod is not None:
        assert mod is getattr(pkg, impl) and callable(mod.apply)
        if impl != "xla":
          assert callable(getattr(mod, "supports", None)) or impl == "pallas", (name, impl)
  for name, g in fused.GROUPS.items():
    assert g.name == name and g.members and all(m in stages.names() for m in g.members)


def test_impl_mosaic_gpu_falls_back_where_no_kernel_takes_the_call():
  """impl="mosaic_gpu": every pipeline stage has the kernel (short: its reference); they refuse this
  call (chunk 16, float32), so the xla / reference implementations run, bit for bit those of
  impl="xla"; an impl dict naming an implementation a stage lacks raises."""
  plan = planning.make_plan(scale=1.0, chunk_size=16, impl="mosaic_gpu")
  assert all(i == "mosaic_gpu" for n, i in plan.impls if n != "short"), plan.impls
  assert plan.impl("short") == "reference"
  with pytest.raises(ValueError, match="stage 'bwd_dav' has no 'pallas' implementation"):
    planning.make_plan(scale=1.0, chunk_size=16, impl={"bwd_dav": "pallas"})
  inp = cases.make_inputs(0, lens=[20, 13], H=1, K=16, V=16)
  run = lambda impl: kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=inp.cu_seqlens,
                                   initial_state=inp.initial_state, output_final_state=True,
                                   chunk_size=16, impl=impl)
  for got, want in zip(run("mosaic_gpu"), run("xla")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _backend(tag, supports=None):
  return types.SimpleNamespace(apply=lambda *args, interpret=False, **kw: tag, supports=supports)


def test_impl_none_picks_by_platform_and_falls_back_when_refused(monkeypatch):
  """impl=None: mosaic_gpu on sm_90 where a stage has it, pallas elsewhere on a GPU, mosaic_tpu on a
  TPU, xla on a CPU; a kernel whose `supports` refuses the call gives way to the next backend of the
  platform's order; an impl dict naming the stage turns the refusal into a ValueError with the
  predicate's reason; a string impl falls back to xla, then the reference."""
  refuse = lambda x, **kw: None if x == "ok" else f"mosaic_gpu takes 'ok', got {x!r}"
  st = Stage("state", reference=_backend("reference"), pallas=_backend("pallas"),
             mosaic_gpu=_backend("mosaic_gpu", refuse))
  monkeypatch.setitem(stages.STAGES, "state", st)
  monkeypatch.setitem(stages.STAGES, "intra", Stage("intra", reference=_backend("reference"), pallas=_backend("pallas")))
  names = stages.names()
  assert planning.default_impls(names, "gpu", "sm90")["state"] == "mosaic_gpu"
  assert planning.default_impls(names, "gpu", "sm90")["intra"] == "pallas"
  assert planning.default_impls(names, "gpu", "sm90")["bwd_dav"] == "mosaic_gpu"
  assert planning.default_impls(names, "gpu", "gpu")["state"] == "pallas"
  assert planning.default_impls(names, "cpu", "cpu")["state"] == "reference"   # no xla here
  assert planning.default_impls(names, "tpu", "v6e")["state"] == "reference"   # no mosaic_tpu, no xla
  monkeypatch.setattr(planning, "platform_of", lambda device=None: ("gpu", "sm90"))
  auto = planning.make_plan(scale=1.0, chunk_size=64)
  assert planning.run(auto, "state", "ok") == "mosaic_gpu"
  assert planning.run(auto, "state", "bad") == "pallas"
  strict = planning.make_plan(scale=1.0, chunk_size=64, impl={"state": "mosaic_gpu"})
  assert planning.run(strict, "state", "ok") == "mosaic_gpu"
  with pytest.raises(ValueError, match=r"impl\['state'\] = 'mosaic_gpu': mosaic_gpu takes 'ok', got 'bad'"):
    planning.run(strict, "state", "bad")
  loose = planning.make_plan(scale=1.0, chunk_size=64, impl="mosaic_gpu")
  assert loose.impl("state") == "mosaic_gpu"
  assert planning.run(loose, "state", "bad") == "reference"


def test_a_fallback_hands_on_the_dtypes_the_refused_kernel_stores(monkeypatch):
  """kda.plan.run rounds a fallback's record to what the first refused kernel declares in `stores`
  (fields it does not name, and None fields, kept); a backend that runs without a refusal is never
  rounded, and a kernel that declares nothing leaves the record as it is."""
  import jax.numpy as jnp
  from typing import NamedTuple

  class Out(NamedTuple):
    a: object
    b: object
    c: object

  f32 = lambda: jnp.ones((2,), jnp.float32)
  ref = types.SimpleNamespace(apply=lambda x, **kw: Out(f32(), f32(), None))
  mgpu = types.SimpleNamespace(apply=lambda x, interpret=False, **kw: Out(f32(), f32(), None),
                               supports=lambda x, **kw: None if x == "ok" else "refused",
                               stores=lambda x, **kw: {"a": jnp.bfloat16, "c": jnp.bfloat16} if x == "bf" else {})
  monkeypatch.setitem(stages.STAGES, "state", Stage("state", reference=ref, mosaic_gpu=mgpu))
  plan = planning.make_plan(scale=1.0, chunk_size=64, impl="mosaic_gpu")
  dtypes = lambda out: [None if x is None else x.dtype for x in out]
  assert dtypes(planning.run(plan, "state", "bf")) == [jnp.bfloat16, jnp.float32, None]
  assert dtypes(planning.run(plan, "state", "f32")) == [jnp.float32, jnp.float32, None]
  assert dtypes(planning.run(plan, "state", "ok")) == [jnp.float32, jnp.float32, None]
  ref_plan = planning.make_plan(scale=1.0, chunk_size=64, impl="reference")
  assert dtypes(planning.run(ref_plan, "state", "bf")) == [jnp.float32, jnp.float32, None]


def test_triton_kernels_are_never_the_default_off_a_gpu():
  """A TPU host must not pick the Triton kernels (their lowering fails there)."""
  for platform, gen in (("tpu", "v5e"), ("tpu", "v7x"), ("cpu", "cpu")):
    impls = planning.default_impls(stages.names(), platform, gen)
    assert "pallas" not in impls.values() and "mosaic_gpu" not in impls.values(), (platform, impls)


def test_plan_carries_a_config_per_backend_from_the_table():
  """Every backend with a Config gets the table's, except those that size their tiles per call
  (mosaic_tpu: its module's default_config, from the call's heads and the generation's VMEM)."""
  plan = planning.make_plan(scale=1.0, chunk_size=64, impl="mosaic_gpu")
  for name in stages.names():
    for impl in stages.get(name).implementations():
      cls = stages.get(name).config_type(impl)
      per_call = hasattr(stages.get(name).backend(impl), "default_config")
      assert (plan.config(name, impl) is None) == (cls is None or per_call), (name, impl)
      if cls is not None and not per_call:
        assert isinstance(plan.config(name, impl), cls)
  assert plan.config("pipeline") == planning.PipelineConfig()
  hash(plan)


def test_user_config_replaces_the_default_and_keys_the_plan():
  from kda.stages.state import pallas as state_pallas
  base = planning.make_plan(scale=1.0, chunk_size=64, impl="pallas")
  cfg = state_pallas.Config(block_v=32)
  plan = planning.make_plan(scale=1.0, chunk_size=64, impl="pallas", config={"state": cfg})
  assert plan.config("state") is cfg and plan != base and hash(plan) != hash(base)
  piped = planning.make_plan(scale=1.0, chunk_size=64, config={"pipeline": planning.PipelineConfig(packed=False)})
  assert piped.config("pipeline").packed is False


def test_config_for_a_backend_that_does_not_run_is_an_error():
  from kda.stages.state import pallas as state_pallas
  with pytest.raises(ValueError, match=r"config\['state'\] is Config of backend 'pallas', but 'state' runs 'mosaic_gpu'"):
    planning.make_plan(scale=1.0, chunk_size=64, impl="mosaic_gpu", config={"state": state_pallas.Config()})
  with pytest.raises(ValueError, match=r"config names unknown stage or group 'stat'"):
    planning.make_plan(scale=1.0, chunk_size=64, config={"stat": state_pallas.Config()})
  with pytest.raises(ValueError, match=r"config\['state_output'\] tunes the fused group 'state_output', which does not run"):
    planning.make_plan(scale=1.0, chunk_size=64, impl={"state": "pallas", "output": "reference"},
                       config={"state_output": fused.GROUPS["state_output"].config_type("mosaic_gpu")()})
  with pytest.raises(ValueError, match=r"config\['pipeline'\] must be a kda.plan.PipelineConfig"):
    planning.make_plan(scale=1.0, chunk_size=64, config={"pipeline": {"packed": False}})
  with pytest.raises(TypeError, match="config must be None or a dict"):
    planning.make_plan(scale=1.0, chunk_size=64, config=[1])


def test_flipping_a_config_field_changes_the_program_and_keeps_the_result():
  """The config is part of the plan, so of the jit key: the Triton state kernel in K slabs of 16
  (block_k) lowers to another program than one slab, and computes the same output (interpreted)."""
  from kda.stages.state import pallas as state_pallas
  inp = cases.make_inputs(1, lens=[40, 17], H=1, K=32, V=32)
  f = lambda cfg: kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=inp.cu_seqlens, chunk_size=16,
                                impl={"state": "pallas"}, config={"state": cfg})
  a, b = state_pallas.Config(block_k=32), state_pallas.Config(block_k=16)
  text = lambda cfg: jax_text(lambda q: f(cfg)[0], inp.q)
  assert text(a) != text(b)
  np.testing.assert_allclose(np.asarray(f(a)[0]), np.asarray(f(b)[0]), rtol=1e-6, atol=1e-6)
  assert dataclasses.replace(a, block_k=16) == b


def jax_text(fn, *args):
  import jax
  return jax.jit(fn).lower(*args).as_text()


def test_the_plan_targets_the_default_device():
  """kda.plan.platform_of: the device given, else jax.default_device's, else the first device (so a
  program traced under jax.default_device(an H200 of a deviceless topology) plans for it)."""
  import jax

  class Hopper:
    platform, compute_capability = "gpu", "9.0"

  assert planning.platform_of(Hopper()) == ("gpu", "sm90")
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    assert planning.platform_of() == ("cpu", "cpu")
  assert planning.platform_of() == planning.platform_of(jax.devices()[0])
