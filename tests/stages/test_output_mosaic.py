"""The Mosaic GPU output kernel against the output reference: simulator runs on CPU and CUDA lowering.

Inputs are rounded to bf16 and the reference gets the same rounded values in float32, so the only
difference left is float32 summation order (products of bf16 values are exact in float32): measured
max|d| / max|ref| <= 6e-8 with a float32 o. A bf16 o adds its own rounding, at most 2^-8 relative
(half an ulp of an 8-bit significand; measured 2.9e-3).
"""
from __future__ import annotations

import functools
import os
import re
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

from kda.stages import output
from kda.stages.output import mosaic_gpu as mgo
from tests import cases
from tests.stages.test_output import stage_inputs

BT = 64
TOL = {"float32": 1e-5, "bfloat16": 5e-3}   # max|d| / max|ref|; see the module docstring


def lowered_smem_bytes(f, *args):
  """The SMEM a plgpu kernel inside f asks for as lowered for CUDA (barriers, alignment included):
  the lowering's own budget check, with the budget set to 0 so that it reports the size."""
  bound = mgpu_core._SMEM_SIZE_BOUND
  mgpu_core._SMEM_SIZE_BOUND = 0
  try:
    # a fresh trace (no jit cache hit) and a fresh lowering (not kda's cached module)
    with mock.patch.dict(os.environ, {"KDA_LOWERING_CACHE": "0"}):
      jax.jit(lambda *a: f(*a)).trace(*args).lower(lowering_platforms=("cuda",))
  except ValueError as e:
    m = re.search(r"smem_bytes=(\d+)", str(e))
    if m is None:
      raise
    return int(m.group(1))
  finally:
    mgpu_core._SMEM_SIZE_BOUND = bound
  raise AssertionError("no Mosaic GPU kernel was lowered")


def bf16_case(lens, K, V, HV=2, seed=0):
  qg, h, Aqk, v_new, valid = stage_inputs(seed, lens, HV=HV, K=K, V=V, BT=BT)
  return tuple(x.astype(jnp.bfloat16) for x in (qg, h, Aqk, v_new)), valid


@functools.lru_cache(maxsize=None)
def _kernel(scale, config):
  return jax.jit(functools.partial(mgo.apply, scale=scale, chunk_size=BT, interpret=True, config=config))


def check(lens, K, V, config=None, HV=2, seed=0):
  args, valid = bf16_case(lens, K, V, HV, seed)
  scale = K ** -0.5
  t0 = time.time()
  got = jax.block_until_ready(_kernel(scale, config)(*args))
  secs = time.time() - t0
  want = output.reference.apply(*args, scale=scale, chunk_size=BT)
  config = config or mgo.Config()
  assert got.o.shape == want.o.shape and got.o.dtype == mgo.OUT_DTYPES[config.out_dtype]
  a, b = np.asarray(got.o, np.float64), np.asarray(want.o, np.float64)
  err = np.abs(a - b).max() / np.abs(b).max()
  print(f"\n  lens={lens} K={K} V={V} {config}: simulator {secs:.2f}s, max|d|/max|ref| {err:.2e}")
  assert err <= TOL[config.out_dtype], err
  assert not np.any(a[:, ~valid]), "o at padding and tail positions is not exactly 0"


KV = [(64, 64), (128, 128), (64, 128), (128, 64)]


@pytest.mark.parametrize("K,V", KV, ids=[f"K{k}-V{v}" for k, v in KV])
def test_output_matches_reference_varlen(K, V):
  check(cases.SEQ_LENS["boundaries"] + [0], K, V)


CONFIGS = [mgo.Config(chunks_per_program=1), mgo.Config(chunks_per_program=3),
           mgo.Config(block_v=128), mgo.Config(out_dtype="bfloat16"), mgo.Config(stage_store=False),
           mgo.Config(lane_semantics=True)]
