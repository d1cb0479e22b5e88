"""Segment masks (kda.pipeline.segment_rows) in the Mosaic GPU intra and bwd_intra kernels: a chunk
holding sequence starts of a segmented layout (gates -inf there, floored at -128) keeps the bounded
path, its pairs masked to its segments and the resets' -128 steps taken out of gc_int, and the
results equal the stage references on the same gc (which see the -128 steps: exact zeros across a
reset). Simulator runs on CPU and CUDA lowering.

Layout: one piece of 180 tokens in three chunks with resets mid-chunk (rows 5, 37, 40, 41 of chunk
0), at a chunk's first row (64) and in chunk 2 (150; 190 is past the piece's tokens), so chunk 0
holds five segments, chunk 1 starts with one and chunk 2 holds two, then padding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.padding import pieces
from kda.stages.bwd_intra import mosaic_gpu as mgb
from kda.stages.intra import mosaic_gpu as mgi
from tests.stages import bwd_setup
from tests.stages import test_bwd_intra_mosaic as tb
from tests.stages import test_intra_mosaic as ti
from tests.stages.test_intra_mosaic import _gc

BT, T, L, HV = 64, 192, 180, 2
RESETS = np.array([5, 37, 40, 41, 41, 64, 150, 190], np.int32)   # 41 twice: an empty sequence
F32, BF16 = jnp.float32, jnp.bfloat16


@functools.lru_cache(maxsize=None)
def case(K, strong):
  """(intra's args q, k, v, beta, gc_int, gc_frac; seg). strong: gates down to -3 in chunk 1, so
  gc_int is not 0 there (the two-part kernel, its gc_int shifted)."""
  rng = np.random.default_rng(7 + K + strong)
  layout = padding.make_layout(jnp.array([0], jnp.int32), jnp.array([L], jnp.int32), T, BT)
  valid = np.arange(T) < L
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (unit(rng.standard_normal((1, T, HV, K))) for _ in range(2))
  v = rng.standard_normal((1, T, HV, K))
  g = -0.99 / (1.0 + np.exp(1.0 - rng.standard_normal((1, T, HV, K))))
  if strong:
    g[:, 70:90] = rng.uniform(-3.0, -1.0, (20, HV, K))
  g[:, RESETS[RESETS < L]] = -np.inf
  m = valid[None, :, None, None]
  q, k, v = (jnp.asarray(np.where(m, x, 0.0), BF16) for x in (q, k, v))
  beta = jnp.asarray(np.where(valid[None, :, None], rng.uniform(0.1, 0.9, (1, T, HV)), 0.0), F32)
  gi, gf = _gc(jnp.asarray(g, F32), jnp.asarray(valid)[None])
  seg = pieces.segment_rows(layout, jnp.asarray(RESETS))
  return (q, k, v, beta, gi, gf), seg


def test_segment_rows():
  _, seg = case(64, False)
  n, start = (np.asarray(seg[i]).reshape(-1, BT) for i in (0, 1))
  want_n = np.zeros((3, BT))
  want_n[0] = np.searchsorted([5, 37, 40, 41], np.arange(BT), side="right")
  want_n[1] = 1                                        # a reset at its first row
  want_n[2] = np.arange(BT) >= 150 - 128               # rows past the tokens (52..) take row 51's
  np.testing.assert_array_equal(n, want_n)
  assert list(start[0, [0, 4, 5, 36, 37, 39, 40, 41, 63]]) == [0, 0, 5, 5, 37, 37, 40, 41, 41]
  assert not start[1].any() and list(start[2, [0, 21, 22, 51, 63]]) == [0, 0, 22, 22, 22]


@pytest.mark.parametrize("K,strong", [(64, False), (128, True)])
def test_intra_with_segments_matches_reference_on_the_bounded_path(K, strong):
  args, seg = case(K, strong)
  gi, gf = args[4:]
  assert not np.asarray(mgi.bounded_chunks(gi, gf)).reshape(HV, -1)[:, [0, 2]].any()   # -128 steps inside
  assert np.asarray(mgi.bounded_chunks(mgi.reset_free(gi, seg), gf)).all()         # without them
  assert bool(jnp.any(mgi.reset_free(gi, seg) != 0)) == strong                    # two parts
  f = jax.jit(functools.partial(mgi.apply, scale=K ** -0.5, chunk_size=BT, interpret=True))
  got = f(*args, seg=seg)
  want = ti._reference(K ** -0.5)(*args)
  errs = ti.errors(got, want)
  assert not ti.failures(errs), ti.fmt(errs)


@pytest.mark.parametrize("K,strong", [(64, False), (128, True)])
def test_bwd_intra_with_segments_matches_reference_on_the_bounded_path(K, strong):
  (q, k, _, beta, gi, gf), seg = case(K, strong)
  assert np.all(np.asarray(mgb.bounded_levels(mgi.reset_free(gi, seg), gf)) >= 5)    # one or two levels
  A = (1, T, HV, BT)
  dAqk, dAkk, aq, ak, ag = bwd_setup.randn(51, A, A, q.shape, k.shape, q.shape)
  (ab,) = bwd_setup.randn(52, beta.shape)
  dAqk = bwd_setup.mask_rows(dAqk, BT, strict=False)
  dAkk = bwd_setup.mask_rows(dAkk, BT, strict=True)
  args = (q, k, beta, gi, gf, dAqk, dAkk, aq, ak, ab, ag)
  f = jax.jit(functools.partial(mgb.apply, scale=K ** -0.5, chunk_size=BT, interpret=True))
  got = f(*args, seg=seg)
  want = tb._reference(K ** -0.5)(*args)
  errs = tb.errors(got, want)
  assert not tb.failures(errs), tb.fmt(errs)


def test_bwd_intra_defer_qg_with_segments():
  """defer_qg with seg: exp(gc) of the true gc (the resets' steps put back into gc_int)."""
  (q, k, _, beta, gi, gf), seg = case(128, True)
  A = (1, T, HV, BT)
  dAqk, dAkk, dqg, ak, ag = bwd_setup.randn(53, A, A, q.shape, k.shape, q.shape)
  (ab,) = bwd_setup.randn(54, beta.shape)
  args = (q, k, beta, gi, gf, bwd_setup.mask_rows(dAqk, BT, strict=False), bwd_setup.mask_rows(dAkk, BT, strict=True),
          dqg, ak, ab, ag)
  errs = tb.defer_qg_errors(args, 128 ** -0.5, seg=seg)
  assert all(e[0] < 2e-6 and e[1] < 1e-6 for e in errs.values()), tb.fmt(errs)


def test_kernels_with_segments_lower_for_cuda():
  """The segment-masked scores kernels (one and two parts, packed) and bwd_intra (packed dq, dk)
  lower for CUDA from the CPU."""
  S = jax.ShapeDtypeStruct
  T, Ta, K = 4096, 8192, 128
  x = lambda d, dt=BF16, t=T: S((1, t, HV, d), dt)
  rows = padding.ChunkRows(S((Ta // BT,), jnp.int32), S((Ta // BT,), jnp.int32))
  cu, seg = S((5,), jnp.int32), S((2, Ta), F32)
  fwd = functools.partial(mgi.packed, scale=K ** -0.5, chunk_size=BT, tail_zeros=False)
  txt = jax.jit(fwd).trace(x(K), x(K), x(K), S((1, T, HV), BF16), x(K, F32, Ta), x(K, F32, Ta), cu, rows,
                           seg=seg).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 3   # two scores, solve
  pieces = S((2, T // BT + 4 + 1), jnp.int32)
  bwd = functools.partial(mgb.apply, scale=K ** -0.5, chunk_size=BT, T=T, tail_zeros=False)
  a = S((1, Ta, HV, BT), F32)
  txt = jax.jit(bwd).trace(x(K, BF16, Ta), x(K, BF16, Ta), S((1, Ta, HV), F32), x(K, F32, Ta), x(K, F32, Ta),
                           a, a, x(K, F32, Ta), x(K, F32, Ta), S((1, Ta, HV), F32), x(K, F32, Ta), cu,
                           rows=rows, pieces=pieces, seg=seg).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1


def test_gate_kernels_take_the_resets_as_minus_inf_gates():
  """The packed gate kernel with seg on the plain gates gives the bits it gives on the -inf gates
  (reset_gates), and the stats reset-free; the packed bwd_gate kernel with seg gives dg 0 at the
  resets and elsewhere the bits it gives on the -inf gates."""
  from kda.stages.bwd_gate import mosaic_gpu as mbg
  from kda.stages.gate import mosaic_gpu as mg
  rng = np.random.default_rng(3)
  K = 64
  layout = padding.make_layout(jnp.array([0], jnp.int32), jnp.array([L], jnp.int32), T, BT)
  rows = padding.chunk_rows(layout)
  resets = jnp.asarray(RESETS)
  seg = pieces.segment_rows(layout, resets)
  g = jnp.asarray(-0.99 / (1.0 + np.exp(1.0 - rng.standard_normal((1, T, HV, K)))), F32)
  kw = dict(chunk_size=BT, use_gate_in_kernel=False, lower_bound=None, interpret=True)
  on = mg.packed(g, rows, None, None, seg=seg, **kw)
  off = mg.packed(pieces.reset_gates(g, resets), rows, None, None, **kw)
  for a, b in ((on.gc_int, off.gc_int), (on.gc_frac, off.gc_frac)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not on.two_part.any() and off.two_part.any()
  assert np.asarray(on.bounded).all() and not np.asarray(off.bounded).all()
  gaps = padding.gap_pieces(rows, layout.aligned_cu, T, BT)
  dgc, dgs = (jnp.asarray(rng.standard_normal((1, T, HV, K)), F32) for _ in range(2))
  d_on = mbg.packed(g, rows, gaps, None, None, dgc, dgs, seg=seg, **kw).dg
  d_off = mbg.packed(pieces.reset_gates(g, resets), rows, gaps, None, None, dgc, dgs, **kw).dg
  np.testing.assert_array_equal(np.asarray(d_on), np.asarray(d_off))
  at = RESETS[RESETS < L]
  assert not np.asarray(d_on)[0, at].any() and np.asarray(d_on)[0, np.setdiff1d(at + 1, at)].all()


def test_gate_kernels_with_resets_lower_for_cuda():
  from kda.stages.bwd_gate import mosaic_gpu as mbg
  from kda.stages.gate import mosaic_gpu as mg
  S = jax.ShapeDtypeStruct
  T, Ta, K = 4096, 8192, 128
  rows = padding.ChunkRows(S((Ta // BT,), jnp.int32), S((Ta // BT,), jnp.int32))
  seg, g, gc = S((2, Ta), F32), S((1, T, HV, K), F32), S((1, Ta, HV, K), F32)
  kw = dict(chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
  count = lambda txt: sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines())
  fwd = lambda g, rows, seg: mg.packed(g, rows, None, None, seg=seg, tail_zeros=False, **kw)
  assert count(jax.jit(fwd).trace(g, rows, seg).lower(lowering_platforms=("cuda",)).as_text()) == 1
  bwd = lambda g, rows, pieces, dgc, dgs, seg: mbg.packed(g, rows, pieces, None, None, dgc, dgs, seg=seg, **kw)
  pieces = S((2, T // BT + 4 + 1), jnp.int32)
  assert count(jax.jit(bwd).trace(g, rows, pieces, gc, gc, seg).lower(lowering_platforms=("cuda",)).as_text()) == 1
