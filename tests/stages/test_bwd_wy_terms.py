"""bwd_wy's terms kernel (kda.stages.bwd_wy.mosaic_gpu.fused: S2's terms formed inside S3) against
S2's terms kernel followed by S3's split kernel, in the simulator; its packed mode against its
aligned call; its lowering and SMEM for CUDA."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages.bwd_dh import mosaic_gpu as mgd
from kda.stages.bwd_gate.reference import reverse_chunk_cumsum
from kda.stages.bwd_wy import mosaic_gpu as mgw
from kda.stages.bwd_wy.mosaic_gpu import fused
from kda.stages.state import chunk_decay
from tests.stages import bwd_setup
from tests.stages.test_bwd_wy_mosaic import CASES, _packed_kw, make_inputs
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
BF16, F32 = jnp.bfloat16, jnp.float32
NAMES = ("dq", "dk", "dv", "dbeta", "dgc", "dg_state", "dAkk")


def _walk_outputs(case, seed=70):
  """make_inputs(case)'s S3 inputs and what S2's walk would leave (h, dh, do, v_new, du bf16, zero at
  padding rows as the aligned layout has them), with the decay of each chunk."""
  lens, Ta, HV, K, V = CASES[case]
  args, valid = make_inputs(case, "strong")
  q, k, v, beta, gi, gf, Ainv = args[:7]
  NTa = Ta // BT
  h, dh = (0.3 * x for x in bwd_setup.randn(seed, (1, NTa, HV, K, V), (1, NTa, HV, K, V)))
  live = jnp.asarray(valid)[None, :, None, None]
  do, vn, du = (jnp.where(live, x, 0.0) for x in bwd_setup.randn(seed + 1, v.shape, v.shape, v.shape))
  bf = lambda x: x.astype(BF16)
  return (q, k, v, beta, gi, gf, Ainv, bf(h), bf(dh), bf(do), bf(vn), bf(du), chunk_decay(gi, gf, BT))


def _s2_then_split(q, k, v, beta, gi, gf, Ainv, h, dh, do, vn, du, decay, *, scale):
  """S2's terms kernel (float32 du = the bf16 du) and S3's split kernel: the composition the terms
  kernel replaces."""
  _, Ta, HV, K = q.shape
  V = v.shape[-1]
  terms = mgd._terms_kernel(Ta, HV, K, V, scale=scale, interp=jax.experimental.pallas.mosaic_gpu.InterpretGPUParams())
  dqg, dkg, dw, dgc = terms(jnp.asarray([0, Ta], jnp.int32), h[0], dh[0], vn[0], do[0], du[0].astype(F32), decay)
  out = mgw.apply(q, k, v, beta, gi, gf, Ainv, dqg[None], dkg[None], dw[None], du, dgc[None], chunk_size=BT,
                  interpret=True, config=mgw.Config(split=True), dv_dtype=BF16)
  return tuple(getattr(out, n) for n in NAMES)


@pytest.mark.parametrize("case", ["K64-V64-HV2-40_64", "K128-V128-HV1-130"])
def test_terms_kernel_matches_s2_terms_then_split(case):
  """The same dq, dk, dv, dbeta, dAkk bits as S2's terms kernel followed by S3's split kernel (dw
  and dqg, dkg formed by the same wgmma sums). The terms kernel hands dgc's reverse cumsum on inside
  dg_state (dgc = 0): what bwd_gate forms of the pair, reverse_chunk_cumsum(dgc) + dg_state, within
  float32 rounding of the split kernel's (the cumsums as products, dgc_last's sum over V as a
  product's diagonal, in other orders)."""
  args = _walk_outputs(case)
  scale = args[0].shape[-1] ** -0.5
  want = jax.jit(lambda *a: _s2_then_split(*a, scale=scale))(*args)
  got = jax.jit(lambda *a: fused.apply(*a, scale=scale, dv_dtype=BF16, interpret=True))(*args)
  for name, a, b in zip(NAMES, got, want):
    a, b = np.asarray(a.astype(F32)), np.asarray(b.astype(F32))
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert np.abs(b).max() > 0, name
    if name not in ("dgc", "dg_state"):
      np.testing.assert_array_equal(a, b, name)
  got, want = dict(zip(NAMES, got)), dict(zip(NAMES, want))
  assert np.all(np.asarray(got["dgc"]) == 0)
  gate = lambda o: np.asarray(reverse_chunk_cumsum(o["dgc"], BT) + o["dg_state"])
  a, b = gate(got), gate(want)
  assert np.abs(b).max() > 0
  assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max()