CONFIG_IDS = ["one-chunk", "three-chunks", "bv128", "bf16-o", "direct-store", "lane"]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_output_matches_reference_configs(config):
  check([17, 0, 130, 64], 64, 128, config=config)


def test_output_supports():
  args, _ = bf16_case([5, 70], 64, 64)
  kw = dict(scale=0.125, chunk_size=BT)
  assert mgo.supports(*args, **kw) is None
  assert output.STAGE.mosaic_gpu is mgo
  qg, h, Aqk, v_new = args
  assert "bfloat16" in mgo.supports(qg, h.astype(jnp.float32), Aqk, v_new, **kw)
  assert "chunk_size" in mgo.supports(*args, chunk_size=32)
  assert "K must" in mgo.supports(qg[..., :32], h[..., :32, :], Aqk, v_new, chunk_size=BT)
  S = jax.ShapeDtypeStruct
  assert "K must be one of (64, 128), got 256" in mgo.supports(
      S(qg.shape[:3] + (256,), qg.dtype), S(h.shape[:3] + (256, 64), h.dtype), Aqk, v_new, chunk_size=BT)
  assert "block_v" in mgo.supports(*args, chunk_size=BT, config=mgo.Config(block_v=128))
  assert "Aqk" in mgo.supports(qg, h, Aqk[..., :32], v_new, chunk_size=BT)
  with pytest.raises(ValueError, match="block_v"):
    mgo.Config(block_v=32)
  with pytest.raises(ValueError, match="out_dtype"):
    mgo.Config(out_dtype="float16")
  # float32 inputs: apply (what tests and tools call) casts them
  f32 = tuple(x.astype(jnp.float32) for x in args)
  o = mgo.apply(*f32, interpret=True, **kw).o
  np.testing.assert_allclose(np.asarray(o), np.asarray(output.reference.apply(*f32, **kw).o), atol=1e-5)


def _abstract(Ta, HV, K, V):
  S, b = jax.ShapeDtypeStruct, jnp.bfloat16
  return (S((1, Ta, HV, K), b), S((1, Ta // BT, HV, K, V), b), S((1, Ta, HV, BT), b), S((1, Ta, HV, V), b))


# by default every config at the smallest and the largest head dims, the mixed ones for the default
LOWER = [pytest.param(K, V, c, id=f"K{K}-V{V}-{c}", marks=pytest.mark.large if K != V and c != mgo.Config() else ())
         for K, V in KV for c in [mgo.Config()] + CONFIGS if c.block_v <= V]


@pytest.mark.parametrize("K,V,config", LOWER)
def test_output_lowers_for_cuda(K, V, config):
  args = _abstract(32768 + 489 * BT, 16, K, V)
  f = lambda *a: mgo.apply(*a, scale=K ** -0.5, chunk_size=BT, config=config)
  smem = lowered_smem_bytes(f, *args)
  print(f"\n  K={K} V={V} {config}: SMEM {smem} bytes as lowered")
  assert smem <= 232448
  assert smem == mgo.smem_bytes(K, config, 1 if config.chunks_per_program == 1 else 2)   # the predicate's figure
  assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@functools.lru_cache(maxsize=None)
def _lowered_text(config):
  f = lambda *a: mgo.apply(*a, scale=0.125, chunk_size=BT, config=config)
  return jax.jit(f).trace(*_abstract(16 * BT, 2, 64, 128)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_config_field_changes_the_program(config):
  """Each Config field gives another lowered program; test_output_matches_reference_configs runs
  each of these configs against the reference in the simulator."""
  assert _lowered_text(config) != _lowered_text(mgo.Config())


def test_output_lowers_for_cuda_many_chunks():
  # more than 65535 chunk groups: the launcher moves them to grid x
  args = _abstract(70000 * BT, 1, 64, 64)
  f = lambda *a: mgo.apply(*a, scale=0.125, chunk_size=BT, config=mgo.Config(chunks_per_program=1))
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
