"""The fused Mosaic TPU backward (kda.fused.bwd_walk.mosaic_tpu: bwd_dh, bwd_wy, bwd_intra, bwd_gate in one reverse
walk) against its members' references and against the per-stage TPU kernels run one after the other
on the same inputs (TPU interpret mode on CPU), and its Mosaic lowering for TPU. The gate part runs
the softplus activation with A_log and dt_bias (dA_log, ddt_bias accumulated over the walk)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kda.fused.bwd_walk import mosaic_tpu as F
from kda.stages import bwd_gate
from kda.stages.bwd_dh import mosaic_tpu as dh_tpu
from kda.stages.bwd_gate import mosaic_tpu as gate_tpu
from kda.stages.bwd_intra import mosaic_tpu as intra_tpu
from kda.stages.bwd_wy import mosaic_tpu as wy_tpu
from tests.stages import tpu_bwd_setup as S

GATE_KW = dict(use_gate_in_kernel=True, lower_bound=None)


def _inputs(c):
  HV, K = c.q.shape[2:]
  rng = np.random.default_rng(9)
  A_log = jnp.asarray(rng.uniform(-1, 1, HV), S.F32)
  dt_bias = jnp.asarray(0.5 * rng.standard_normal(HV * K), S.F32)
  args = (c.q, c.k, c.v, c.g, c.beta, c.valid, A_log, dt_bias, c.Ainv, c.rc, c.av.dAqk, c.av.dv, c.do, c.dht,
          c.acu)
  return args, dict(scale=c.scale, chunk_size=c.BT, **GATE_KW)


def _check_references(c, got, tol):
  _, A_log, dt_bias = (None, *_inputs(c)[0][6:8])
  gt = bwd_gate.reference.apply(c.g, c.valid, A_log, dt_bias, c.it.dgc, c.wy.dg_state, chunk_size=c.BT, **GATE_KW)
  want = dict(dq=c.it.dq, dk=c.it.dk, dv=c.wy.dv, dbeta=c.it.dbeta, dg=gt.dg, dh0=c.ds.dh0, dA_log=gt.dA_log,
              ddt_bias=gt.ddt_bias)
  for f, w in want.items():
    S.close(f, getattr(got, f), w, tol)


def test_fused_matches_references_and_the_stage_kernels():
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw = _inputs(c)
  got = S.run(F, args, kw)
  _check_references(c, got, S.F32_TOL)
  # the per-stage kernels on the same inputs, each fed the previous one's outputs
  d, kd = S.stage_args("bwd_dh", c)[:2]
  ds = S.run(dh_tpu, d, kd)
  r = c.rc
  wy = S.run(wy_tpu, (c.q, c.k, c.v, c.beta, r.gc_int, r.gc_frac, c.Ainv, ds.dqg, ds.dkg, ds.dw, ds.du,
                      ds.dgc_last, c.acu), dict(chunk_size=c.BT))
  it = S.run(intra_tpu, (c.q, c.k, c.beta, r.gc_int, r.gc_frac, c.av.dAqk, wy.dAkk, wy.dq, wy.dk, wy.dbeta,
                         wy.dgc, c.acu), dict(scale=c.scale, chunk_size=c.BT))
  gt = S.run(gate_tpu, (c.g, c.valid, args[6], args[7], it.dgc, wy.dg_state), dict(chunk_size=c.BT, **GATE_KW))
  stages = dict(dq=it.dq, dk=it.dk, dv=wy.dv, dbeta=it.dbeta, dg=gt.dg, dh0=ds.dh0, dA_log=gt.dA_log,
                ddt_bias=gt.ddt_bias)
  for f, w in stages.items():   # the same chunk bodies: equal up to XLA's fusion of the same ops
    S.close(f"{f} (stage kernels)", getattr(got, f), w, 1e-6)


@pytest.mark.large
def test_fused_bf16():
  c = S.case(**S.CASES["bf16-K128"])
  args, kw = _inputs(c)
  got = S.run(F, args, dict(kw, dv_dtype=S.BF16, grad_dtype=S.BF16))
  assert got.dq.dtype == got.dv.dtype == S.BF16
  _check_references(c, got, S.BF16_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_lowers_for_tpu(dtype):
  args, kw = S.specs("bwd_fused", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512)
  assert S.lower_tpu(functools.partial(F.apply, **kw), *args) == 1


def test_supports():
  args, kw = S.specs("bwd_fused", S.F32, HV=4, Ta=512)
  assert F.supports(*args, **kw) is None
  assert "A_log" in F.supports(*args[:6], None, *args[7:], **kw)
  big, kwb = S.specs("bwd_fused", S.F32, HV=1, Ta=512, K=1024, V=1024)
  assert "VMEM" in F.supports(*big, **kwb)


@pytest.mark.large
def test_fused_nan_in_one_sequence_stays_there():
  """NaN in sequence 1's do and dht: the other sequences' gradients are finite and bit-equal to the
  clean run's (the walk's carry is reseeded by a select, bwd_dh's `carried`)."""
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw = _inputs(c)
  clean = S.run(F, args, kw)
  acu = np.asarray(c.acu)
  lo, hi = int(acu[1]), int(acu[2])
  a = list(args)
  a[12] = c.do.at[:, lo:hi].set(jnp.nan)
  a[13] = c.dht.at[1].set(jnp.nan)
  got = S.run(F, tuple(a), kw)
  keep = np.ones(c.q.shape[1], bool)
  keep[lo:hi] = False
  for f in ("dq", "dk", "dv", "dbeta", "dg"):
    x, y = np.asarray(getattr(got, f))[:, keep], np.asarray(getattr(clean, f))[:, keep]
    assert np.all(np.isfinite(x)), f
    np.testing.assert_array_equal(x, y, err_msg=f)
  seqs = np.arange(c.dht.shape[0]) != 1
  np.testing.assert_array_equal(np.asarray(got.dh0)[seqs], np.asarray(clean.dh0)[seqs])
