"""intra stage, Mosaic TPU kernel: against the reference in the TPU interpreter (pltpu.InterpretParams),
its refusals, and its Mosaic lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import gate, intra
from kda.stages.intra import mosaic_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages import tpu_setup as setup
from tests.stages.test_intra import TOL, check_padding, stage_inputs

# Tolerances: test_intra.TOL, keyed by (output, input dtype), whose reasons hold here as written:
# float32 inputs run every dot at HIGHEST (the interpreter computes them exactly), so float32
# errors are summation order only; bf16 inputs give bf16 dot operands (one MXU pass: bf16 products
# are exact in float32, as in the interpreter) and bf16 stores. Measured here: float32 <= 1.6e-7
# relative on every output; bf16 (max|d| / max|ref|) Akk 2.2e-3, Aqk 2.7e-3, Ainv 2.1e-4,
# w 2.2e-3, u 4.4e-3 (1.3e-2 absolute on |u| <= ~3), qg 2.1e-3, kg 1.8e-3.


def _check(args, valid, case):
  got = setup.kernel(mosaic_tpu.apply, scale=case.scale, chunk_size=case.BT)(*args)
  want = setup.jitted(intra.reference.apply, scale=case.scale, chunk_size=case.BT)(*args)
  dt = jnp.dtype(case.dtype).name
  for name in intra.Out._fields:
    g, w = getattr(got, name), getattr(want, name)
    chex.assert_shape(g, w.shape)
    assert g.dtype == case.dtype, f"{name}: dtype {g.dtype}, want {dt} (dtype policy)"
    assert bool(jnp.all(jnp.isfinite(g))), f"{name}: not finite"
    cases.report_close(name, g, w, **TOL[name, dt])
  check_padding(got, valid, case.BT)


@pytest.mark.parametrize("name", ["A", "B"])
def test_kernel_matches_reference(name):
  """tpu_setup's cases: float32 K = V = 64 (lane padding) BT 16, bf16 K = V = 128 BT 32; varlen with
  an empty sequence, a 1-token one and partial chunks."""
  f, case = setup.forward(name), setup.CASES[name]
  q, k, v, beta = f.ins[:4]
  gt = f.ref["gate"]
  _check((q, k, v, beta, gt.gc_int, gt.gc_frac), np.asarray(f.ins[5][0]), case)


def test_kernel_extreme_gates():
  """Some gates -inf, -1e30, -1e5, -1e4 ... (test_gate.EXTREMES): resets, the floor, huge exponents;
  case A's shapes."""
  case = setup.CASES["A"]
  args, valid = stage_inputs(lens=list(case.lens), HV=2, K=case.K, V=case.V, BT=case.BT, dtype=case.dtype,
                             gate_kind="extreme")
  assert float(jnp.min(args[4])) <= gate.GATE_FLOOR     # a floored gate (-inf, -1e30, ... -128) in gc_int
  _check(args, valid, case)


@pytest.mark.large
@pytest.mark.parametrize("lens,K,V,dtype,gate_kind", [(128, 128, 128, jnp.float32, "strong"),
                                                      ([100, 0, 1, 60], 128, 128, jnp.bfloat16, "plain")],
                         ids=["T128-f32-strong", "varlen-bf16"])
def test_kernel_matches_reference_bt64(lens, K, V, dtype, gate_kind):
  """BT = 64 (four sub-blocks); "strong": -5 per token, gc reaches -320 in a chunk (exp(-gc) would
  overflow float32)."""
  varlen = isinstance(lens, list)
  args, valid = stage_inputs(lens=lens if varlen else None, T=None if varlen else lens, HV=2, K=K, V=V, BT=64,
                             dtype=dtype, gate_kind=gate_kind)
  _check(args, valid, setup.Case(tuple(lens) if varlen else (lens,), K, V, 64, dtype))


def test_supports_refuses_in_words():
  s = jax.ShapeDtypeStruct
  q = s((1, 64, 2, 64), jnp.bfloat16)
  gc = s((1, 64, 2, 64), jnp.float32)
  args = (q, q, q, s((1, 64, 2), jnp.bfloat16), gc, gc)
  assert mosaic_tpu.supports(*args, scale=0.1, chunk_size=32) is None
  assert "multiple of 16" in mosaic_tpu.supports(*args, scale=0.1, chunk_size=8)
  assert "gc_int must be float32" in mosaic_tpu.supports(*args[:4], q, gc, scale=0.1, chunk_size=32)
  assert "beta must have shape" in mosaic_tpu.supports(*args[:3], q, gc, gc, scale=0.1, chunk_size=32)
  huge = s((1, 64, 2, 16384), jnp.float32)   # K = V = 16384: the tiles of one head exceed VMEM
  assert "VMEM" in mosaic_tpu.supports(huge, huge, huge, s((1, 64, 2), jnp.float32), huge, huge, scale=0.1,
                                       chunk_size=64)


@pytest.mark.parametrize("dtype,BT", [(jnp.float32, 32), (jnp.bfloat16, 64)], ids=["f32-BT32", "bf16-BT64"])
def test_kernel_lowers_for_tpu(dtype, BT):
  Ta, HV, K, V = 256, 4, 128, 128
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, scale=K ** -0.5, chunk_size=BT)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta, HV, K), dtype), s((1, Ta, HV, V), dtype),
                   s((1, Ta, HV), dtype), s((1, Ta, HV, K), jnp.float32), s((1, Ta, HV, K), jnp.float32)) == 1
