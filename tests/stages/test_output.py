"""output stage: the reference against a float64 token loop, the Pallas kernel against the reference
(interpret mode), and the kernel's Triton lowering for an H200."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.stages import output
from tests import cases
from tests.lowering import lower_h200

# Reference (float32, HIGHEST) vs float64, sums of <= K + BT = 48 terms, values up to ~3.5:
# measured <= 4.3e-7; 1e-5 leaves headroom without hiding a wrong formula.
REF_TOL = dict(atol=1e-5, rtol=1e-5)
# Kernel vs reference, both float32 with full-precision dots on CPU, sums of <= K + BT = 160 terms:
# measured <= 1e-6 (summation order); 2e-5 is 20x that.
KERNEL_TOL = dict(atol=2e-5, rtol=2e-5)


def stage_inputs(seed, lens, *, HV, K, V, BT):
  """Random inputs of the output stage in kda.padding's aligned layout, zeros at padding positions.

  One numpy stream per tensor (jax.random would compile per shape, which costs more than the
  kernels here). Aqk is lower triangular with its diagonal, as intra makes it; h is 0 after the
  last sequence, as the state stage makes it.
  """
  acu = padding.aligned_cu_seqlens(jnp.asarray(lens, jnp.int32), BT)
  Ta = padding.aligned_length(sum(lens) + 3, len(lens), BT)
  valid = np.zeros((Ta,), bool)
  for n, L in enumerate(lens):
    valid[int(acu[n]):int(acu[n]) + L] = True
  r = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]
  qg = r[0].standard_normal((1, Ta, HV, K)) / np.sqrt(K)
  h = 0.5 * r[1].standard_normal((1, Ta // BT, HV, K, V))
  h[:, int(acu[-1]) // BT:] = 0.0
  Aqk = r[2].standard_normal((1, Ta, HV, BT)) / np.sqrt(BT)
  row = np.arange(Ta) % BT
  Aqk = np.where((row[:, None] >= np.arange(BT)[None, :])[None, :, None, :], Aqk, 0.0)
  col_valid = valid.reshape(Ta // BT, 1, BT).repeat(BT, 1).reshape(1, Ta, 1, BT)
  Aqk = np.where(valid[None, :, None, None] & col_valid, Aqk, 0.0)
  v_new = r[3].standard_normal((1, Ta, HV, V))
  qg, v_new = (np.where(valid[None, :, None, None], x, 0.0) for x in (qg, v_new))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(qg), f32(h), f32(Aqk), f32(v_new), valid


def numpy_output(qg, h, Aqk, v_new, scale, BT):
  """o[t] = scale * qg[t] @ h[chunk of t] + sum over j <= t in the chunk of Aqk[t, j] v_new[j], float64."""
  qg, h, Aqk, v_new = (np.asarray(x, np.float64) for x in (qg, h, Aqk, v_new))
  _, Ta, HV, K = qg.shape
  o = np.zeros(v_new.shape)
  for t in range(Ta):
    c, i = divmod(t, BT)
    for j in range(HV):
      o[0, t, j] = scale * qg[0, t, j] @ h[0, c, j]
      for s in range(i + 1):
        o[0, t, j] += Aqk[0, t, j, s] * v_new[0, c * BT + s, j]
  return o


@functools.lru_cache(maxsize=None)
def _reference(scale, BT):
  return jax.jit(functools.partial(output.reference.apply, scale=scale, chunk_size=BT))


@functools.lru_cache(maxsize=None)
def _kernel(scale, BT, config=None):
  return jax.jit(functools.partial(output.pallas.apply, scale=scale, chunk_size=BT, interpret=True,
                                   config=config))


@pytest.mark.parametrize("profile,BT", [("with_empty", 16), ("30_50", 32)])
def test_reference_matches_numpy_token_loop(profile, BT):
  qg, h, Aqk, v_new, _ = stage_inputs(1, cases.SEQ_LENS[profile], HV=2, K=16, V=8, BT=BT)
  got = _reference(0.7, BT)(qg, h, Aqk, v_new)
  cases.report_close("o", got.o, numpy_output(qg, h, Aqk, v_new, 0.7, BT), **REF_TOL)


KERNEL_CASES = [
    # profile, K, V, BT, block_v
    ("30_50", 32, 32, 16, 64),
    ("with_empty", 64, 64, 32, 64),
    ("trailing_empty", 96, 96, 64, 64),      # K and V zero-padded to 128; 2 V tiles
    ("boundaries", 64, 128, 64, 128),
    ("long_short", 32, 96, 16, 32),          # 4 V tiles
    ("45_80_20", 96, 128, 32, 64),
]


@pytest.mark.parametrize("profile,K,V,BT,block_v", KERNEL_CASES,
                         ids=[f"{p}-K{K}-V{V}-BT{BT}-BV{b}" for p, K, V, BT, b in KERNEL_CASES])
def test_kernel_matches_reference_varlen(profile, K, V, BT, block_v):
  qg, h, Aqk, v_new, valid = stage_inputs(2, cases.SEQ_LENS[profile], HV=2, K=K, V=V, BT=BT)
  scale = K ** -0.5
  want = _reference(scale, BT)(qg, h, Aqk, v_new)
  # NaN above the diagonal: the kernel masks Aqk itself, so this must not reach o
  upper = (np.arange(Aqk.shape[1])[:, None] % BT < np.arange(BT)[None, :])[None, :, None, :]
  got = _kernel(scale, BT, output.pallas.Config(block_v=block_v))(qg, h, jnp.where(upper, jnp.nan, Aqk),
                                                                v_new)
  chex.assert_shape(got.o, want.o.shape)
  cases.report_close("o", got.o, want.o, **KERNEL_TOL)
  assert not np.any(np.asarray(got.o)[:, ~valid]), "o at padding positions is not exactly 0"


def test_kernel_in_k_slabs_matches_reference():
  """o = scale qg h + Aqk v_new with the K contraction in block_k slabs (how K = 256 fits)."""
  qg, h, Aqk, v_new, _ = stage_inputs(3, cases.SEQ_LENS["30_50"], HV=2, K=64, V=32, BT=32)
  want = _reference(0.125, 32)(qg, h, Aqk, v_new)
  got = _kernel(0.125, 32, output.pallas.Config(block_v=32, block_k=16))(qg, h, Aqk, v_new)
  cases.report_close("o", got.o, want.o, **KERNEL_TOL)


def test_config_rejects_bad_tiles():
  with pytest.raises(ValueError, match="block_v"):
    output.pallas.Config(block_v=8)
  with pytest.raises(ValueError, match="precision"):
    output.pallas.Config(precision="bf16")


LOWER_CASES = [(128, 128, 64, "highest"), (128, 128, 64, "tf32"), (96, 96, 64, "highest"),
               (128, 128, 16, "highest"), (64, 128, 32, "tf32x3"), (256, 256, 64, "tf32x3")]


@pytest.mark.parametrize("K,V,BT,precision", LOWER_CASES,
                         ids=[f"K{K}-V{V}-BT{BT}-{p}" for K, V, BT, p in LOWER_CASES])
def test_kernel_lowers_for_h200(K, V, BT, precision):
  Ta, HV = 8 * BT, 2
  fn = functools.partial(output.pallas.apply, scale=K ** -0.5, chunk_size=BT,
                         config=output.pallas.Config(precision=precision))
  txt = lower_h200(fn, jnp.zeros((1, Ta, HV, K)), jnp.zeros((1, Ta // BT, HV, K, V)),
                   jnp.zeros((1, Ta, HV, BT)), jnp.zeros((1, Ta, HV, V)))
  assert "kda_output" in txt


@pytest.mark.parametrize("field,value", [("block_v", 32), ("block_k", 64), ("precision", "highest"),
                                         ("num_warps", 8), ("num_stages", 3)])
def test_config_field_changes_the_program(field, value):
  """Each Config field changes the lowered program; block_v and block_k run against the reference
  above (precision and the launch parameters leave the interpreted program as is)."""
  Ta, HV, K, V = 8 * 64, 2, 128, 64
  lower = lambda config: lower_h200(
      functools.partial(output.pallas.apply, scale=0.125, chunk_size=64, config=config),
      jnp.zeros((1, Ta, HV, K)), jnp.zeros((1, Ta // 64, HV, K, V)), jnp.zeros((1, Ta, HV, 64)),
      jnp.zeros((1, Ta, HV, V)))
  assert lower(output.pallas.Config(**{field: value})) != lower(output.pallas.Config())
