"""intra stage, Mosaic TPU kernel: against the reference in the TPU interpreter (pltpu.InterpretParams),
its refusals, and its Mosaic lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

from kda.stages import intra
from kda.stages.intra import mosaic_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages.test_intra import TOL, check_padding, stage_inputs

# Tolerances: test_intra.TOL, keyed by (output, input dtype), whose reasons hold here as written:
# float32 inputs run every dot at HIGHEST (the interpreter computes them exactly), so float32
# errors are summation order only; bf16 inputs give bf16 dot operands (one MXU pass: bf16 products
# are exact in float32, as in the interpreter) and bf16 stores. Measured here: float32 <= 1.6e-7
# relative on every output; bf16 (max|d| / max|ref|) Akk 2.2e-3, Aqk 2.7e-3, Ainv 2.1e-4,
# w 2.2e-3, u 4.4e-3 (1.3e-2 absolute on |u| <= ~3), qg 2.1e-3, kg 1.8e-3.

CASES = [
    # id, lens or T, K, V, BT, dtype, gate kind: an empty sequence, a 1-token one and partial chunks
    ("varlen-K64-V64-BT32-f32", [30, 0, 1, 50], 64, 64, 32, jnp.float32, "plain"),
    ("varlen-K128-V64-BT16-bf16-raw", [17, 1, 0, 40], 128, 64, 16, jnp.bfloat16, "raw"),
    # some gates -inf, -1e30, -1e5, -1e4 ... (test_gate.EXTREMES): resets, the floor, huge exponents
    ("extreme-K64-V128-BT16-f32", [45, 0, 1, 20], 64, 128, 16, jnp.float32, "extreme"),
]
LARGE = [
    # BT = 64 (four sub-blocks), -5 per token: gc reaches -320 in a chunk, exp(-gc) would overflow
    ("T128-K128-V128-BT64-f32-strong", 128, 128, 128, 64, jnp.float32, "strong"),
    ("varlen-K128-V128-BT64-bf16", [100, 0, 1, 60], 128, 128, 64, jnp.bfloat16, "plain"),
]


@functools.lru_cache(maxsize=None)
def _fns(BT, scale):
  ref = jax.jit(functools.partial(intra.reference.apply, scale=scale, chunk_size=BT))
  ker = jax.jit(functools.partial(mosaic_tpu.apply, scale=scale, chunk_size=BT, interpret=True))
  return ref, ker


def _check(lens, K, V, BT, dtype, gate_kind):
  varlen = isinstance(lens, list)
  args, valid = stage_inputs(lens=lens if varlen else None, T=None if varlen else lens, HV=2, K=K, V=V, BT=BT,
                             dtype=dtype, gate_kind=gate_kind)
  ref, ker = _fns(BT, K ** -0.5)
  want, got = ref(*args), ker(*args)
  dt = jnp.dtype(dtype).name
  for name in intra.Out._fields:
    g, w = getattr(got, name), getattr(want, name)
    chex.assert_shape(g, w.shape)
    assert g.dtype == dtype, f"{name}: dtype {g.dtype}, want {dt} (dtype policy)"
    assert bool(jnp.all(jnp.isfinite(g))), f"{name}: not finite"
    cases.report_close(name, g, w, **TOL[name, dt])
  check_padding(got, valid, BT)


@pytest.mark.parametrize("lens,K,V,BT,dtype,gate_kind", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_reference(lens, K, V, BT, dtype, gate_kind):
  _check(lens, K, V, BT, dtype, gate_kind)


@pytest.mark.large
@pytest.mark.parametrize("lens,K,V,BT,dtype,gate_kind", [c[1:] for c in LARGE], ids=[c[0] for c in LARGE])
def test_kernel_matches_reference_bt64(lens, K, V, BT, dtype, gate_kind):
  _check(lens, K, V, BT, dtype, gate_kind)


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_lowers_for_tpu(dtype):
  Ta, HV, K, V, BT = 256, 4, 128, 128, 64
  s = jax.ShapeDtypeStruct
  fn = functools.partial(mosaic_tpu.apply, scale=K ** -0.5, chunk_size=BT)
  assert lower_tpu(fn, s((1, Ta, HV, K), dtype), s((1, Ta, HV, K), dtype), s((1, Ta, HV, V), dtype),
                   s((1, Ta, HV), dtype), s((1, Ta, HV, K), jnp.float32), s((1, Ta, HV, K), jnp.float32)) == 1
