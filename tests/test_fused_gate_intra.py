"""kda.fused.gate_intra (the gate stage's chunk cumsum inside intra's Mosaic GPU scores kernel):
simulator runs on CPU and CUDA lowering.

The fused call replaces kda.stages.gate.mosaic_gpu.packed -> kda.stages.intra.mosaic_gpu.packed and
kda.stages.state.chunk_decay, so it must give their bits on every chunk a sequence owns (with
tail_zeros=False, the pipeline's setting, the tail is left unwritten: NaN in the simulator). The one-part
fused kernel keeps every bounded chunk (kda.stages.gate.mosaic_gpu.bounded_chunks), gc as one
float32 sum of its two parts: gc_frac itself while every gate is above -1 ("f32", "bf16", "mixed":
the unfused kernels' bits), gc_int + gc_frac where gates reach -1 ("moderate": one rounding
more, so close to the unfused kernels, not their bits); the persistent two-part kernel redoes the
chunks that are not bounded ("strong") in place, with the unfused kernels' bits. Against the
members' references the tolerances are intra's (tests/stages/test_intra_mosaic.py).

Inputs (_case): packed bf16 q, k (l2-normalised), v, float32 beta, sequences of 37, 0, 64, 65, 1
tokens (boundaries 1/63/64/65, an empty sequence) and NaN in every input, g included, at the
tokens after the last one. cu_seqlens is a jit argument: the layout is the static bound, with tail
chunks past aligned_cu[-1].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.fused.packed_forward import gate_intra as fgi
from kda.stages import gate, intra
from kda.stages.gate import mosaic_gpu as mgg
from kda.stages.intra import mosaic_gpu as mgi
from kda.stages.state import chunk_decay
from tests.stages.test_intra_mosaic import EXACT, SMEM_ONE_CTA, SMEM_TWO_CTAS, _scores_smem, errors, failures, fmt
from tests.stages.test_output_mosaic import lowered_smem_bytes

BT = 64
F32, BF16 = jnp.float32, jnp.bfloat16
LENS, T, HV, K, V = (37, 0, 64, 65, 1), 200, 1, 128, 64
SCALE = K ** -0.5
# log_sigmoid(normal) * s; "mixed": the f32 gates with six tokens of one chunk at -3 (gc_int is not 0
# in that chunk alone, which stays bounded); "moderate": -2 a token on average, bounded chunks that
# need gc_int; "strong": -32 a token, no chunk of more than one token bounded; "one_strong": the f32
# gates with six tokens of one chunk at -40 (that chunk alone not bounded)
GATES = {"f32": (0.25, F32), "bf16": (0.25, BF16), "strong": (40.0, F32), "mixed": (0.25, F32),
         "moderate": (2.5, F32), "one_strong": (0.25, F32)}
KW = dict(scale=SCALE, chunk_size=BT, interpret=True, tail_zeros=False)


@functools.lru_cache(maxsize=None)
def _case(gates):
  """(q, k, v, beta, g, cu_seqlens): NaN at the tokens no sequence owns."""
  s, dtype = GATES[gates]
  ks = jax.random.split(jax.random.key(3), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(jax.random.normal(ks[0], (1, T, HV, K))), unit(jax.random.normal(ks[1], (1, T, HV, K)))
  v = jax.random.normal(ks[2], (1, T, HV, V))
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (1, T, HV)))
  g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (1, T, HV, K))) * s
  if gates in ("mixed", "one_strong"):
    g = g.at[:, 110:116, :, :5].set(-3.0 if gates == "mixed" else -40.0)    # sequence 4's second chunk
  cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
  none = (jnp.arange(T) >= cu[-1])[None, :, None]
  q, k, v = (jnp.where(none[..., None], jnp.nan, x).astype(BF16) for x in (q, k, v))
  beta = jnp.where(none, jnp.nan, beta)
  g = jnp.where(none[..., None], jnp.nan, g).astype(dtype)
  return q, k, v, beta, g, jnp.asarray(cu)


def _layout(cu):
  layout = padding.layout_from_cu_seqlens(cu, T, BT)      # traced cu: the static bound
  return layout, padding.chunk_rows(layout)


@jax.jit
def _fused(q, k, v, beta, g, cu):
  layout, rows = _layout(cu)
  out, decay = fgi.apply(q, k, v, beta, g, layout.aligned_cu, rows, **KW)
  return out, decay, layout.aligned_cu


@jax.jit
def _unfused(q, k, v, beta, g, cu):
  layout, rows = _layout(cu)
  gi, gf, bounded, two_part = mgg.packed(g, rows, None, None, chunk_size=BT, use_gate_in_kernel=False,
                                         lower_bound=None, interpret=True, tail_zeros=False)
  out = mgi.packed(q, k, v, beta, gi, gf, layout.aligned_cu, rows, bounded=bounded, two_part=two_part, **KW)
  return out, chunk_decay(gi, gf, BT)


def _ref_gc(g, layout):
  """The gate reference on the aligned gates: its Out (gc_int, gc_frac)."""
  return gate.reference.apply(padding.align_with(layout, g), padding.valid_mask(layout)[None], None, None,
                              chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)


@jax.jit
def _references(q, k, v, beta, g, cu):
  layout, _ = _layout(cu)
  al = lambda x: padding.align_with(layout, x)
  gc = _ref_gc(g, layout)
  out = intra.reference.apply(al(q), al(k), al(v), al(beta), gc.gc_int, gc.gc_frac, layout.aligned_cu,
                              scale=SCALE, chunk_size=BT)
  return out, gc.gc_int + gc.gc_frac


@functools.lru_cache(maxsize=None)
def _run_fused(gates):
  """(Out, decay, owned tokens = aligned_cu[-1]): the simulator runs each gate case once."""
  out, decay, acu = jax.block_until_ready(_fused(*_case(gates)))
  return out, decay, int(acu[-1])


def _bits(x):
  x = np.asarray(x)
  return x.view(f"u{x.dtype.itemsize}")     # bit for bit: -0.0 != 0.0, NaN payloads count


@pytest.mark.parametrize("gates", ["f32", "bf16", "strong", "mixed", "one_strong"])
def test_fused_equals_unfused_kernels(gates):
  """Every Out field and decay on the owned chunks: bit for bit the unfused kernels', finite (the
  NaN tokens never leak in); at the tail decay is exp(0) = 1 (both scores kernels zero its gc rows).
  Strong gates take the two-part kernel's results: the one-part ones round gc differently, so they
  would not give the unfused kernels' bits there (one_strong: on its one chunk); mixed ones take them
  on one chunk only (the unfused scores kernel runs two parts on every chunk: on the others the same
  bits, gc_int being 0)."""
  q, k, v, beta, g, cu = _case(gates)
  real = np.asarray(g.astype(F32))[:, :int(cu[-1])]
  assert np.isfinite(real).all()
  if gates != "f32" and gates != "bf16":                                    # the path the name says
    assert (real <= -1).any() and ((real > -1).mean() > 0.9) == (gates != "strong")
  if gates == "one_strong":                                                 # one chunk to redo
    layout, _ = _layout(cu)
    ref = _ref_gc(g, layout)
    owned_chunks = int(layout.aligned_cu[-1]) // BT
    assert int(np.sum(np.asarray(mgi.bounded_chunks(ref.gc_int, ref.gc_frac))[:owned_chunks] == 0)) == 1
  if gates in ("f32", "bf16"):
    assert (real > -1).all()
  out, decay, owned = _run_fused(gates)
  want, want_decay = _unfused(q, k, v, beta, g, cu)
  assert 0 < owned < out.Aqk.shape[1] and owned == sum(-(-n // BT) for n in LENS) * BT
  for name in intra.Out._fields:
    a, b = (getattr(o, name)[:, :owned] for o in (out, want))
    assert a.dtype == b.dtype == BF16 and a.shape == b.shape, name
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert np.array_equal(_bits(a), _bits(b)), f"{name}: {int(np.sum(_bits(a) != _bits(b)))} elements differ"
  n = owned // BT
  assert decay.dtype == F32 and decay.shape == want_decay.shape == (out.Aqk.shape[1] // BT, HV, K)
  assert np.isfinite(decay[:n]).all() and np.array_equal(_bits(decay[:n]), _bits(want_decay[:n])), "decay"
  assert (np.asarray(decay[n:]) == 1).all(), "the tail's decay"


@pytest.mark.parametrize("gates", ["f32", "moderate"])
def test_fused_matches_member_references(gates):
  """float32 gates: the fused group against the gate reference followed by the intra reference on
  the aligned inputs, on the owned chunks. The kernel's row scan and XLA's cumsum round differently
  (gc differs by up to 6.7e-6 here on "f32", a few ulp of |gc| <= 16), so: intra's TOL; qg, kg
  within one bf16 ulp of the reference (a few entries round the other way); decay within 2e-5 of
  exp of the reference gc's last row per chunk (measured 5.7e-6: the gc difference, relative).
  "moderate" takes the one-part kernel's gc_int + gc_frac on chunks that need gc_int."""
  out, decay, owned = _run_fused(gates)
  want, gc = _references(*_case(gates))
  own = lambda o: intra.Out(*(x[:, :owned] for x in o))
  errs = errors(own(out), own(want))
  print(f"\n  fused vs references: {fmt(errs)}")
  assert not failures({n: e for n, e in errs.items() if n not in EXACT}), fmt(errs)
  for name in EXACT:
    a, b = (np.asarray(jnp.asarray(getattr(o, name)[:, :owned], F32)) for o in (out, want))
    assert np.all(np.abs(a - b) <= 2 ** -8 * np.abs(b)), name
  n = owned // BT
  last = np.asarray(gc, np.float32)[0, BT - 1:owned:BT]        # [n, HV, K]
  # the kernel flushes subnormal results to 0 ("moderate" chunks decay to ~1e-39 in some channels)
  np.testing.assert_allclose(np.asarray(decay[:n]), np.exp(last), rtol=2e-5, atol=np.finfo(np.float32).tiny)


