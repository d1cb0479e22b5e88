"""Hostile but valid inputs (docs/api.md): numpy arrays and numpy scalars wherever jax arrays
and Python scalars go, in and out of jax.jit; T == 0 forward and backward. Ground truth:
kda.reference.recurrent_kda on the same inputs as jax arrays. Tiny shapes: the whole file is a few
seconds on a CPU (the two impl="pallas" cases run Pallas interpret mode)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda.reference import recurrent_kda
from tests import cases

H, K, V = 2, 8, 8
LENS = [5, 7]
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2.0 ** -8}   # as tests/test_pipeline.py


@pytest.fixture(scope="module")
def inp():
  return cases.make_inputs(7, lens=LENS, H=H, K=K, V=V)


@pytest.fixture(scope="module")
def raw():
  return cases.make_inputs(8, lens=LENS, H=H, K=K, V=V, gate="raw")


def np_(x):
  return None if x is None else np.asarray(x)


def qkvgb(inp, f=lambda x: x):
  return tuple(f(getattr(inp, n)) for n in ("q", "k", "v", "g", "beta"))


def check(name, got, want, dtype=jnp.float32):
  tol = TOL[jnp.dtype(dtype)]
  atol = 2e-5 * max(float(np.max(np.abs(np.asarray(want, np.float32)))), 1e-30) if np.size(want) else 0.0
  cases.report_close(name, got, want, atol=atol, rtol=tol)


def want_of(inp, g=None, scale=None):
  return recurrent_kda(inp.q, inp.k, inp.v, inp.g if g is None else g, inp.beta, scale=scale,
                       initial_state=inp.initial_state, output_final_state=True, cu_seqlens=inp.cu_seqlens)


# ---- numpy arrays and scalars --------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_numpy_arrays_outside_jit(inp, impl):
  """Every array numpy (initial_state indexed inside a scan used to raise TracerArrayConversionError)."""
  o, fs = kda.chunk_kda(*qkvgb(inp, np_), initial_state=np_(inp.initial_state), output_final_state=True,
                        cu_seqlens=np_(inp.cu_seqlens), chunk_size=16, impl=impl)
  want_o, want_s = want_of(inp)
  assert isinstance(o, jax.Array) and isinstance(fs, jax.Array)
  check("o", o, want_o)
  check("final_state", fs, want_s)


def test_numpy_arrays_under_jit(inp):
  """numpy arrays closed over by a jitted function (concrete constants) and passed to it (traced)."""
  h0, cu = np_(inp.initial_state), np_(inp.cu_seqlens)
  closed = jax.jit(lambda q, k, v, g, beta: kda.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                                          output_final_state=True, impl="reference"))
  passed = jax.jit(lambda q, k, v, g, beta, h0, cu: kda.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                                                  output_final_state=True, impl="reference"))
  want_o, want_s = want_of(inp)
  for o, fs in (closed(*qkvgb(inp, np_)), passed(*qkvgb(inp, np_), h0, cu)):
    check("o", o, want_o)
    check("final_state", fs, want_s)


def test_numpy_initial_state_gradient(inp):
  """jax.grad outside jit with a numpy initial_state closed over (a constant, not a tracer)."""
  h0, cu = np_(inp.initial_state), np_(inp.cu_seqlens)
  args = qkvgb(inp)

  def loss(fn, q):
    o, fs = fn(q, *args[1:], initial_state=h0, output_final_state=True, cu_seqlens=cu)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(fs ** 2)

  got = jax.grad(lambda q: loss(lambda *a, **kw: kda.chunk_kda(*a, impl="reference", **kw), q))(np_(inp.q))
  check("dq", got, jax.grad(lambda q: loss(recurrent_kda, q))(inp.q))


@pytest.mark.parametrize("form", ["softplus", "sigmoid"])
def test_numpy_gate_arguments_and_scalars(raw, form):
  """A_log, dt_bias numpy arrays; scale and lower_bound numpy scalars (lower_bound=np.float32 used to be
  a TypeError)."""
  lb = None if form == "softplus" else np.float32(-1.5)
  scale = np.float32(0.3)
  o, fs = kda.chunk_kda(*qkvgb(raw, np_), initial_state=np_(raw.initial_state), output_final_state=True,
                        cu_seqlens=np_(raw.cu_seqlens), use_gate_in_kernel=True, A_log=np_(raw.A_log),
                        dt_bias=np_(raw.dt_bias), lower_bound=lb, safe_gate=lb is not None, scale=scale,
                        impl="reference")
  g = cases.recurrence_gate(raw, lower_bound=None if lb is None else float(lb))
  want_o, want_s = want_of(raw, g=g, scale=float(scale))
  check("o", o, want_o)
  check("final_state", fs, want_s)
  if form == "softplus":
    return
  o2, _ = jax.jit(lambda *a: kda.chunk_kda(*a, cu_seqlens=np_(raw.cu_seqlens), use_gate_in_kernel=True,
                                           A_log=np_(raw.A_log), dt_bias=np_(raw.dt_bias), lower_bound=lb,
                                           scale=scale, initial_state=np_(raw.initial_state), impl="reference"))(
      *qkvgb(raw))
  check("o (jit)", o2, want_o)


def test_numpy_lower_bound_int(raw):
  """Any numpy real scalar (not bool) is a lower_bound: np.int64(-2) agrees with -2.0."""
  run = lambda lb: kda.chunk_kda(*qkvgb(raw), cu_seqlens=raw.cu_seqlens, use_gate_in_kernel=True,
                                 A_log=raw.A_log, dt_bias=raw.dt_bias, lower_bound=lb, impl="reference")[0]
  np.testing.assert_array_equal(np.asarray(run(np.int64(-2))), np.asarray(run(-2.0)))


def test_numpy_segment_ids_and_int64_cu_seqlens(inp):
  """segment_ids as numpy int64 (with a padding token between the sequences, concrete and traced) and
  cu_seqlens as numpy int64: the same answer as the packed int32 cu_seqlens."""
  want_o, want_s = want_of(inp)
  o, fs = kda.chunk_kda(*qkvgb(inp, np_), initial_state=np_(inp.initial_state), output_final_state=True,
                        cu_seqlens=np_(inp.cu_seqlens).astype(np.int64), impl="reference")
  check("o (int64 cu_seqlens)", o, want_o)
  check("final_state (int64 cu_seqlens)", fs, want_s)
  # segment_ids: sequence 1 = tokens 0..4, a padding token, sequence 2 = the 7 others (T = 13)
  ins = lambda x: np.concatenate([np.asarray(x[:, :5]), np.zeros_like(np.asarray(x[:, :1])),
                                  np.asarray(x[:, 5:])], axis=1)
  seg = np.array([[1] * 5 + [0] + [2] * 7], np.int64)
  o, fs = kda.chunk_kda(*qkvgb(inp, ins), segment_ids=seg, initial_state=np_(inp.initial_state),
                        output_final_state=True, impl="reference")
  check("o (numpy segment_ids)", np.delete(np.asarray(o), 5, axis=1), want_o)
  np.testing.assert_array_equal(np.asarray(o)[:, 5], 0)
  check("final_state (numpy segment_ids)", fs, want_s)
  args = qkvgb(inp, ins)
  f = jax.jit(lambda s: kda.chunk_kda(*args, segment_ids=s, initial_state=np_(inp.initial_state),
                                      output_final_state=True, impl="reference"))
  o, fs = f(seg.astype(np.int32))
  check("final_state (traced numpy segment_ids)", fs, want_s)


def test_recurrent_kda_takes_numpy(inp):
  """kda.reference.recurrent_kda is public too: numpy for every argument, cu_seqlens a list or int64."""
  want_o, want_s = want_of(inp)
  for cu in (np_(inp.cu_seqlens).astype(np.int64), [int(c) for c in inp.cu_seqlens]):
    o, fs = recurrent_kda(*qkvgb(inp, np_), initial_state=np_(inp.initial_state), output_final_state=True,
                          cu_seqlens=cu, scale=np.float32(K ** -0.5))
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(fs), np.asarray(want_s), rtol=1e-6, atol=1e-6)
  o, fs = jax.jit(lambda *a: recurrent_kda(*a, initial_state=np_(inp.initial_state), output_final_state=True,
                                           cu_seqlens=np_(inp.cu_seqlens)))(*qkvgb(inp, np_))
  np.testing.assert_allclose(np.asarray(fs), np.asarray(want_s), rtol=1e-6, atol=1e-6)


# ---- T == 0 --------------------------------------------------------------------------------------

# id -> (B, keywords of chunk_kda with the states' N; "h0" means: pass initial_state [N, HV, K, V])
EMPTY = {
    "cu_0_0": (1, dict(cu_seqlens=[0, 0]), 1),
    "cu_0_0_0_numpy": (1, dict(cu_seqlens=np.zeros(3, np.int64)), 2),
    "cu_0_0_jnp": (1, dict(cu_seqlens=jnp.zeros(2, jnp.int32)), 1),
    "rows_B1": (1, dict(), 1),
    "rows_B3": (3, dict(), 3),
    "segment_ids_num_segments": (2, dict(segment_ids=np.zeros((2, 0), np.int32), num_segments=3), 3),
    "segment_ids_initial_state": (1, dict(segment_ids=jnp.zeros((1, 0), jnp.int32)), 2),
}


def empty_inputs(B, dtype=jnp.float32, N=1):
  e = cases.make_inputs(3, B=B, T=0, H=H, K=K, V=V, dtype=dtype, initial_state=False)
  h0 = 0.5 * jax.random.normal(jax.random.PRNGKey(4), (N, H, K, V))
  return e, h0


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("case", list(EMPTY))
def test_T0_forward(case, with_h0):
  B, kw, N = EMPTY[case]
  e, h0 = empty_inputs(B, N=N)
  if case == "segment_ids_initial_state" and not with_h0:
    kw = dict(kw, num_segments=N)
  o, fs = kda.chunk_kda(*qkvgb(e), initial_state=h0 if with_h0 else None, output_final_state=True,
                        impl="reference", **kw)
  assert o.shape == (B, 0, H, V) and o.dtype == e.v.dtype
  assert fs.shape == (N, H, K, V) and fs.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(fs), np.asarray(h0) if with_h0 else 0)


def test_T0_bf16_and_traced_cu_seqlens():
  e, h0 = empty_inputs(1, dtype=jnp.bfloat16, N=2)
  f = jax.jit(lambda cu, h: kda.chunk_kda(*qkvgb(e), cu_seqlens=cu, initial_state=h, output_final_state=True,
                                          impl="reference"))
  o, fs = f(jnp.zeros(3, jnp.int32), h0)
  assert o.shape == (1, 0, H, V) and o.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(fs), np.asarray(h0))


@pytest.mark.parametrize("case", ["cu_0_0_0_numpy", "rows_B3", "segment_ids_num_segments"])
def test_T0_backward(case):
  """The gradient of initial_state is the final_state cotangent; every other gradient is empty (or zero)."""
  B, kw, N = EMPTY[case]
  e, h0 = empty_inputs(B, N=N)
  raw = cases.make_inputs(5, B=B, T=0, H=H, K=K, V=V, gate="raw", initial_state=False)
  w = jax.random.normal(jax.random.PRNGKey(6), (N, H, K, V))

  def loss(q, k, v, g, beta, h, A_log, dt_bias):
    o, fs = kda.chunk_kda(q, k, v, g, beta, initial_state=h, output_final_state=True, use_gate_in_kernel=True,
                          A_log=A_log, dt_bias=dt_bias, impl="reference", **kw)
    return jnp.sum(o) + jnp.sum(fs * w)

  grads = jax.grad(loss, argnums=tuple(range(8)))(*qkvgb(raw), h0, raw.A_log, raw.dt_bias)
  np.testing.assert_array_equal(np.asarray(grads[5]), np.asarray(w))
  for x, dx in zip(qkvgb(raw) + (h0, raw.A_log, raw.dt_bias), grads):
    assert dx.shape == x.shape
  for dx in grads[:5] + grads[6:]:
    np.testing.assert_array_equal(np.asarray(dx), 0)


def test_T0_pallas():
  e, h0 = empty_inputs(1, N=2)
  o, fs = kda.chunk_kda(*qkvgb(e, np_), cu_seqlens=np.zeros(3, np.int32), initial_state=np_(h0),
                        output_final_state=True, chunk_size=16, impl="pallas")
  assert o.shape == (1, 0, H, V)
  np.testing.assert_array_equal(np.asarray(fs), np.asarray(h0))


@pytest.mark.parametrize("cu", [[0, 0], [0, 0, 0], None], ids=["cu_0_0", "cu_0_0_0", "rows"])
def test_T0_recurrent_kda(cu):
  e, _ = empty_inputs(1 if cu is not None else 2)
  N = len(cu) - 1 if cu is not None else 2
  h0 = np.asarray(0.5 * jax.random.normal(jax.random.PRNGKey(4), (N, H, K, V)))
  o, fs = recurrent_kda(*qkvgb(e, np_), initial_state=h0, output_final_state=True, cu_seqlens=cu)
  assert o.shape == e.v.shape
  np.testing.assert_array_equal(np.asarray(fs), h0)
  dh0 = jax.grad(lambda h: jnp.sum(recurrent_kda(*qkvgb(e), initial_state=h, output_final_state=True,
                                                 cu_seqlens=cu)[1] * 3.0))(jnp.asarray(h0))
  np.testing.assert_array_equal(np.asarray(dh0), 3.0)
