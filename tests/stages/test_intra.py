"""intra stage: the reference against a float64 numpy loop, the Pallas kernel against the reference
(interpret mode), and the kernel's Triton lowering for an H200."""
from __future__ import annotations

import contextlib
import functools
import io
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kda.stages import gate, intra
from tests import cases
from tests.lowering import lower_h200
from tests.stages.test_gate import extreme_gates, pooled_inputs

# Reference (float32, HIGHEST) vs float64 over K = 8 channels and <= 64 rows: measured <= 3e-7;
# 1e-5 leaves headroom without hiding a wrong formula.
REF_TOL = dict(atol=1e-5, rtol=1e-5)

# Kernel vs reference, keyed by (output, input dtype). The CPU interpreter runs every float32 dot at
# full precision, so float32 errors are summation order only.
TOL = {
    # float32 dots over K <= 128 terms of size <= 1 (unit-norm q, k): measured <= 8e-8
    ("Akk", "float32"): dict(atol=1e-6, rtol=1e-5),
    ("Aqk", "float32"): dict(atol=1e-6, rtol=1e-5),
    # the solve of a <= 64-row system with |entries| <= 1: measured <= 8e-8
    ("Ainv", "float32"): dict(atol=1e-6, rtol=1e-5),
    # one more <= 64-term dot on top of Ainv: measured <= 2.4e-7 on |u| <= ~3.3, 2e-8 on w
    ("w", "float32"): dict(atol=2e-6, rtol=1e-5),
    ("u", "float32"): dict(atol=2e-6, rtol=1e-5),
    # the same elementwise exp and product as the reference
    ("qg", "float32"): dict(atol=1e-6, rtol=1e-6),
    ("kg", "float32"): dict(atol=1e-6, rtol=1e-6),
    # bf16 inputs: every output is stored bf16 (dtype policy), one more rounding of <= 2^-8 relative
    # on top of the bf16 dot operands. Measured as max|d| / max|ref| (abs in brackets) over the bf16
    # cases below. A dots: bf16-rounded gated operands over K terms of size <= 1, then the store:
    # <= 4.0e-3 (Akk, 4.9e-4), 3.6e-3 (Aqk, 1.4e-4)
    ("Akk", "bfloat16"): dict(atol=2e-3, rtol=1e-2),
    ("Aqk", "bfloat16"): dict(atol=2e-3, rtol=1e-2),
    # float32 solve of the bf16-level Akk, stored bf16 (|Ainv| <= 1 off a unit diagonal): <= 4.9e-4
    ("Ainv", "bfloat16"): dict(atol=2e-3, rtol=1e-2),
    # Ainv and the right-hand side rounded to bf16 over <= 64 terms, then the store: <= 4.4e-3 on w
    # (7.8e-4, |w| <= 0.2), <= 5.0e-3 on u (1.4e-2, |u| <= ~2.6)
    ("w", "bfloat16"): dict(atol=3e-3, rtol=1e-2),
    ("u", "bfloat16"): dict(atol=3e-2, rtol=1e-2),
    # elementwise in float32 from the same bf16 inputs, then the store alone: <= 2^-8 = 3.9e-3 of
    # each value (measured <= 2.5e-3 of the max)
    ("qg", "bfloat16"): dict(atol=1e-6, rtol=4e-3),
    ("kg", "bfloat16"): dict(atol=1e-6, rtol=4e-3),
}


@functools.partial(jax.jit, static_argnames=("BT", "raw"))
def _gc(g, valid, A_log, dt_bias, *, BT, raw):
  return gate.reference.apply(g, valid, A_log, dt_bias, chunk_size=BT, use_gate_in_kernel=raw,
                              lower_bound=None)[1:]


