"""The Stage interface: the backends it names, impl selection, supports predicates and fallbacks."""
from __future__ import annotations

import numpy as np
import pytest

import kda
from kda import pipeline, stages
from kda import plan as planning
from kda.stages.base import IMPLS, Stage
from tests import cases


def test_every_stage_is_a_package_with_its_backends():
  for name in stages.names():
    st = stages.get(name)
    pkg = getattr(stages, name)
    assert pkg.STAGE is st and pkg.NAME == name
    assert st.reference is pkg.reference.apply
    assert (st.pallas is None) == (not hasattr(pkg, "pallas"))
    if st.pallas is not None:
      assert st.pallas is pkg.pallas.apply
    if st.mosaic_gpu is not None:
      assert st.mosaic_gpu is pkg.mosaic_gpu.apply and st.supports == {"mosaic_gpu": pkg.mosaic_gpu.takes}
    else:
      assert st.supports is None and not hasattr(pkg, "mosaic_gpu")
  assert "mosaic_gpu" in IMPLS


def test_supports_is_outside_equality_and_hash():
  ref = lambda *a: None
  a = Stage("x", reference=ref)
  b = Stage("x", reference=ref, supports={"pallas": lambda *args, **kw: "no"})
  assert a == b and hash(a) == hash(b)


def test_impl_mosaic_gpu_runs_the_references_where_no_kernel_takes_the_call():
  """impl="mosaic_gpu": every stage has the kernel (S5 since its kernel); they refuse this call
  (chunk 16, float32), so the references run and the results are the reference's bit for bit; an
  impl dict naming an implementation a stage lacks raises."""
  plan = planning.make_plan(scale=1.0, chunk_size=16, impl="mosaic_gpu")
  want = {n: "mosaic_gpu" if "mosaic_gpu" in stages.get(n).implementations() else "reference"
          for n in stages.names()}
  assert dict(plan.impls) == want
  assert all(want[s.name] == "mosaic_gpu" for s in stages.FORWARD)
  assert all(i == "mosaic_gpu" for i in want.values()), want
  with pytest.raises(ValueError, match="stage 'bwd_dav' has no 'pallas' implementation"):
    planning.make_plan(scale=1.0, chunk_size=16, impl={"bwd_dav": "pallas"})
  inp = cases.make_inputs(0, lens=[20, 13], H=1, K=16, V=16)
  run = lambda impl: kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=inp.cu_seqlens,
                                   initial_state=inp.initial_state, output_final_state=True,
                                   chunk_size=16, impl=impl)
  for got, want in zip(run("mosaic_gpu"), run("reference")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _fake(tag):
  def fn(*args, interpret=False, **kwargs):
    return tag
  return fn


def test_impl_none_picks_mosaic_gpu_on_hopper_and_falls_back_when_refused(monkeypatch):
  """impl=None: mosaic_gpu on sm_90 where a stage has it, pallas elsewhere on a GPU; a mosaic_gpu
  kernel whose `supports` refuses the call gives way to pallas, then the reference; an impl dict
  naming the stage turns the refusal into a ValueError with the predicate's reason."""
  refuse = {"mosaic_gpu": lambda x, **kw: None if x == "ok" else f"mosaic_gpu takes 'ok', got {x!r}"}
  st = Stage("state", reference=_fake("reference"), pallas=_fake("pallas"), mosaic_gpu=_fake("mosaic_gpu"),
             supports=refuse)
  monkeypatch.setitem(stages.STAGES, "state", st)
  # every real stage with a pallas kernel has a mosaic_gpu one too: a fake pallas-only stage
  monkeypatch.setitem(stages.STAGES, "intra", Stage("intra", reference=_fake("reference"), pallas=_fake("pallas")))
  names = stages.names()
  assert pipeline.default_impls(names, backend="gpu", hopper=True)["state"] == "mosaic_gpu"
  assert pipeline.default_impls(names, backend="gpu", hopper=True)["intra"] == "pallas"
  monkeypatch.setattr(pipeline, "DEVICE_UNVERIFIED", frozenset({"bwd_gate"}))
  assert pipeline.default_impls(names, backend="gpu", hopper=True)["bwd_gate"] == "reference"
  assert pipeline.default_impls(names, backend="gpu", hopper=True)["bwd_dav"] == "mosaic_gpu"
  assert pipeline.default_impls(names, backend="gpu", hopper=False)["state"] == "pallas"
  assert pipeline.default_impls(names, backend="cpu", hopper=True)["state"] == "reference"
  auto = pipeline.Plan(1.0, 64, False, False, None, (("state", "mosaic_gpu"),), True)
  assert planning.run(auto, "state", "ok") == "mosaic_gpu"
  assert planning.run(auto, "state", "bad") == "pallas"
  assert planning.choose(auto, "state", "bad") == "pallas"
  strict = planning.make_plan(scale=1.0, chunk_size=64, impl={"state": "mosaic_gpu"})
  assert planning.run(strict, "state", "ok") == "mosaic_gpu"
  with pytest.raises(ValueError, match=r"impl\['state'\] = 'mosaic_gpu': mosaic_gpu takes 'ok', got 'bad'"):
    planning.run(strict, "state", "bad")
  loose = planning.make_plan(scale=1.0, chunk_size=64, impl="mosaic_gpu")
  assert loose.impl("state") == "mosaic_gpu" and loose.impl("intra") == "reference"
  assert planning.run(loose, "state", "bad") == "reference"      # a string: its backend or the reference
