"""The fused Mosaic TPU groups (kda.fused.gate_intra_tpu, kda.fused.state_output_tpu) in the TPU
interpreter: equal bit for bit to the unfused TPU stage kernels (the same chunk bodies), close to the
reference stages run in sequence, a NaN kept in its sequence, their refusals and their Mosaic
lowering for a TPU (no TPU, no libtpu needed)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding
from kda.fused import gate_intra_tpu, state_output_tpu
from kda.stages import gate, intra, output, state
from kda.stages.gate import mosaic_tpu as gate_tpu
from kda.stages.intra import mosaic_tpu as intra_tpu
from kda.stages.output import mosaic_tpu as output_tpu
from kda.stages.state import mosaic_tpu as state_tpu
from tests import cases
from tests.lowering import lower_tpu
from tests.stages.test_gate import pooled_inputs

GATE = dict(use_gate_in_kernel=True, lower_bound=None)   # softplus with A_log and dt_bias
# The whole forward's o and final state against the reference stages in sequence. float32: every dot
# at HIGHEST, exact in the interpreter: summation order only, measured <= 2.2e-7 relative. bf16: the
# dtype policy's roundings (bf16 dot operands and stores of w, u, qg, kg, Aqk, S, v_new), measured
# max|d| / max|ref| 2.7e-3 (o) and 2.1e-3 (final state): bounds ~4x that, relative to the max.
REL_TOL = {"float32": 2e-6, "bfloat16": 1e-2}


def _inputs(lens, K, V, BT, dtype):
  q, k, v, g, beta, valid, A_log, dt_bias = pooled_inputs(lens=lens, HV=2, K=K, V=V, BT=BT, dtype=dtype,
                                                          gate_kind="raw")
  acu = padding.aligned_cu_seqlens(jnp.asarray(lens, jnp.int32), BT)
  h0 = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (len(lens), 2, K, V))
  return (q, k, v, beta, g, valid, A_log, dt_bias), h0, acu


@functools.lru_cache(maxsize=None)
def _fns(BT, scale):
  ji = lambda f, **kw: jax.jit(functools.partial(f, chunk_size=BT, interpret=True, **kw))
  return dict(
      gate_intra=ji(gate_intra_tpu.apply, scale=scale, **GATE),
      gate=ji(gate_tpu.apply, **GATE), intra=ji(intra_tpu.apply, scale=scale),
      state=ji(state_tpu.apply), output=ji(output_tpu.apply, scale=scale),
      state_output=ji(state_output_tpu.apply, scale=scale),
      state_output_decay=jax.jit(lambda kg, w, u, qg, A, h0, acu, decay: state_output_tpu.apply(
          kg, w, u, qg, A, None, None, h0, acu, scale=scale, chunk_size=BT, interpret=True, decay=decay)))


def _reference(ins, h0, acu, BT, scale):
  q, k, v, beta, g, valid, A_log, dt_bias = ins
  gt = gate.reference.apply(g, valid, A_log, dt_bias, chunk_size=BT, **GATE)
  it = intra.reference.apply(q, k, v, beta, gt.gc_int, gt.gc_frac, scale=scale, chunk_size=BT)
  st = state.reference.apply(it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, h0, acu, chunk_size=BT)
  return output.reference.apply(it.qg, st.h, it.Aqk, st.v_new, scale=scale, chunk_size=BT).o, st.final_state


def same(a, b, name):
  np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)),
                                err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_equal_unfused_and_close_to_reference(dtype):
  lens, K, V, BT = [30, 0, 1, 50], 64, 64, 16
  scale = K ** -0.5
  ins, h0, acu = _inputs(lens, K, V, BT, dtype)
  q, k, v, beta, g, valid, A_log, dt_bias = ins
  f = _fns(BT, scale)
  fi = f["gate_intra"](*ins)
  gt = f["gate"](g, valid, A_log, dt_bias)
  it = f["intra"](q, k, v, beta, gt.gc_int, gt.gc_frac)
  for name in ("gc_int", "gc_frac"):
    same(getattr(fi, name), getattr(gt, name), name)
  for name in ("Aqk", "Ainv", "w", "u", "qg", "kg"):
    assert getattr(fi, name).dtype == dtype
    same(getattr(fi, name), getattr(it, name), name)
  same(fi.decay, state.chunk_decay(gt.gc_int, gt.gc_frac, BT), "decay")

  fo = f["state_output"](fi.kg, fi.w, fi.u, fi.qg, fi.Aqk, fi.gc_int, fi.gc_frac, h0, acu)
  st = f["state"](it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, h0, acu)
  ot = f["output"](it.qg, st.h, it.Aqk, st.v_new)
  same(fo.o, ot.o, "o")
  same(fo.final_state, st.final_state, "final_state")
  fd = f["state_output_decay"](fi.kg, fi.w, fi.u, fi.qg, fi.Aqk, h0, acu, fi.decay)
  same(fd.o, fo.o, "o (decay given)")

  o, final = _reference(ins, h0, acu, BT, scale)
  tol = REL_TOL[jnp.dtype(dtype).name]
  assert cases.rel_err(fo.o, o) <= tol, cases.rel_err(fo.o, o)
  assert cases.rel_err(fo.final_state, final) <= tol, cases.rel_err(fo.final_state, final)
  assert not np.any(np.asarray(fo.o[0])[~np.asarray(valid[0])]), "o is not 0 at padding tokens"


def test_state_output_switches_and_nan():
  """zero_h0 (no initial state read), store_final=False, bf16 o; a NaN initial state of sequence 1
  stays in sequence 1."""
  lens, K, V, BT = [30, 20, 0, 40], 64, 64, 16
  ins, h0, acu = _inputs(lens, K, V, BT, jnp.float32)
  f = _fns(BT, K ** -0.5)
  fi = f["gate_intra"](*ins)
  args = (fi.kg, fi.w, fi.u, fi.qg, fi.Aqk, fi.gc_int, fi.gc_frac)
  run = lambda h, **kw: state_output_tpu.apply(*args, h, acu, scale=K ** -0.5, chunk_size=BT, interpret=True, **kw)
  zero = run(jnp.full(h0.shape, jnp.nan), zero_h0=True, out_dtype=jnp.bfloat16, store_final=False)
  ref = run(jnp.zeros(h0.shape))
  assert zero.o.dtype == jnp.bfloat16 and not np.any(np.asarray(zero.final_state))
  same(zero.o, ref.o.astype(jnp.bfloat16), "o with zero_h0")
  bad = run(h0.at[1, 1, 2, 3].set(jnp.nan))
  good = run(h0)
  c0, c1 = int(acu[1]), int(acu[2])
  o_bad, o_good = np.asarray(bad.o), np.asarray(good.o)
  assert np.isnan(o_bad[:, c0:c1, 1]).any()
  same(np.delete(o_bad, np.s_[c0:c1], axis=1), np.delete(o_good, np.s_[c0:c1], axis=1), "o outside sequence 1")
  same(bad.final_state[np.array([0, 2, 3])], good.final_state[np.array([0, 2, 3])], "other final states")


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_kernels_lower_for_tpu(dtype):
  Ta, HV, K, V, BT, N = 256, 4, 128, 128, 64, 3
  s = jax.ShapeDtypeStruct
  tok = lambda D, d=dtype: s((1, Ta, HV, D), d)
  gi = functools.partial(gate_intra_tpu.apply, scale=K ** -0.5, chunk_size=BT, **GATE)
  assert lower_tpu(gi, tok(K), tok(K), tok(V), s((1, Ta, HV), dtype), tok(K), s((1, Ta), jnp.bool_),
                   s((HV,), jnp.float32), s((HV * K,), jnp.float32)) == 1
  so = functools.partial(state_output_tpu.apply, scale=K ** -0.5, chunk_size=BT)
  assert lower_tpu(so, tok(K), tok(K), tok(V), tok(K), tok(BT), tok(K, jnp.float32), tok(K, jnp.float32),
                   s((N, HV, K, V), jnp.float32), s((N + 1,), jnp.int32)) == 1
