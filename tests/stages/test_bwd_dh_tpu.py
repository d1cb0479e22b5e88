"""The Mosaic TPU bwd_dh kernel (a reverse walk over the chunks) against the bwd_dh reference (TPU
interpret mode on CPU), NaN confinement between sequences, its switches, its Mosaic lowering for TPU
and its predicate."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import bwd_dh
from kda.stages.bwd_dh import mosaic_tpu as M
from tests.stages import tpu_bwd_setup as S

FIELDS = bwd_dh.Out._fields


@pytest.mark.parametrize("case", S.all_cases())
def test_kernel_matches_reference(case):
  c = S.case(**case)
  args, kw, want = S.stage_args("bwd_dh", c)
  got = S.run(M, args, kw)
  for f in FIELDS:
    S.close(f, getattr(got, f), getattr(want, f), S.tol(c))
  empty = np.diff(np.asarray(c.acu)) == 0
  np.testing.assert_array_equal(np.asarray(got.dh0)[empty], np.asarray(c.dht)[empty])


def test_nan_in_one_sequence_stays_there():
  """NaN in sequence 1's do, h and dht: every output of the other sequences (their tokens, chunks and
  dh0) is finite and bit-equal to the clean run's; the walk reseeds from dht by a select."""
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw, _ = S.stage_args("bwd_dh", c)
  clean = S.run(M, args, kw)
  acu = np.asarray(c.acu)
  lo, hi = int(acu[1]), int(acu[2])                        # sequence 1: tokens [lo, hi), two chunks
  a = list(args)
  a[7] = c.do.at[:, lo:hi].set(jnp.nan)
  a[5] = c.rc.h.at[:, lo // c.BT:hi // c.BT].set(jnp.nan)
  a[9] = c.dht.at[1].set(jnp.nan)
  got = S.run(M, tuple(a), kw)
  tok = np.ones(c.q.shape[1], bool)
  tok[lo:hi] = False
  chunks = tok[::c.BT]
  seqs = np.arange(c.dht.shape[0]) != 1
  for f, keep in (("du", tok), ("dqg", tok), ("dkg", tok), ("dw", tok)):
    x, y = np.asarray(getattr(got, f))[:, keep], np.asarray(getattr(clean, f))[:, keep]
    assert np.all(np.isfinite(x)), f
    np.testing.assert_array_equal(x, y, err_msg=f)
  np.testing.assert_array_equal(np.asarray(got.dgc_last)[:, chunks], np.asarray(clean.dgc_last)[:, chunks])
  np.testing.assert_array_equal(np.asarray(got.dh0)[seqs], np.asarray(clean.dh0)[seqs])
  assert np.isnan(np.asarray(got.dh0)[1]).all()


def test_dht_zero_and_no_dh0():
  """dht_zero: the walk seeds zeros without reading dht (NaN there changes nothing); need_dh0=False:
  dh0 is not stored (zeros). The same bits as the default walk given zero dht."""
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw, _ = S.stage_args("bwd_dh", c)
  want = S.run(M, (*args[:9], jnp.zeros_like(c.dht), args[10]), kw)
  got = S.run(M, (*args[:9], jnp.full_like(c.dht, jnp.nan), args[10]), kw, dht_zero=True, need_dh0=False)
  for f in FIELDS[1:]:
    np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), err_msg=f)
  assert np.abs(np.asarray(want.dkg)).max() > 0 and not np.asarray(got.dh0).any()


@pytest.mark.large
def test_one_head_per_program_and_two_interpreter_cores():
  c = S.case(**S.CASES["f32-K64-extreme"])
  args, kw, want = S.stage_args("bwd_dh", c)
  got = S.run(M, args, kw, interpret=S.pltpu.InterpretParams(num_cores_or_threads=2), config=M.Config(1))
  for f in FIELDS:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("BT", [16, 64])
def test_lowers_for_tpu(dtype, BT):
  args, kw = S.specs("bwd_dh", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512, BT=BT)
  assert S.lower_tpu(functools.partial(M.apply, **kw), *args) == 1


def test_supports():
  args, kw = S.specs("bwd_dh", S.F32, HV=4, Ta=512)
  assert M.supports(*args, **kw) is None
  assert "dht" in M.supports(*args[:9], S.jax.ShapeDtypeStruct((2, 4, 128, 128), S.F32), args[10], **kw)
  assert "divide" in M.supports(*args, **kw, config=M.Config(3))
  big, kwb = S.specs("bwd_dh", S.F32, HV=1, Ta=512, K=2048, V=2048)
  assert "VMEM" in M.supports(*big, **kwb)
