"""The fused group bwd_dh -> bwd_wy (kda.fused.dh_wy): bwd_dh's walk kernel, then the bwd_wy kernel
forming S2's state terms itself, against the unfused kernels and the composition of the two stages'
references (simulator); the walk's tail; the pipeline's choice; CUDA lowering and SMEM."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import pipeline
from kda.fused import dh_wy
from kda.stages import bwd_dh, bwd_wy
from kda.stages.bwd_dh import mosaic_gpu as mgd
from kda.stages.bwd_wy import mosaic_gpu as mgw
from tests.stages import bwd_setup
from tests.stages.test_bwd_dh_mosaic import make_case
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
BF16, F32 = jnp.bfloat16, jnp.float32


@functools.lru_cache(maxsize=None)
def _inputs(K=64, V=128):
  """S2's arguments (test_bwd_dh_mosaic's case: 3 sequences, tail chunks; qg, kg, w, h, v_new, cast
  to bf16 as S0's kernels hand them) and S3's extra ones (q, k, v, beta, Ainv bf16, 0 at padding)."""
  args, _, _ = make_case([70, 1, 130], K, V)
  args = tuple(x.astype(BF16) if i in (0, 1, 2, 5, 6) else x for i, x in enumerate(args))
  Ta, HV = args[0].shape[1:3]
  live = (args[1] != 0).any(-1, keepdims=True)                  # kg is 0 exactly at padding
  q, k, v, A = bwd_setup.randn(5, (1, Ta, HV, K), (1, Ta, HV, K), (1, Ta, HV, V), (1, Ta, HV, BT))
  (b,) = bwd_setup.randn(6, (1, Ta, HV))
  A = bwd_setup.mask_rows(A * 0.2, BT, strict=False)
  extra = tuple(jnp.where(live, x, 0.0).astype(BF16) for x in (q, k, v, A))
  beta = jnp.where(live[..., 0], jax.nn.sigmoid(b), 0.0)
  return args, extra[:3] + (beta, extra[3])


def _unfused(args, extra, impl):
  st_dh, st_wy = (bwd_dh.STAGE, bwd_wy.STAGE)
  kw = dict(interpret=True) if impl == "mosaic_gpu" else {}
  ds = st_dh(impl, *args, scale=args[0].shape[-1] ** -0.5, chunk_size=BT, **kw)
  q, k, v, beta, Ainv = extra
  wy = st_wy(impl, q, k, v, beta, args[3], args[4], Ainv, ds.dqg, ds.dkg, ds.dw, ds.du, ds.dgc_last,
             chunk_size=BT, **kw)
  return ds.dh0, wy


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("K,V", [(64, 128), pytest.param(128, 128, marks=pytest.mark.large)],
                         ids=["K64-V128", "K128-V128"])
def test_fused_matches_unfused_kernels_and_the_references(K, V):
  """Against the unfused kernels: the same bf16 operands, float32 sums in another order and dgc_last
  through a hi + lo split (measured <= 2.4e-7 of the max); against the references composed: the
  bwd_dh kernels' bf16 operand roundings (their own tolerance, tests/stages/test_bwd_dh_mosaic.py:
  6e-3 of the max)."""
  args, extra = _inputs(K, V)
  scale = args[0].shape[-1] ** -0.5
  dh0, wy = jax.block_until_ready(jax.jit(functools.partial(
      dh_wy.mosaic_gpu, scale=scale, chunk_size=BT, interpret=True))(*args, *extra))
  u_dh0, u_wy = jax.block_until_ready(jax.jit(lambda *a: _unfused(a[:11], a[11:], "mosaic_gpu"))(*args, *extra))
  r_dh0, r_wy = jax.jit(lambda *a: _unfused(tuple(x.astype(F32) if x.dtype == BF16 else x for x in a[:11]),
                                            tuple(x.astype(F32) for x in a[11:]), "reference"))(*args, *extra)
  assert _rel(dh0, u_dh0) == 0.0 and _rel(dh0, r_dh0) <= 6e-3
  for name in bwd_wy.Out._fields:
    got, unf, ref = (getattr(o, name) for o in (wy, u_wy, r_wy))
    assert got.shape == ref.shape and got.dtype == F32, name
    assert bool(jnp.all(jnp.isfinite(got))), name
    print(f"  {name}: fused vs unfused {_rel(got, unf):.1e}, vs references {_rel(got, ref):.1e}")
    assert _rel(got, unf) <= 2e-5, (name, _rel(got, unf))
    assert _rel(got, ref) <= 6e-3, (name, _rel(got, ref))


def test_walk_zeroes_dh_at_the_tail_and_matches_the_state_cotangent():
  """The walk's per-chunk state cotangent dh: 0 at the tail chunks (the fused kernel reads it there),
  and at the last chunk of each sequence bf16(dht) (dS_next of a sequence's last chunk)."""
  args, _ = _inputs()
  kw = dict(scale=args[0].shape[-1] ** -0.5, chunk_size=BT, interpret=True)
  wk = jax.block_until_ready(jax.jit(functools.partial(mgd.walk, **kw))(*args))
  acu = np.asarray(args[10])
  dh = np.asarray(wk.dh.astype(F32))
  assert not dh[acu[-1] // BT:].any()
  assert dh[:acu[-1] // BT].any()
  dht = np.asarray(args[9].astype(BF16).astype(F32))
  for n in range(len(acu) - 1):
    if acu[n + 1] > acu[n]:
      np.testing.assert_array_equal(dh[acu[n + 1] // BT - 1], dht[n])


def test_pipeline_fuses_only_where_asked_and_verified():
  """impl="mosaic_gpu" (not auto) fuses the group; impl=None (auto) leaves it unfused while it is in
  UNVERIFIED_GROUPS; the group's predicate refuses float32 intermediates."""
  args, extra = _inputs()
  plan = pipeline.make_plan(scale=0.125, chunk_size=BT, impl="mosaic_gpu")
  group = ("bwd_dh", "bwd_wy")
  call = lambda p, a: pipeline.fused_kernel(p, group, a, *a, *extra, chunk_size=BT)
  assert call(plan, args) is dh_wy.mosaic_gpu
  assert group in pipeline.UNVERIFIED_GROUPS
  assert call(dataclasses.replace(plan, auto=True), args) is None
  f32 = tuple(x.astype(F32) if x.dtype == BF16 else x for x in args)
  assert call(plan, f32) is None
  assert "bfloat16" in dh_wy.takes(*f32, *extra, chunk_size=BT)
  assert dh_wy.takes(*args, *extra, chunk_size=BT) is None


def test_fused_lowers_for_cuda():
  """Both kernels (the walk, bwd_wy with the state terms) lower for CUDA inside the group; the bwd_wy
  kernel's SMEM with the terms' tiles fits one CTA per SM (27 [64, 64] bf16 tiles and the barrier)."""
  args, extra = _inputs(128, 128)
  S = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  f = functools.partial(dh_wy.mosaic_gpu, scale=128 ** -0.5, chunk_size=BT)
  txt = jax.jit(f).trace(*map(S, args), *map(S, extra)).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 2
  Ta, HV, NTa = args[0].shape[1], args[0].shape[2], args[0].shape[1] // BT
  bf, f32 = (lambda *sh: jax.ShapeDtypeStruct(sh, BF16)), (lambda *sh: jax.ShapeDtypeStruct(sh, F32))
  wy_args = (*map(S, extra[:4]), f32(1, Ta, HV, 128), f32(1, Ta, HV, 128), S(extra[4]),
             bf(NTa, HV, 128, 128), bf(NTa, HV, 128, 128), bf(Ta, HV, 128), bf(Ta, HV, 128),
             f32(Ta, HV, 128), f32(NTa, HV, 128))
  smem = lowered_smem_bytes(mgw.with_state_terms, *wy_args)
  print(f"\n  bwd_wy with state terms, K = V = 128: SMEM {smem} bytes as lowered")
  assert 27 * 8192 <= smem <= 232448
