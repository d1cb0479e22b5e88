"""The fused Mosaic TPU groups (kda.fused.gate_intra.mosaic_tpu, kda.fused.state_output.mosaic_tpu) in the TPU
interpreter: equal bit for bit to the unfused TPU stage kernels (the same chunk bodies), close to the
reference stages run in sequence, a NaN kept in its sequence, their refusals and their Mosaic
lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kda import padding
from kda.fused.gate_intra import mosaic_tpu as gate_intra_tpu
from kda.fused.state_output import mosaic_tpu as state_output_tpu
from kda.reference import recurrent_kda
from kda.stages import gate, state
from kda.stages.gate import mosaic_tpu as gate_tpu
from kda.stages.intra import mosaic_tpu as intra_tpu
from kda.stages.output import mosaic_tpu as output_tpu
from kda.stages.state import mosaic_tpu as state_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages import tpu_setup as setup

GATE = setup.GATE
# The whole forward's o and final state against the reference stages in sequence. float32: every dot
# at HIGHEST, exact in the interpreter: summation order only, measured <= 2.2e-7 relative. bf16: the
# dtype policy's roundings (bf16 dot operands and stores of w, u, qg, kg, Aqk, S, v_new), measured
# max|d| / max|ref| 2.7e-3 (o) and 2.1e-3 (final state): bounds ~4x that, relative to the max.
REL_TOL = {"float32": 2e-6, "bfloat16": 1e-2}


def same(a, b, name):
  np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)),
                                err_msg=name)


def _gate_intra(name):
  c, f = setup.CASES[name], setup.forward(name)
  return setup.kernel(gate_intra_tpu.apply, scale=c.scale, chunk_size=c.BT, **GATE)(*f.ins)


@pytest.mark.parametrize("name", ["A", "B"])
def test_fused_equal_unfused_and_close_to_reference(name):
  """tpu_setup's cases: float32 K = V = 64 BT 16, bf16 K = V = 128 BT 32 (the stage tests compile the
  unfused kernels on the same shapes). state_output takes gate_intra's decay here, gc_int and
  gc_frac in test_state_output_switches_and_nan."""
  c, f = setup.CASES[name], setup.forward(name)
  q, k, v, beta, g, valid, A_log, dt_bias = f.ins
  fi = _gate_intra(name)
  gt = setup.kernel(gate_tpu.apply, chunk_size=c.BT, **GATE)(g, valid, A_log, dt_bias)
  it = setup.kernel(intra_tpu.apply, scale=c.scale, chunk_size=c.BT)(q, k, v, beta, gt.gc_int, gt.gc_frac)
  for field in ("gc_int", "gc_frac"):
    same(getattr(fi, field), getattr(gt, field), field)
  for field in ("Aqk", "Ainv", "w", "u", "qg", "kg"):
    assert getattr(fi, field).dtype == c.dtype
    same(getattr(fi, field), getattr(it, field), field)
  same(fi.decay, state.chunk_decay(gt.gc_int, gt.gc_frac, c.BT), "decay")

  fo = setup.kernel(state_output_tpu.apply, scale=c.scale, chunk_size=c.BT)(
      fi.kg, fi.w, fi.u, fi.qg, fi.Aqk, None, None, f.h0, f.acu, decay=fi.decay)
  st = setup.kernel(state_tpu.apply, chunk_size=c.BT)(it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, f.h0, f.acu)
  ot = setup.kernel(output_tpu.apply, scale=c.scale, chunk_size=c.BT)(it.qg, st.h, it.Aqk, st.v_new)
  same(fo.o, ot.o, "o")
  same(fo.final_state, st.final_state, "final_state")

  o, final = f.ref["output"].o, f.ref["state"].final_state
  tol = REL_TOL[jnp.dtype(c.dtype).name]
  assert cases.rel_err(fo.o, o) <= tol, cases.rel_err(fo.o, o)
  assert cases.rel_err(fo.final_state, final) <= tol, cases.rel_err(fo.final_state, final)
  assert not np.any(np.asarray(fo.o[0])[~np.asarray(valid[0])]), "o is not 0 at padding tokens"


def test_forward_matches_recurrence_f32():
  """Case A through gate_intra and state_output, unaligned: the token-by-token recurrence
  (kda.reference.recurrent_kda) within 1e-5, the float32 contract (every dot at HIGHEST; measured
  max |d| 4.5e-8 on |o| <= 0.12, 1.2e-7 on |final_state| <= 1.9)."""
  c, f = setup.CASES["A"], setup.forward("A")
  q, k, v, beta, g, valid, A_log, dt_bias = f.ins
  fi = _gate_intra("A")
  fo = setup.kernel(state_output_tpu.apply, scale=c.scale, chunk_size=c.BT)(
      fi.kg, fi.w, fi.u, fi.qg, fi.Aqk, None, None, f.h0, f.acu, decay=fi.decay)
  cu = cases.cu_from_lens(c.lens)
  layout = padding.layout_from_cu_seqlens(cu, sum(c.lens), c.BT)
  packed = [padding.unalign_with(layout, x) for x in (q, k, v, g, beta)]
  g_act = gate.activate(packed[3], A_log, dt_bias, **GATE)
  o, final = recurrent_kda(*packed[:3], g_act, packed[4], scale=c.scale, initial_state=f.h0,
                           output_final_state=True, cu_seqlens=cu)
  cases.report_close("o", padding.unalign_with(layout, fo.o), o, atol=1e-5, rtol=1e-5)
  cases.report_close("final_state", fo.final_state, final, atol=1e-5, rtol=1e-5)


def test_state_output_switches_and_nan():
  """Case A. gc_int, gc_frac given (no decay); zero_h0 (no initial state read), store_final=False,
  bf16 o; a NaN initial state of sequence 3 stays in sequence 3."""
  c, f = setup.CASES["A"], setup.forward("A")
  fi = _gate_intra("A")
  args = (fi.kg, fi.w, fi.u, fi.qg, fi.Aqk, fi.gc_int, fi.gc_frac)
  zero = setup.kernel(state_output_tpu.apply, scale=c.scale, chunk_size=c.BT, zero_h0=True, store_final=False,
                      out_dtype=jnp.bfloat16)(*args, jnp.full(f.h0.shape, jnp.nan), f.acu)
  run = setup.kernel(state_output_tpu.apply, scale=c.scale, chunk_size=c.BT)
  ref = run(*args, jnp.zeros(f.h0.shape), f.acu)
  assert zero.o.dtype == jnp.bfloat16 and not np.any(np.asarray(zero.final_state))
  same(zero.o, ref.o.astype(jnp.bfloat16), "o with zero_h0")
  bad, good = run(*args, f.h0.at[3, 1, 2, 3].set(jnp.nan), f.acu), run(*args, f.h0, f.acu)
  start = int(f.acu[3])
  assert np.isnan(np.asarray(bad.o)[:, start:, 1]).any()
  same(bad.o[:, :start], good.o[:, :start], "o before sequence 3")
  same(bad.final_state[:3], good.final_state[:3], "the other final states")


def test_supports_refuses_in_words():
  s = jax.ShapeDtypeStruct
  x, gc = s((1, 64, 2, 64), jnp.bfloat16), s((1, 64, 2, 64), jnp.float32)
  valid, beta, A = s((1, 64), jnp.bool_), s((1, 64, 2), jnp.bfloat16), s((2,), jnp.float32)
  kw = dict(scale=0.1, chunk_size=16, **GATE)
  assert gate_intra_tpu.supports(x, x, x, beta, gc, valid, A, None, **kw) is None
  assert "A_log" in gate_intra_tpu.supports(x, x, x, beta, gc, valid, None, None, **kw)
  assert "g must have k's shape" in gate_intra_tpu.supports(x, x, s((1, 64, 2, 32), jnp.bfloat16), beta,
                                                             s((1, 64, 2, 32), jnp.float32), valid, A, None, **kw)
  h0, acu, Aqk = s((2, 2, 64, 64), jnp.float32), s((3,), jnp.int32), s((1, 64, 2, 16), jnp.bfloat16)
  assert state_output_tpu.supports(x, x, x, x, Aqk, gc, gc, h0, acu, chunk_size=16) is None
  assert "Aqk must have shape" in state_output_tpu.supports(x, x, x, x, Aqk, gc, gc, h0, acu, chunk_size=32)


def _mosaic_text(fn, *args):
  """The Mosaic MLIR of fn's kernels (pallas_call(debug=True) prints it while lowering for a TPU)."""
  buf, orig = io.StringIO(), pl.pallas_call
  pl.pallas_call = functools.partial(orig, debug=True)
  try:
    with contextlib.redirect_stdout(buf):
      lower_tpu(fn, *args)
  finally:
    pl.pallas_call = orig
  return buf.getvalue()