def stage_inputs(*, lens=None, T=None, HV=2, K=32, V=32, BT=32, dtype=jnp.float32, gate_kind="plain",
                 gate_scale=1.0):
  """q, k, v, beta, gc_int, gc_frac of the intra stage in the aligned layout, and the [Ta] real-token mask.

  lens: varlen (zeros at padding positions, gc flat there); else T tokens with no padding.
  gate_kind "raw" goes through the softplus activation, "extreme" is "plain" with some gates huge or
  -inf (test_gate.extreme_gates); gate_scale multiplies a log-space gate (for gates beyond
  safe_gate's -5).
  """
  kind = "plain" if gate_kind == "extreme" else gate_kind
  q, k, v, g, beta, valid, A_log, dt_bias = pooled_inputs(lens=lens, T=T, HV=HV, K=K, V=V, BT=BT, dtype=dtype,
                                                          gate_kind=kind, gate_scale=gate_scale)
  if gate_kind == "extreme":
    g = extreme_gates(g, 5, frac=0.05)
  gi, gf = _gc(g, valid, A_log, dt_bias, BT=BT, raw=gate_kind == "raw")
  return (q, k, v, beta, gi, gf), np.asarray(valid[0])


@functools.lru_cache(maxsize=None)
def _reference(BT, scale):
  return jax.jit(functools.partial(intra.reference.apply, scale=scale, chunk_size=BT))


@functools.lru_cache(maxsize=None)
def _kernel(BT, scale, config=None):
  return jax.jit(functools.partial(intra.pallas.apply, scale=scale, chunk_size=BT, interpret=True,
                                   config=config))


