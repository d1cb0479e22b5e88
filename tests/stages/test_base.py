"""The Stage interface: the backends it names, and impl="mosaic_gpu" before any stage has one."""
from __future__ import annotations

import numpy as np
import pytest

import kda
from kda import pipeline, stages
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
    assert st.mosaic_gpu is None and st.supports is None
  assert "mosaic_gpu" in IMPLS


def test_supports_is_outside_equality_and_hash():
  ref = lambda *a: None
  a = Stage("x", reference=ref)
  b = Stage("x", reference=ref, supports={"pallas": lambda *args, **kw: "no"})
  assert a == b and hash(a) == hash(b)


def test_impl_mosaic_gpu_runs_the_references():
  plan = pipeline.make_plan(scale=1.0, chunk_size=16, impl="mosaic_gpu")
  assert set(dict(plan.impls).values()) == {"reference"}
  with pytest.raises(ValueError, match="stage 'intra' has no 'mosaic_gpu' implementation"):
    pipeline.make_plan(scale=1.0, chunk_size=16, impl={"intra": "mosaic_gpu"})
  inp = cases.make_inputs(0, lens=[20, 13], H=1, K=16, V=16)
  run = lambda impl: kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=inp.cu_seqlens,
                                   initial_state=inp.initial_state, output_final_state=True,
                                   chunk_size=16, impl=impl)
  for got, want in zip(run("mosaic_gpu"), run("reference")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