@pytest.mark.parametrize("dtype,BT", [(jnp.float32, 32), (jnp.bfloat16, 64)], ids=["f32-BT32", "bf16-BT64"])
def test_fused_kernels_lower_for_tpu(dtype, BT):
  """One Mosaic kernel each. float32 inputs: every dot at HIGHEST (contract_precision<fp32>); bf16:
  only the gate's two cumsum dots (one bf16 pass elsewhere). gate_intra has 2 cumsum dots, 2 score
  dots per sub-block after the first, w and u; state_output 4. The state's chunk axis is
  "arbitrary", gate_intra's grid all "parallel"."""
  Ta, HV, K, V, N = 256, 4, 128, 128, 3
  s = jax.ShapeDtypeStruct
  tok = lambda D, d=dtype: s((1, Ta, HV, D), d)
  gi = _mosaic_text(functools.partial(gate_intra_tpu.apply, scale=K ** -0.5, chunk_size=BT, **GATE),
                    tok(K), tok(K), tok(V), s((1, Ta, HV), dtype), tok(K), s((1, Ta), jnp.bool_),
                    s((HV,), jnp.float32), s((HV * K,), jnp.float32))
  so = _mosaic_text(functools.partial(state_output_tpu.apply, scale=K ** -0.5, chunk_size=BT),
                    tok(K), tok(K), tok(V), tok(K), tok(BT), tok(K, jnp.float32), tok(K, jnp.float32),
                    s((N, HV, K, V), jnp.float32), s((N + 1,), jnp.int32))
  n_gi = 4 + 2 * (BT // 16 - 1)
  for text, name, n, n_f32 in ((gi, "gate_intra", n_gi, n_gi if dtype == jnp.float32 else 2),
                               (so, "state_output", 4, 4 if dtype == jnp.float32 else 0)):
    assert text.count(f"func.func @kda_{name}_tpu(") == 1
    dots = [line for line in text.splitlines() if "tpu.matmul" in line]
    assert len(dots) == n and sum("contract_precision<fp32>" in line for line in dots) == n_f32, name
  sem = "dimension_semantics = [#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<{}>]"
  assert sem.format("arbitrary") in so and sem.format("parallel") in gi