def numpy_intra(q, k, v, beta, gi, gf, scale, BT):
  """The module docstring's formulas, one chunk and head at a time, in float64 loops."""
  q, k, v, beta, gi, gf = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, beta, gi, gf))
  gc = gi + gf
  _, Ta, HV, K = k.shape
  out = {n: np.zeros(getattr(x, "shape")[:3] + (d,)) for n, x, d in
         (("Akk", k, BT), ("Aqk", k, BT), ("Ainv", k, BT), ("w", k, K), ("u", v, v.shape[-1]),
          ("qg", k, K), ("kg", k, K))}
  for c in range(Ta // BT):
    for h in range(HV):
      t = slice(c * BT, (c + 1) * BT)
      qc, kc, vc, bc, gcc = q[0, t, h], k[0, t, h], v[0, t, h], beta[0, t, h], gc[0, t, h]
      Akk, Aqk = np.zeros((BT, BT)), np.zeros((BT, BT))
      for i in range(BT):
        for j in range(i + 1):
          decay = np.exp(gcc[i] - gcc[j])
          Aqk[i, j] = scale * np.sum(qc[i] * kc[j] * decay)
          if j < i:
            Akk[i, j] = bc[i] * np.sum(kc[i] * kc[j] * decay)
      X = np.eye(BT)                                    # forward substitution: (I + Akk) X = I
      for i in range(BT):
        for j in range(i):
          X[i] -= Akk[i, j] * X[j]
      out["Akk"][0, t, h], out["Aqk"][0, t, h], out["Ainv"][0, t, h] = Akk, Aqk, X
      out["w"][0, t, h] = X @ (bc[:, None] * kc * np.exp(gcc))
      out["u"][0, t, h] = X @ (bc[:, None] * vc)
      out["qg"][0, t, h] = qc * np.exp(gcc)
      out["kg"][0, t, h] = kc * np.exp(gcc[-1] - gcc)
  return out


@pytest.mark.parametrize("BT,lens,gate_kind", [(16, [30, 5], "plain"), (32, None, "raw"), (64, None, "strong"),
                                               (32, [40, 20], "extreme")],
                         ids=["BT16-varlen-plain", "BT32-raw", "BT64-strong", "BT32-extreme"])
def test_reference_matches_numpy_loops(BT, lens, gate_kind):
  args, _ = stage_inputs(lens=lens, T=None if lens else 64, HV=2, K=8, V=4, BT=BT, gate_kind=gate_kind)
  scale = 8 ** -0.5
  got = _reference(BT, scale)(*args)
  want = numpy_intra(*args, scale, BT)
  for name in intra.Out._fields:
    cases.report_close(name, getattr(got, name), want[name], **REF_TOL)


def check_padding(got, valid, BT):
  """Padding rows and columns of Akk / Aqk are exactly 0, so are u, w, qg, kg; Ainv's rows one-hot."""
  pad = ~valid
  if not pad.any():
    return
  for name in ("Akk", "Aqk"):
    A = np.asarray(getattr(got, name)[0])                        # [Ta, HV, BT]
    assert not np.any(A[pad]), f"{name}: a padding row is not exactly 0"
    for p in np.flatnonzero(pad):                                # column p % BT of p's chunk
      c = p // BT
      assert not np.any(A[c * BT:(c + 1) * BT, :, p % BT]), f"{name}: padding column of token {p} not 0"
  for name in ("w", "u", "qg", "kg"):
    assert not np.any(np.asarray(getattr(got, name)[0])[pad]), f"{name}: not exactly 0 at padding tokens"
  Ainv = np.asarray(got.Ainv[0])
  onehot = np.broadcast_to(np.eye(BT)[np.arange(len(valid)) % BT][:, None, :], Ainv.shape)
  np.testing.assert_array_equal(Ainv[pad], onehot[pad], "Ainv: padding rows are not one-hot")


KERNEL_CASES = [
    # id, lens or T, K, V, BT, dtype, gate, gate_scale, diag
    ("T64-K32-V32-BT16-f32", 64, 32, 32, 16, jnp.float32, "plain", 1.0, "auto"),
    ("45_80_20-K64-V64-BT32-f32-raw", [45, 80, 20], 64, 64, 32, jnp.float32, "raw", 1.0, "auto"),
    ("30_50-K96-V96-BT64-f32", [30, 50], 96, 96, 64, jnp.float32, "plain", 1.0, "auto"),
    ("T128-K128-V64-BT64-f32-pairwise", 128, 128, 64, 64, jnp.float32, "plain", 1.0, "pairwise"),
    ("T128-K128-V32-BT64-bf16", 128, 128, 32, 64, jnp.bfloat16, "plain", 1.0, "auto"),
    ("100-K96-V32-BT32-bf16", [100], 96, 32, 32, jnp.bfloat16, "plain", 1.0, "auto"),
    ("with_empty-K64-V96-BT16-bf16-raw", [17, 0, 40], 64, 96, 16, jnp.bfloat16, "raw", 1.0, "auto"),
    # -5 per token over whole 64-token chunks: gc reaches -320, exp(-gc) would overflow float32
    ("T128-K128-V32-BT64-f32-strong", 128, 128, 32, 64, jnp.float32, "strong", 1.0, "auto"),
    ("T128-K64-V64-BT64-bf16-strong", 128, 64, 64, 64, jnp.bfloat16, "strong", 1.0, "auto"),
    # -12 per token: a half sub-block spans 96 > DIAG_RANGE, so "auto" falls back to pairwise
    ("T64-K32-V32-BT32-f32-extreme", 64, 32, 32, 32, jnp.float32, "strong", 2.4, "auto"),
    # some gates -inf, -1e30 ... -30 (test_gate.EXTREMES): resets, huge exponents, the floor
    ("30_50-K32-V32-BT32-f32-huge", [30, 50], 32, 32, 32, jnp.float32, "extreme", 1.0, "auto"),
    ("T64-K64-V32-BT64-bf16-huge", 64, 64, 32, 64, jnp.bfloat16, "extreme", 1.0, "auto"),
]


@pytest.mark.parametrize("lens,K,V,BT,dtype,gate_kind,gate_scale,diag", [c[1:] for c in KERNEL_CASES],
                         ids=[c[0] for c in KERNEL_CASES])
def test_kernel_matches_reference(lens, K, V, BT, dtype, gate_kind, gate_scale, diag):
  varlen = isinstance(lens, list)
  args, valid = stage_inputs(lens=lens if varlen else None, T=None if varlen else lens, HV=2, K=K, V=V,
                             BT=BT, dtype=dtype, gate_kind=gate_kind, gate_scale=gate_scale)
  scale = K ** -0.5
  want = _reference(BT, scale)(*args)
  got = _kernel(BT, scale, intra.pallas.Config(diag=diag))(*args)
  dt = jnp.dtype(dtype).name
  for name in intra.Out._fields:
    g, w = getattr(got, name), getattr(want, name)
    chex.assert_shape(g, w.shape)
    assert g.dtype == dtype, f"{name}: dtype {g.dtype}, want {jnp.dtype(dtype).name} (dtype policy)"
    assert bool(jnp.all(jnp.isfinite(g))), f"{name}: not finite"
    cases.report_close(name, g, w, **TOL[name, dt])
  check_padding(got, valid, BT)


def test_auto_diagonal_takes_both_paths():
  """Moderate gates take the factored dot (bitwise different from pairwise), extreme ones pairwise.

  Same shapes as the "extreme" kernel case, so the "auto" kernel is already compiled."""
  BT, scale = 32, 32 ** -0.5
  for gate_scale, same in ((1.0, False), (2.4, True)):
    args, _ = stage_inputs(T=64, HV=2, K=32, V=32, BT=BT, gate_kind="strong", gate_scale=gate_scale)
    auto = _kernel(BT, scale, intra.pallas.Config(diag="auto"))(*args)
    pair = _kernel(BT, scale, intra.pallas.Config(diag="pairwise"))(*args)
    assert np.array_equal(np.asarray(auto.Akk), np.asarray(pair.Akk)) == same, gate_scale


def test_gc_frac_kernel_computes_the_same_bits():
  """Gates above -1 (gc_int == 0): the gc_frac-only kernel (what the launcher's cond takes there)
  equals the two-part one bit for bit."""
  BT, scale = 32, 32 ** -0.5
  args, _ = stage_inputs(lens=[30, 50], HV=2, K=32, V=32, BT=BT, gate_kind="strong", gate_scale=0.15)
  assert not np.any(np.asarray(args[4])) and float(jnp.min(args[5])) < -10
  q, k, v, beta, gi, gf = args
  run = lambda two_part: jax.jit(functools.partial(intra.pallas.launch, two_part=two_part, scale=scale,
                                                   chunk_size=BT, interpret=True))(q, k, v, beta[..., None], gi, gf)
  for name, a, b in zip(intra.Out._fields, run(False), run(True)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="precision"):
    intra.pallas.Config(precision="fast")
  with pytest.raises(ValueError, match="diag"):
    intra.pallas.Config(diag="fast")
  with pytest.raises(ValueError, match="num_warps"):
    intra.pallas.Config(num_warps=3)
  x = jnp.zeros((1, 16, 1, 16))
  with pytest.raises(ValueError, match="chunk_size"):
    intra.pallas.apply(x, x, x, x[..., 0], x, x, scale=1.0, chunk_size=8, interpret=True)


def _lower(K, V, BT, dtype, config, debug=False):
  Ta, HV = 4 * BT, 2
  s = lambda d, *shape: jax.ShapeDtypeStruct(shape, d)
  args = (s(dtype, 1, Ta, HV, K), s(dtype, 1, Ta, HV, K), s(dtype, 1, Ta, HV, V), s(dtype, 1, Ta, HV),
          s(jnp.float32, 1, Ta, HV, K), s(jnp.float32, 1, Ta, HV, K))
  fn = functools.partial(intra.pallas.apply, scale=K ** -0.5, chunk_size=BT, config=config)
  if not debug:
    return lower_h200(fn, *args)
  buf = io.StringIO()
  orig = pl.pallas_call
  try:   # debug=True makes the Triton lowering print its IR
    pl.pallas_call = functools.partial(orig, debug=True)
    with contextlib.redirect_stdout(buf):
      lower_h200(fn, *args)
  finally:
    pl.pallas_call = orig
  return buf.getvalue()


LOWER_CASES = [
    # K, V, BT, dtype, config
    (128, 128, 64, jnp.bfloat16, intra.pallas.Config()),
    (128, 128, 64, jnp.bfloat16, intra.pallas.Config(diag="pairwise")),
    (128, 128, 64, jnp.bfloat16, intra.pallas.Config(bf16_dots=False, precision="tf32", num_warps=8)),
    (128, 128, 64, jnp.float32, intra.pallas.Config()),
    (128, 128, 64, jnp.float32, intra.pallas.Config(precision="tf32x3")),
    (96, 96, 64, jnp.bfloat16, intra.pallas.Config()),
    (128, 128, 16, jnp.bfloat16, intra.pallas.Config()),
    (64, 128, 32, jnp.float32, intra.pallas.Config()),
    (256, 256, 64, jnp.bfloat16, intra.pallas.Config(num_warps=8)),
]


@pytest.mark.parametrize("K,V,BT,dtype,config", LOWER_CASES,
                         ids=[f"K{K}-V{V}-BT{BT}-{jnp.dtype(d).name}-{c.diag}-{c.precision}"
                              f"{'' if c.bf16_dots else '-f32dots'}-w{c.num_warps}" for K, V, BT, d, c in LOWER_CASES])
def test_kernel_lowers_for_h200(K, V, BT, dtype, config):
  assert "kda_intra" in _lower(K, V, BT, dtype, config)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_triton_dot_precisions(dtype):
  """No float32 dot runs as TF32 with precision="highest"; with bf16 inputs the A, w, u dots are bf16.

  Per chunk of 4 sub-blocks: A takes 2 x (6 + 4) dots [16, K] x [K, 16], the solve 10 + 6 float32
  [16, 16] dots, w and u 2 x 10 dots [16, 16] x [16, K]."""
  ir = _lower(128, 128, 64, dtype, intra.pallas.Config(), debug=True)   # both kernels: the same dots each
  dots = [l for l in ir.splitlines() if "tt.dot" in l]
  f32_dots = [l for l in dots if re.search(r"tensor<\d+x\d+xf32> \* tensor<\d+x\d+xf32> ->", l)]
  bf16_dots = [l for l in dots if "xbf16> * tensor<" in l]
  assert len(f32_dots) + len(bf16_dots) == len(dots) == 2 * (2 * 10 + 16 + 2 * 10)
  assert not [l for l in f32_dots if "tf32" in l], "a float32 dot lowers to TF32"
  assert len(bf16_dots) == (2 * 40 if dtype == jnp.bfloat16 else 0)


@functools.lru_cache(maxsize=None)
def _lowered_text(config):
  return _lower(32, 32, 32, jnp.bfloat16, config)   # two sub-blocks: the solve has a float32 block dot


@pytest.mark.parametrize("field,value", [("precision", "tf32x3"), ("bf16_dots", False), ("diag", "pairwise"),
                                         ("num_warps", 8), ("num_stages", 3)])
def test_config_field_changes_the_program(field, value):
  """Each Config field changes the lowered program; diag runs against the reference above,
  bf16_dots=False in test_bf16_dots_off_matches_reference (precision and the launch parameters leave
  the interpreted program as is)."""
  assert _lowered_text(intra.pallas.Config(**{field: value})) != _lowered_text(intra.pallas.Config())


def test_bf16_dots_off_matches_reference():
  """bf16 inputs with Config(bf16_dots=False): float32 dots and float32 outputs, float32 accuracy."""
  BT, scale = 16, 16 ** -0.5
  args, valid = stage_inputs(lens=[20, 9], HV=1, K=16, V=16, BT=BT, dtype=jnp.bfloat16, gate_kind="plain")
  got = _kernel(BT, scale, intra.pallas.Config(bf16_dots=False))(*args)
  want = _reference(BT, scale)(*args)
  for name in intra.Out._fields:
    assert getattr(got, name).dtype == jnp.float32, name
    cases.report_close(name, getattr(got, name), getattr(want, name), **TOL[name, "float32"])
  check_padding(got, valid, BT)


def test_reference_blocks_of_chunks_equal_one_block():
  """kda.stages.intra.over_chunk_blocks: the references' pair tensors formed over blocks of chunks
  (lax.map over equal blocks, the chunks padded to a multiple) give what one block gives, to
  float32 rounding."""
  from kda.stages.intra import over_chunk_blocks, reference as intra_ref, to_chunks
  rng = np.random.default_rng(3)
  NTa, BT, HV, K = 7, 16, 2, 8
  q, k = (jnp.asarray(rng.standard_normal((NTa, BT, HV, K)), jnp.float32) for _ in range(2))
  beta = jnp.asarray(rng.uniform(0.1, 0.9, (NTa, BT, HV)), jnp.float32)
  g = -jnp.abs(jnp.asarray(rng.standard_normal((NTa * BT, HV, K)), jnp.float32)) / 4
  gf = to_chunks(jnp.cumsum(g.reshape(NTa, BT, HV, K), axis=1).reshape(1, NTa * BT, HV, K), BT)
  gi = jnp.zeros_like(gf)
  whole = intra_ref.chunk_matrices(q, k, beta, gi, gf, 0.5)
  f = lambda gi, gf, q, k, beta: intra_ref.chunk_matrices(q, k, beta, gi, gf, 0.5)
  blocked = over_chunk_blocks(f, gi, gf, q, k, beta, limit=3 * BT * BT * HV * K)   # blocks of 3: 7 chunks + 2 of padding
  for a, b in zip(whole, blocked):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
