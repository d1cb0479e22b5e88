"""The Mosaic TPU bwd_recompute composition (the forward's gate and state kernels around the WY
kernel) against the bwd_recompute reference (TPU interpret mode on CPU), its Mosaic lowering for
TPU and its predicate. bf16 inputs give bf16 w, u, qg, kg, h, v_new (the dtype policy)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import bwd_recompute
from kda.stages.bwd_recompute import mosaic_tpu as M
from tests.stages import tpu_bwd_setup as S


def _args(c, **over):
  a = dict(q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, valid=c.valid, A_log=None, dt_bias=None, Ainv=c.Ainv,
           initial_state=c.h0, aligned_cu=c.acu)
  a.update(over)
  return tuple(a.values())


KW = dict(use_gate_in_kernel=False, lower_bound=None)


@pytest.mark.parametrize("case", S.all_cases())
def test_kernel_matches_reference(case):
  c = S.case(**case)
  got = S.run(M, _args(c), dict(KW, chunk_size=c.BT))
  low = c.q.dtype == S.BF16
  for f in bwd_recompute.Out._fields:
    x = getattr(got, f)
    assert x.dtype == (S.BF16 if low and f not in ("gc_int", "gc_frac") else S.F32), f
    S.close(f, x, getattr(c.rc, f), S.tol(c))


@pytest.mark.large
def test_gate_activation_and_zero_initial_state():
  """use_gate_in_kernel (softplus with A_log, dt_bias) on raw gates, zero_h0 with zeros given."""
  c = S.case(**S.CASES["f32-K64-extreme"])
  HV, K = c.q.shape[2:]
  rng = np.random.default_rng(5)
  g = jnp.where(c.valid[:, :, None, None], jnp.asarray(2 * rng.standard_normal(c.q.shape), S.F32), -1e4)
  A_log = jnp.asarray(rng.uniform(-1, 1, HV), S.F32)
  dt_bias = jnp.asarray(0.5 * rng.standard_normal(HV * K), S.F32)
  args = _args(c, g=g, A_log=A_log, dt_bias=dt_bias, initial_state=jnp.zeros_like(c.h0))
  kw = dict(chunk_size=c.BT, use_gate_in_kernel=True, lower_bound=None)
  want = bwd_recompute.reference.apply(*args, **kw)
  got = S.run(M, args, dict(kw, zero_h0=True))
  for f in bwd_recompute.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_lowers_for_tpu(dtype):
  args, kw = S.specs("bwd_recompute", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512)
  assert S.lower_tpu(functools.partial(M.apply, **kw), *args) == 3


def test_supports():
  args, kw = S.specs("bwd_recompute", S.F32, HV=4, Ta=512)
  assert M.supports(*args, **kw) is None
  assert "A_log" in M.supports(*args[:6], None, *args[7:], **kw)
  assert "initial_state" in M.supports(*args[:9], S.jax.ShapeDtypeStruct((3, 4, 128, 128), S.F32), args[10], **kw)