def test_one_part_keeps_the_bounded_chunks():
  """The one-part kernel's per-column flags (1.0: the chunk is not bounded) on the owned chunks
  are bounded_chunks' verdict on the aligned gc: none on "moderate" (whose gates reach -1 in every
  chunk of more than one token), every chunk of more than one token on "strong"."""
  for gates in ("moderate", "strong"):
    q, k, v, beta, g, cu = _case(gates)
    layout, rows = _layout(cu)
    beta_t, rows_t = mgi.packed_beta_rows(beta, rows)
    NTa = rows.src.shape[0]
    *_, nz = jax.jit(lambda q, k, b, g, acu, rows: mgi.scores.launch(
        acu.astype(jnp.int32), rows, q[0].astype(BF16), k[0].astype(BF16), b, (g[0],), None, Ta=NTa * BT,
        scale=SCALE, bounded=True, approx_math=True, interpret=True, tail_zeros=False))(
            q, k, beta_t, g, layout.aligned_cu, rows_t)
    owned = int(layout.aligned_cu[-1]) // BT
    flagged = np.asarray(nz[:owned]).any(axis=-1)[:, 0]           # [owned chunks], HV = 1
    ref = _ref_gc(g, layout)
    bounded = np.asarray(mgi.bounded_chunks(ref.gc_int, ref.gc_frac))[:owned]
    assert set(np.unique(np.asarray(nz[:owned]))) <= {0.0, 1.0}
    np.testing.assert_array_equal(flagged, bounded == 0, err_msg=gates)
    multi = np.array([min(BT, n - BT * j) > 1 for n in LENS for j in range(-(-n // BT))])
    assert (flagged == (multi if gates == "strong" else False)).all(), (gates, flagged)
    real = np.asarray(padding.align_with(layout, g))[0, :owned * BT].reshape(owned, BT, -1)
    if gates == "moderate":
      assert all((real[j] <= -1).any() for j in range(owned) if multi[j])


def test_supports():
  """supports refuses what the fused kernel cannot run (activated gates, K = 64 or 256, a g unlike k,
  float16 g), naming the problem, and accepts the packed forward's K = 128 call."""
  S = jax.ShapeDtypeStruct
  NTa, T_ = 16, 1000
  rows = padding.ChunkRows(S((NTa,), jnp.int32), S((NTa,), jnp.int32))

  def args(K=128, g_shape=None, g_dtype=F32):
    x = S((1, T_, 2, K), BF16)
    return (x, x, S((1, T_, 2, 64), BF16), S((1, T_, 2), F32), S(g_shape or x.shape, g_dtype), S((4,), jnp.int32),
            rows)

  supports = lambda a, gate_in_kernel=False: fgi.supports(*a, scale=SCALE, chunk_size=BT,
                                                          use_gate_in_kernel=gate_in_kernel)
  assert supports(args()) is None and supports(args(g_dtype=BF16)) is None
  refused = {
      "use_gate_in_kernel=False": supports(args(), gate_in_kernel=True),
      "K = 128": supports(args(K=64)),
      "got k of shape (1, 1000, 2, 256)": supports(args(K=256)),
      "g must have k's shape": supports(args(g_shape=(1, T_, 1, 128))),
      "float16": supports(args(g_dtype=jnp.float16)),
  }
  for reason, why in refused.items():
    assert why is not None and reason in why, (reason, why)
  with pytest.raises(ValueError, match="mosaic_gpu gate_intra kernel: .*float16"):
    fgi.apply(*args(g_dtype=jnp.float16), scale=SCALE, chunk_size=BT)


@pytest.mark.parametrize("g_dtype", [F32, BF16], ids=["f32", "bf16"])
def test_fused_kernels_lower_for_cuda(g_dtype):
  """The fused group lowers for CUDA from the CPU: three Mosaic GPU kernels (the one-part fused
  scores kernel, the persistent two-part one, the solve) and no conditional (a conditional's results
  are copied). The one-part kernel asks for the one-part scores kernel's SMEM (bf16 gates land in the
  q, k landing zone's union, float32 ones in gc's tile): two CTAs per SM; the two-part one fits one.
  The figures are scores.smem_bytes' (the predicate's)."""
  S, T_, HV_, NTa = jax.ShapeDtypeStruct, 4000, 2, 128
  rows = padding.ChunkRows(S((NTa,), jnp.int32), S((NTa,), jnp.int32))
  args = (S((1, T_, HV_, 128), BF16), S((1, T_, HV_, 128), BF16), S((1, T_, HV_, 128), BF16), S((1, T_, HV_), F32),
          S((1, T_, HV_, 128), g_dtype), S((5,), jnp.int32), rows)
  f = functools.partial(fgi.apply, scale=SCALE, chunk_size=BT, tail_zeros=False)
  txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("stablehlo.custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 3
  assert "stablehlo.case" not in txt and "stablehlo.if" not in txt
  Ta, HV_s, T_s = 4096, 16, 3000
  kw = dict(scale=SCALE, bounded=True, approx_math=True, interpret=False, Ta=Ta, tail_zeros=False)
  sc = lambda cu, r0, r1, q, k, beta_t, g: mgi.scores.launch(cu, (r0, r1), q, k, beta_t, (g,), None, **kw)
  r = S((Ta // BT,), jnp.int32)
  smem = lowered_smem_bytes(sc, S((3,), jnp.int32), r, r, S((T_s, HV_s, 128), BF16), S((T_s, HV_s, 128), BF16),
                            S((HV_s, T_s + BT), F32), S((T_s, HV_s, 128), g_dtype))
  strong = lambda cu, p, redo, *a: mgi.scores.launch(cu, a[:2], *a[2:5], (a[5],), None, pred=(p, redo), **kw)
  smem2 = lowered_smem_bytes(strong, S((3,), jnp.int32), S((1,), jnp.int32), S((HV_s * Ta // BT,), jnp.int32),
                             r, r, S((T_s, HV_s, 128), BF16),
                             S((T_s, HV_s, 128), BF16), S((HV_s, T_s + BT), F32), S((T_s, HV_s, 128), g_dtype))
  print(f"\n  fused scores kernels ({jnp.dtype(g_dtype).name} gates): SMEM {smem} / {smem2} bytes")
  bf16_gates = g_dtype == BF16
  assert smem == _scores_smem(128, 1) == mgi.scores.smem_bytes(128, two_part=False, packed=True, gated=True,
                                                               bf16_gates=bf16_gates) <= SMEM_TWO_CTAS
  assert smem2 == mgi.scores.smem_bytes(128, two_part=True, packed=True, gated=True, bf16_gates=bf16_gates)
  assert smem2 <= SMEM_ONE_CTA and fgi.smem_bytes(128, 64, g_dtype) == smem2


def test_pipeline_runs_the_group_where_switched_on(monkeypatch):
  """chunk_kda (impl="mosaic_gpu", simulator, traced cu_seqlens) with the packed forward's
  Config.fuse_gate_intra on runs the group (log-space gates, K = 128) and gives o and the final states bit for bit as with
  it off (the unfused gate and intra kernels), NaN at the unowned tokens never leaking."""
  import kda
  q, k, v, beta, g, cu = _case("f32")
  calls = []
  real = fgi.apply
  monkeypatch.setattr(fgi, "apply", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  from kda.fused.packed_forward import mosaic_gpu as pf
  run = lambda fuse: jax.jit(
      lambda q, k, v, g, beta, cu: kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True,
                                                  impl="mosaic_gpu",
                                                  config={"packed_forward": pf.Config(fuse_gate_intra=fuse)}))(
                                                      q, k, v, g, beta, cu)
  (o, ht), n_on = run(True), len(calls)
  o_off, ht_off = run(False)
  assert n_on == 1 and len(calls) == 1
  end = int(cu[-1])
  assert np.isfinite(np.asarray(o, np.float32)).all() and (np.asarray(o, np.float32)[:, end:] == 0).all()
  assert np.array_equal(_bits(o), _bits(o_off)) and np.array_equal(_bits(ht), _bits(ht_off))
