"""bwd_recompute (S0) on Mosaic GPU: the forward's gate and state kernels run again around the wy
kernel, which forms w, u, qg, kg from the saved bf16 Ainv (simulator on CPU, CUDA lowering), against
the reference S0 on the same bf16 inputs and Ainv.

The kernels store w, u, qg, kg, h, v_new in bf16 (the dtype policy), so the comparison has the
forward kernels' tolerances: their bf16 stores (up to 2^-8 of each value) and operand roundings;
gc is float32 (the gate kernel's sequential sum, ~1e-6 apart from the reference's tree)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda import plan as planning
from kda import steps
from kda.stages import bwd_recompute, gate, intra
from kda.stages.bwd_recompute import mosaic_gpu as mgr
from tests import cases
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
# max|d| / max|ref| per field, over 2x the maxima measured over the four cases (default and large):
# gc_frac 3.5e-7, w 2.6e-3, u 2.7e-3, qg 2.7e-3, kg 1.7e-3, h 2.1e-3, v_new 4.4e-3
TOL = {"gc_int": 0.0, "gc_frac": 1e-6,
       "w": 6e-3, "u": 1.1e-2, "qg": 6e-3, "kg": 4e-3, "h": 5e-3, "v_new": 1.2e-2}


def _inputs(K, V, gate_kind, HV=2):
  inp = cases.make_inputs(3, lens=[30, 64, 0, 65, 1], H=HV, HV=HV, K=K, V=V, gate=gate_kind, extra_T=5)
  layout = padding.layout_from_cu_seqlens(inp.cu_seqlens, inp.q.shape[1], BT)
  raw = gate_kind == "raw"
  plan = planning.make_plan(scale=K ** -0.5, chunk_size=BT, use_gate_in_kernel=raw, impl="reference")
  bf = lambda x: x.astype(jnp.bfloat16)
  q, k, v, g, beta, valid = steps.prepare(plan, layout, bf(inp.q), bf(inp.k), bf(inp.v), inp.g, inp.beta)
  return plan, layout, (q, k, v, g, beta, valid, inp.A_log, inp.dt_bias, inp.initial_state)


def _saved_inverse(q, k, v, g, beta, valid, A_log, dt_bias, kw):
  """Ainv as the forward's intra kernel saves it (bf16), from the references' gc."""
  f32 = lambda x: x.astype(jnp.float32)
  gt = gate.reference.apply(g, valid, A_log, dt_bias, chunk_size=BT, use_gate_in_kernel=kw["use_gate_in_kernel"],
                            lower_bound=kw["lower_bound"])
  return intra.reference.apply(f32(q), f32(k), f32(v), beta, gt.gc_int, gt.gc_frac, scale=1.0,
                               chunk_size=BT).Ainv.astype(jnp.bfloat16)


@pytest.mark.parametrize("K,V,gate_kind", [(64, 64, "raw"), pytest.param(128, 128, "plain", marks=pytest.mark.large),
                                           pytest.param(128, 64, "plain", marks=pytest.mark.large),
                                           pytest.param(64, 128, "raw", marks=pytest.mark.large)])
def test_recompute_kernels_match_reference(K, V, gate_kind):
  """The stage on its kernels against the reference S0 on the same bf16 inputs and bf16-exact Ainv
  (what it computes from); a wrong Ainv (each chunk's transpose) fails the WY fields' tolerance."""
  plan, layout, (q, k, v, g, beta, valid, A_log, dt_bias, h0) = _inputs(K, V, gate_kind)
  kw = plan.stage_kwargs("bwd_recompute")
  f32 = lambda x: x.astype(jnp.float32)
  Ainv = _saved_inverse(q, k, v, g, beta, valid, A_log, dt_bias, kw)
  args = (q, k, v, g, beta, valid, A_log, dt_bias, Ainv, h0, layout.aligned_cu)
  want = jax.jit(functools.partial(bwd_recompute.reference.apply, **kw))(
      f32(q), f32(k), f32(v), *args[3:8], f32(Ainv), *args[9:])
  got = jax.jit(functools.partial(mgr.apply, interpret=True, **kw))(*args)
  _compare(got, want, valid, TOL)
  assert all(getattr(got, n).dtype == jnp.bfloat16 for n in ("w", "u", "qg", "kg", "v_new"))
  bad = jax.jit(functools.partial(mgr.wy_from_saved, interpret=True))(
      q, k, v, beta, got.gc_int, got.gc_frac, bwd_setup_transpose(Ainv))
  assert float(jnp.max(jnp.abs(f32(bad[0]) - f32(got.w)))) > 3 * TOL["w"] * float(jnp.max(jnp.abs(f32(got.w))))


def test_narrow_heads_take_the_xla_gate():
  """HV * K = 64 (one head of 64 columns): the gate kernel refuses (one thread per column, groups
  of 128), so gc comes from the XLA gate and the wy and state kernels still run: the stage takes
  the call, matches the reference S0 and lowers to two Mosaic GPU kernels."""
  plan, layout, (q, k, v, g, beta, valid, A_log, dt_bias, h0) = _inputs(64, 64, "raw", HV=1)
  kw = plan.stage_kwargs("bwd_recompute")
  assert "multiple of 128" in gate.mosaic_gpu.supports(g, valid, A_log, dt_bias, **{
      n: kw[n] for n in ("chunk_size", "use_gate_in_kernel", "lower_bound")})
  assert mgr.supports(q, k, v, g, beta, valid, A_log, dt_bias, None, h0, layout.aligned_cu, **kw) is None
  f32 = lambda x: x.astype(jnp.float32)
  Ainv = _saved_inverse(q, k, v, g, beta, valid, A_log, dt_bias, kw)
  args = (q, k, v, g, beta, valid, A_log, dt_bias, Ainv, h0, layout.aligned_cu)
  want = jax.jit(functools.partial(bwd_recompute.reference.apply, **kw))(
      f32(q), f32(k), f32(v), *args[3:8], f32(Ainv), *args[9:])
  got = jax.jit(functools.partial(mgr.apply, interpret=True, **kw))(*args)
  _compare(got, want, valid, TOL)
  txt = jax.jit(functools.partial(mgr.apply, **kw)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 2


def _compare(got, want, valid, tol):
  """max|d| / max|ref| per field within tol; the bf16 token fields exactly 0 at padding tokens."""
  pad = ~np.asarray(valid[0])
  for name in bwd_recompute.Out._fields:
    a, b = (np.asarray(jnp.asarray(getattr(x, name), jnp.float32)) for x in (got, want))
    assert a.shape == b.shape, name
    err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if np.abs(b).max() else float(np.abs(a).max())
    print(f"  {name}: {err:.2e}")
    assert err <= tol[name], (name, err)
    if name in ("w", "u", "qg", "kg", "v_new"):
      assert np.all(a[0, pad] == 0), f"{name} is not 0 at padding tokens"


def test_supports():
  """`supports`, the stage's predicate: the gate, wy and state kernels' conjunction (bf16 q, k, v,
  chunk_size 64, K and V in {64, 128}); Ainv may be None (the pipeline asks before the forward ran)."""
  plan, layout, (q, k, v, g, beta, valid, A_log, dt_bias, h0) = _inputs(64, 64, "raw")
  kw = plan.stage_kwargs("bwd_recompute")
  f32 = lambda x: x.astype(jnp.float32)
  assert bwd_recompute.STAGE.mosaic_gpu is mgr
  assert mgr.supports(q, k, v, g, beta, valid, A_log, dt_bias, None, h0, layout.aligned_cu, **kw) is None
  assert mgr.supports(q, k, v, g, beta, valid, A_log, dt_bias, None, h0, layout.aligned_cu, config=mgr.Config(),
                      **kw) is None
  why = mgr.supports(f32(q), f32(k), f32(v), g, beta, valid, A_log, dt_bias, None, h0, layout.aligned_cu, **kw)
  assert "takes bfloat16 q, k, v, got q float32" in why
  why = mgr.supports(q, k, v, g, beta, valid, A_log, dt_bias, None, h0, layout.aligned_cu, **dict(kw, chunk_size=32))
  assert why is not None and "chunk_size" in why
  S = jax.ShapeDtypeStruct
  Ta = q.shape[1]
  wide = lambda x: S(x.shape[:3] + (256,), x.dtype)                   # K = 256: the stage's jnp reference runs
  why = mgr.supports(wide(q), wide(k), v, wide(g), beta, valid, A_log, S((2 * 256,), jnp.float32), None,
                     S((h0.shape[0], 2, 256, 64), jnp.float32), layout.aligned_cu, **kw)
  assert "K must be one of (64, 128), got 256" in why
  assert "Ainv must have shape" in mgr.supports(q, k, v, g, beta, valid, A_log, dt_bias, S((1, Ta, 2, 32), jnp.bfloat16),
                                                h0, layout.aligned_cu, **kw)
  with pytest.raises(ValueError, match="Ainv .* is required"):
    mgr.apply(q, k, v, g, beta, valid, A_log, dt_bias, None, h0, layout.aligned_cu, **kw)


def test_recompute_lowers_for_cuda():
  """The stage lowers for CUDA: three Mosaic GPU kernels (gate, wy, state)."""
  S = jax.ShapeDtypeStruct
  Ta, HV, K, V, N = 4096, 2, 128, 128, 3
  bf = jnp.bfloat16
  args = (S((1, Ta, HV, K), bf), S((1, Ta, HV, K), bf), S((1, Ta, HV, V), bf), S((1, Ta, HV, K), jnp.float32),
          S((1, Ta, HV), bf), S((1, Ta), jnp.bool_), None, None, S((1, Ta, HV, BT), bf),
          S((N, HV, K, V), jnp.float32), S((N + 1,), jnp.int32))
  f = lambda *a: mgr.apply(*a, chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 3


def bwd_setup_transpose(A):
  """[1, Ta, HV, BT] row layout -> each chunk's matrix transposed."""
  from tests.stages import bwd_setup
  return bwd_setup.row_layout(jnp.swapaxes(bwd_setup.chunk_mats(A, BT), -1, -2))


def _wy_abstract(Ta, HV=2, K=128, V=128):
  S = jax.ShapeDtypeStruct
  bf, f = jnp.bfloat16, jnp.float32
  return (S((1, Ta, HV, K), bf), S((1, Ta, HV, K), bf), S((1, Ta, HV, V), bf), S((1, Ta, HV), bf),
          S((1, Ta, HV, K), f), S((1, Ta, HV, K), f), S((1, Ta, HV, BT), bf))


@functools.lru_cache(maxsize=None)
def _wy_lowered(config, Ta=70000 * BT, cu=True):
  args = _wy_abstract(Ta) + ((jax.ShapeDtypeStruct((9,), jnp.int32),) if cu else ())
  txt = jax.jit(functools.partial(mgr.wy_from_saved, config=config)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  return txt


def test_wy_from_saved_lowers_for_cuda():
  """The wy kernel lowers for CUDA with 70000 chunks (on grid x), with and without aligned_cu; its
  SMEM as lowered is `smem_bytes` (the predicate's figure) of the launcher's scratch."""
  _wy_lowered(None, cu=False)
  _wy_lowered(None)
  for K, V, want in ((128, 128, 106504), (64, 64, 65544)):
    smem = lowered_smem_bytes(mgr.wy_from_saved, *_wy_abstract(4096, 16, K, V))
    assert smem == want == mgr.smem_bytes(K, V), (K, V, smem)


FLIPPED = {"approx_math": False, "skip_tail": False, "per_slab": True}    # every Config field off its default


@pytest.mark.parametrize("field", sorted(FLIPPED))
def test_wy_config_fields_change_the_program(field):
  """Each Config field flipped from its default gives another lowered wy kernel (CUDA, with aligned_cu)."""
  assert _wy_lowered(mgr.Config(**{field: FLIPPED[field]})) != _wy_lowered(mgr.Config())


def test_wy_skip_tail_reads_nothing_there():
  """wy_from_saved with aligned_cu (Config(skip_tail=True)): the chunk past aligned_cu[-1] stores
  zeros without being read (NaN there changes nothing); zero inputs there, as align leaves them,
  give the same bits without it."""
  from tests.stages import bwd_setup
  Ta, HV, K, V = 192, 1, 64, 64
  tail = (jnp.arange(Ta) >= 128)
  at_tail = lambda x: tail.reshape((1, Ta) + (1,) * (x.ndim - 2))
  q, k, v, A, gi = bwd_setup.randn(3, (1, Ta, HV, K), (1, Ta, HV, K), (1, Ta, HV, V), (1, Ta, HV, BT), (1, Ta, HV, K))
  (b,) = bwd_setup.randn(4, (1, Ta, HV))
  gi = -jnp.abs(gi) * 0.05
  gc = jnp.cumsum(gi.reshape(1, Ta // BT, BT, HV, K), axis=2).reshape(gi.shape)
  A = bwd_setup.mask_rows(A * 0.2, BT, strict=False)
  args = [jnp.where(at_tail(x), 0.0, x) for x in (q, k, v, jax.nn.sigmoid(b), gc, jnp.zeros_like(gc), A)]
  args = [x.astype(jnp.bfloat16) if i in (0, 1, 2, 3, 6) else x for i, x in enumerate(args)]
  acu = jnp.asarray([0, 64, 128], jnp.int32)
  plain = jax.block_until_ready(jax.jit(functools.partial(mgr.wy_from_saved, interpret=True))(*args))
  bad = [jnp.where(at_tail(x), jnp.nan, x).astype(x.dtype) for x in args]
  skip = jax.block_until_ready(jax.jit(functools.partial(mgr.wy_from_saved, interpret=True))(*bad, acu))
  for name, x, y in zip(("w", "u", "qg", "kg"), skip, plain):
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), name)
  assert float(jnp.max(jnp.abs(plain[0].astype(jnp.float32)))) > 0
  assert not np.asarray(plain[0].astype(jnp.float32))[:, 128:].any()
  # every Config field off its default (the tail computed from its zeros, exp without ex2.approx):
  # the reference's formulas, to the bf16 stores
  flipped = jax.jit(functools.partial(mgr.wy_from_saved, interpret=True, config=mgr.Config(**FLIPPED)))(*args, acu)
  want = bwd_recompute.reference.wy_from_inverse(*args, chunk_size=BT)
  for name, x, y in zip(("w", "u", "qg", "kg"), flipped, want):
    x, y = np.asarray(x.astype(jnp.float32)), np.asarray(y)
    assert np.abs(x - y).max() <= 8e-3 * np.abs(y).max(), name


def test_wy_probe_marks_every_non_finite_input():
  """wy_from_saved(probe=True): 0 at every row for finite inputs; a NaN or inf in q, k, v, beta or
  gc at one token makes the probe non-zero inside that token's chunk only; the tail (with
  aligned_cu, left unwritten or not) reads 0 whatever it holds; the outputs are those without it."""
  from tests.stages import bwd_setup
  Ta, HV, K, V = 256, 2, 64, 64
  tail = (jnp.arange(Ta) >= 192)
  at_tail = lambda x: tail.reshape((1, Ta) + (1,) * (x.ndim - 2))
  q, k, v, A, gi = bwd_setup.randn(5, (1, Ta, HV, K), (1, Ta, HV, K), (1, Ta, HV, V), (1, Ta, HV, BT), (1, Ta, HV, K))
  (b,) = bwd_setup.randn(6, (1, Ta, HV))
  gc = jnp.cumsum((-jnp.abs(gi) * 0.05).reshape(1, Ta // BT, BT, HV, K), axis=2).reshape(gi.shape)
  A = bwd_setup.mask_rows(A * 0.2, BT, strict=False)
  args = [jnp.where(at_tail(x), 0.0, x) for x in (q, k, v, jax.nn.sigmoid(b), gc, jnp.zeros_like(gc), A)]
  args = [x.astype(jnp.bfloat16) if i in (0, 1, 2, 3, 6) else x for i, x in enumerate(args)]
  acu = jnp.asarray([0, 64, 100 + 28, 192], jnp.int32)
  run = lambda *a, **kw: jax.block_until_ready(jax.jit(functools.partial(mgr.wy_from_saved, interpret=True, probe=True,
                                                                         **kw))(*a))
  plain = jax.jit(functools.partial(mgr.wy_from_saved, interpret=True))(*args, acu)
  got = run(*args, acu)
  assert got[4].shape == (HV, Ta) and not np.asarray(got[4]).any()
  for x, y in zip(got[:4], plain):
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
  t, head = 150, 1                 # chunk 2
  for i, name in enumerate(("q", "k", "v", "beta", "gc_int")):
    for bad in (jnp.nan, jnp.inf):
      x = args[i]
      at = (0, t, head) if x.ndim == 3 else (0, t, head, 3)
      hit = list(args)
      hit[i] = x.at[at].set(bad)
      p = np.asarray(run(*hit, acu)[4])
      assert not np.isfinite(p[head, t]), (name, bad)
      assert not p[:, :128].any() and not p[:, 192:].any() and not p[1 - head].any(), (name, bad)
  nan_tail = [jnp.where(at_tail(x), jnp.nan, x).astype(x.dtype) for x in args]
  for tz in (True, False):
    assert not np.asarray(run(*nan_tail, acu, tail_zeros=tz)[4]).any(), tz


def _packed_wy_inputs(seed, K, V, gf_scale=0.0):
  """A packed layout (lengths 30, 64, 0, 65, 1; a 3- and a 70-token gap, 5 tokens after the last, a
  tail chunk), HV = 2, and wy_from_saved's inputs on it: (layout, packed q, k, v with NaN at tokens
  of no sequence, their aligned copies, the other arguments with gc_frac = gf_scale * noise)."""
  from tests.stages import bwd_setup
  from tests.stages.test_gate_mosaic import packed_layout
  layout, valid = packed_layout([30, 64, 0, 65, 1], [3, 70, 0, 0, 0], extra_T=5, tail_chunks=1)
  Ta, HV = layout.Ta, 2
  at_pad = lambda x: ~jnp.asarray(valid).reshape((1, Ta) + (1,) * (x.ndim - 2))
  q, k, v, A, gi = bwd_setup.randn(seed, (1, Ta, HV, K), (1, Ta, HV, K), (1, Ta, HV, V), (1, Ta, HV, BT),
                                   (1, Ta, HV, K))
  (b,) = bwd_setup.randn(seed + 1, (1, Ta, HV))
  gc = jnp.cumsum((-jnp.abs(gi) * 0.05).reshape(1, Ta // BT, BT, HV, K), axis=2).reshape(gi.shape)
  A = bwd_setup.mask_rows(A * 0.2, BT, strict=False).astype(jnp.bfloat16)
  beta = jnp.where(at_pad(b), 0.0, jax.nn.sigmoid(b)).astype(jnp.bfloat16)
  packed, aligned = bwd_setup.packed_and_aligned(layout, [jnp.where(at_pad(x), 0.0, x) for x in (q, k, v)])
  return layout, packed, aligned, (beta, gc, gf_scale * gi, A, layout.aligned_cu)


@pytest.mark.parametrize("K,V", [(64, 128), pytest.param(128, 64, marks=pytest.mark.large)])
def test_wy_packed_qkv_equals_aligned(K, V):
  """rows given: q, k, v read from the packed arrays (NaN at tokens of no sequence: a 3- and a
  70-token gap, 5 tokens after the last) give w, u, qg, kg and the probe bit for bit the call on
  their aligned copies, the tail unwritten or not; a NaN in one sequence's v marks the probe in its
  chunks only, as on the aligned copy. Lowered for CUDA: one kernel, the aligned call's SMEM."""
  layout, packed, aligned, rest = _packed_wy_inputs(7, K, V)
  rows = padding.chunk_rows(layout)
  run = lambda qkv, **kw: jax.block_until_ready(jax.jit(functools.partial(
      mgr.wy_from_saved, interpret=True, probe=True, **kw))(*qkv, *rest))
  for tz in (True, False):
    want, got = run(aligned, tail_zeros=tz), run(packed, tail_zeros=tz, rows=rows)
    live = slice(None) if tz else slice(0, int(layout.aligned_cu[-1]))
    for name, x, y in zip(("w", "u", "qg", "kg", "probe"), got, want):
      x, y = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (x, y))
      np.testing.assert_array_equal(x[..., live, :, :] if x.ndim == 4 else x[:, live],
                                    y[..., live, :, :] if y.ndim == 4 else y[:, live], name)
    assert float(np.abs(np.asarray(want[1], np.float32)[:, live]).max()) > 0
  t = int(layout.starts[3]) + 10                              # a token of the fourth sequence
  bad_v = packed[2].at[0, t, 1, 0].set(jnp.nan)
  p = np.asarray(run(packed[:2] + [bad_v], rows=rows)[4])
  owned = padding.packed_owned_mask(layout)[None, :, None, None]
  want = np.asarray(run(aligned[:2] + [padding.align_with(layout, jnp.where(owned, bad_v, 0))])[4])
  np.testing.assert_array_equal(p, want)
  assert (~np.isfinite(p)).sum() == BT and not np.isfinite(p[1]).all()    # one chunk of head 1
  S = jax.ShapeDtypeStruct
  spec = [S(x.shape, x.dtype) for x in packed] + [S(x.shape, x.dtype) for x in rest]
  f = functools.partial(mgr.wy_from_saved, rows=rows)
  txt = jax.jit(f).trace(*spec).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  assert lowered_smem_bytes(f, *spec) == mgr.smem_bytes(K, V, packed_qkv=True) == mgr.smem_bytes(K, V)


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), pytest.param(128, 64, marks=pytest.mark.large)])
def test_wy_per_slab_gives_the_same_bits(K, V):
  """Config(per_slab=True), one program per 64-column slab, schedules the same arithmetic: w, u, qg,
  kg and the probe bit for bit the default's, aligned (a NaN in v marks its chunk's rows) and with
  packed q, k, v (tail unwritten); its SMEM as lowered is `smem_bytes(per_slab=True)`, 6 tiles."""
  layout, packed, aligned, rest = _packed_wy_inputs(11, K, V, gf_scale=0.01)
  aligned[2] = aligned[2].at[0, int(layout.starts[3]) + 10, 1, 0].set(jnp.nan)
  run = lambda qkv, per_slab, **kw: jax.block_until_ready(jax.jit(functools.partial(
      mgr.wy_from_saved, interpret=True, probe=True, config=mgr.Config(per_slab=per_slab), **kw))(*qkv, *rest))
  live = int(layout.aligned_cu[-1])
  for qkv, kw in ((aligned, {}), (packed, dict(rows=padding.chunk_rows(layout), tail_zeros=False))):
    want, got = run(qkv, False, **kw), run(qkv, True, **kw)
    for name, x, y in zip(("w", "u", "qg", "kg", "probe"), got, want):
      x, y = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (x, y))
      np.testing.assert_array_equal(x[:, :live], y[:, :live], name)     # tokens before the tail
    assert float(np.abs(np.asarray(want[0], np.float32)[:, :live]).max()) > 0
  assert (~np.isfinite(np.asarray(run(aligned, True)[4]))).sum() == BT      # the NaN's chunk, head 1
  spec = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*aligned, *rest)]
  f = functools.partial(mgr.wy_from_saved, config=mgr.Config(per_slab=True))
  assert lowered_smem_bytes(f, *spec) == mgr.smem_bytes(K, V, per_slab=True) == 6 * 8192 + 8