def test_packed_terms_kernel_equals_aligned():
  """rows / pieces / T: q, k, v and do read from their packed rows (NaN at tokens of no sequence:
  a 70-token gap, 5 tokens after the last) and dv stored packed give every output bit for bit the
  aligned call's (dv unaligned; 0 at tokens of no sequence); the chunks past aligned_cu[-1] are not
  written there. With the clean flag, non-finite values of q and do at real tokens read as 0."""
  from kda import padding
  case = "K128-V128-HV1-130"
  lens, Ta, HV, K, V = CASES[case]
  args = _walk_outputs(case)
  layout, kw = _packed_kw(lens, Ta)
  assert layout.Ta == Ta
  (qp, kp, vp, dop), aligned = bwd_setup.packed_and_aligned(layout, (args[0], args[1], args[2], args[9]))
  scale = K ** -0.5
  f = lambda *a, **k: fused.apply(*a, layout.aligned_cu, scale=scale, dv_dtype=BF16, interpret=True, **k)
  rest = lambda do: args[3:9] + (do,) + args[10:]
  want = jax.jit(f)(*aligned[:3], *rest(aligned[3]))
  got = jax.jit(lambda *a: f(*a, **kw))(qp, kp, vp, *rest(dop))
  live = int(layout.aligned_cu[-1])
  owned = np.asarray(padding.packed_owned_mask(layout))
  for name, a, b in zip(NAMES, got, want):
    a, b = np.asarray(a.astype(F32)), np.asarray(b.astype(F32))
    if name == "dv":
      np.testing.assert_array_equal(a, np.asarray(padding.unalign_with(layout, jnp.asarray(b))), name)
      assert np.all(a[:, ~owned] == 0)
    else:
      np.testing.assert_array_equal(a[:, :live], b[:, :live], name)
  # clean: a NaN in q and an inf in do at real tokens read as 0, the same bits as 0 there
  t = int(layout.starts[0]) + 5
  bad_q, bad_do = qp.at[0, t, 0, 3].set(jnp.nan), dop.at[0, t + 1, 0, 7].set(jnp.inf)
  zq, zdo = qp.at[0, t, 0, 3].set(0), dop.at[0, t + 1, 0, 7].set(0)
  g = jax.jit(lambda q, do, clean: f(q, kp, vp, *rest(do), clean=clean, **kw))
  for name, a, b in zip(NAMES, g(bad_q, bad_do, True), g(zq, zdo, False)):
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)), name)


@pytest.mark.parametrize("packed", [False, True], ids=["aligned", "packed"])
def test_terms_kernel_lowers_in_one_cta(packed):
  """It lowers for CUDA at K = V = 128 with `fused.smem_bytes` of SMEM, one CTA per SM."""
  from kda import padding
  S = jax.ShapeDtypeStruct
  Ta, T, HV, K, V = 4096, 4000, 4, 128, 128
  NTa, Tq = Ta // BT, (T if packed else Ta)
  f32, bf, i32 = (lambda *s: S(s, F32)), (lambda *s: S(s, BF16)), (lambda *s: S(s, jnp.int32))
  args = (bf(1, Tq, HV, K), bf(1, Tq, HV, K), bf(1, Tq, HV, V), f32(1, Ta, HV), f32(1, Ta, HV, K), f32(1, Ta, HV, K),
          bf(1, Ta, HV, BT), bf(1, NTa, HV, K, V), bf(1, NTa, HV, K, V), bf(1, Tq, HV, V), bf(1, Ta, HV, V),
          bf(1, Ta, HV, V), f32(NTa, HV, K), i32(5), i32(NTa), i32(NTa), i32(2, T // BT + 6))

  def f(*a):
    kw = dict(rows=padding.ChunkRows(a[14], a[15]), pieces=a[16], T=T, aligned_cu=a[13]) if packed else {}
    return fused.apply(*a[:13], scale=K ** -0.5, dv_dtype=BF16, dAkk_parts=True, **kw)
  smem = lowered_smem_bytes(f, *args)
  assert smem == fused.smem_bytes(V, packed) and 116224 < smem <= 232448
  assert fused.reason(K, V, HV, packed) is None
  assert "K == V" in fused.reason(128, 64, HV) and "K == V" in fused.reason(256, 256, HV)


def test_slab_pairs_over_h_and_dh():
  """pairs (K = V = 128): dq and dk come as slab pairs over h's and dh's buffers (two programs per
  chunk, each storing over the state rows only it reads), equal to the float32 call's dq, dk as
  kda._mosaic_gpu.to_pairs(slabs=True) forms them; every other output the same bits."""
  from kda._mosaic_gpu import from_pairs, to_pairs
  args = _walk_outputs("K128-V128-HV1-130")
  f = lambda *a, **k: fused.apply(*a, scale=128 ** -0.5, dv_dtype=BF16, interpret=True, **k)
  want = jax.jit(f)(*args)
  got = jax.jit(lambda *a: f(*a, pairs=True))(*args)
  for name, a, b in zip(NAMES, got, want):
    if name in ("dq", "dk"):
      assert a.shape == args[7].shape and a.dtype == BF16
      np.testing.assert_array_equal(np.asarray(a), np.asarray(to_pairs(b, slabs=True)), name)
      assert np.abs(np.asarray(from_pairs(a, slabs=True) - b)).max() <= 2e-5 * np.abs(np.asarray(b)).max()
    else:
      np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)), name)
