"""Any gate <= 0, -inf and huge magnitudes included, gets the recurrence's answer (docs/api.md).

A gate of -inf forgets its channel of the state (exp(-inf) = 0; the recurrence stays finite), and a
huge finite one does the same in float32. The chunked pipeline must agree with the recurrence to
float32 accuracy, forward and gradients, on every implementation: a single float32 chunk cumsum
turned one -inf into NaN for the whole sequence and lost ulp(|gc|) of every decay after a -1e4 gate
(3e-4 relative); the gate stage now floors gates at -128 and carries the cumsum in two exact parts.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda import stages
from kda.api import chunk_kda_with
from tests import cases
from tests.stages.test_gate import EXTREMES

LENS = [30, 64, 1, 70]   # boundaries inside and at chunk edges, a 1-token sequence; a NaN tail after
BT = 32
F32_TOL = 1e-5            # the contract: float32 accuracy, relative to the largest value
BF16_TOL = 2e-2           # bf16 inputs: o is rounded once to bf16 (2^-8) on top of bf16 dot operands


def _gates(g, pattern, seed=1):
  """The log-space gates g [1, T, HV, K] with `pattern` written over the real tokens."""
  g = np.array(jnp.asarray(g, jnp.float32))
  T, K = sum(LENS), g.shape[-1]
  r = np.random.RandomState(seed)
  if pattern == "one_inf":            # one token forgets half its channels
    g[0, 40, :, :K // 2] = -np.inf
  elif pattern in ("-1e3", "-1e4", "-1e5"):
    g[0, 100, :, :] = float(pattern)
  elif pattern == "sprinkled":        # 15% of entries: -inf, -1e30 ... -30, around the floor
    hit = np.zeros(g.shape, bool)
    hit[0, :T] = r.rand(T, *g.shape[2:]) < 0.15
    g[hit] = r.choice(EXTREMES, size=int(hit.sum()))
  elif pattern == "all_inf":
    g[0, :T] = -np.inf
  else:
    raise ValueError(pattern)
  return jnp.asarray(g)


@functools.lru_cache(maxsize=None)
def _inputs(dtype_name="float32"):
  return cases.make_inputs(7, lens=LENS, H=2, K=16, V=16, extra_T=5, dtype=jnp.dtype(dtype_name))


def _call(inp, g, impl, **kw):
  return kda.chunk_kda(inp.q, inp.k, inp.v, g, inp.beta, initial_state=inp.initial_state,
                       output_final_state=True, cu_seqlens=inp.cu_seqlens, chunk_size=BT, impl=impl, **kw)


def _recurrence(inp, g):
  return kda.reference.recurrent_kda(inp.q, inp.k, inp.v, g, inp.beta, initial_state=inp.initial_state,
                                     output_final_state=True, cu_seqlens=inp.cu_seqlens)


def _close(name, got, want, tol):
  got, want = np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(jnp.asarray(want, jnp.float32))
  owned = np.isfinite(want)           # the recurrence's o past cu_seqlens[-1] is 0, ours too
  assert np.all(np.isfinite(got)), f"{name}: not finite"
  err = cases.rel_err(got[owned], want[owned])
  assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
  return err


PATTERNS = ["one_inf", "-1e3", "-1e4", "-1e5", "sprinkled", "all_inf"]


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_forward_f32(pattern, impl):
  inp = _inputs()
  g = _gates(inp.g, pattern)
  o, S = _call(inp, g, impl)
  want_o, want_S = _recurrence(inp, g)
  T = sum(LENS)
  _close("o", o[:, :T], want_o[:, :T], F32_TOL)
  _close("final_state", S, want_S, F32_TOL)
  assert not np.any(np.asarray(o[:, T:])), "tokens of no sequence are not 0"


def _loss(o, S):
  w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
  return jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * w) + 0.3 * jnp.sum(S)


ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def _grads(fn, inp, g):
  args = (inp.q, inp.k, inp.v, g, inp.beta, inp.initial_state)
  return jax.grad(lambda *a: _loss(*fn(*a)), argnums=tuple(range(6)))(*args)


def _grad_case(pattern, fn):
  inp = _inputs()
  g = _gates(inp.g, pattern)
  cu = inp.cu_seqlens
  rec = lambda q, k, v, g, b, h0: kda.reference.recurrent_kda(q, k, v, g, b, initial_state=h0,
                                                                 output_final_state=True, cu_seqlens=cu)
  want = _grads(rec, inp, g)
  got = _grads(fn, inp, g)
  T = sum(LENS)
  for name, a, b in zip(ARGS, got, want):
    a, b = (x[:, :T] if name != "initial_state" else x for x in (a, b))
    _close(f"d{name}", a, b, F32_TOL)
  dg = np.asarray(got[3])
  assert not np.any(dg[np.isneginf(np.asarray(g))]), "the gradient at a -inf gate is not exactly 0"


@pytest.mark.parametrize("pattern", ["one_inf", "-1e4", "sprinkled", "all_inf"])
def test_gradients_f32(pattern):
  cu = _inputs().cu_seqlens
  fn = lambda q, k, v, g, b, h0: kda.chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, chunk_size=BT, impl="reference")
  _grad_case(pattern, fn)


def test_gradients_f32_kernel_forward():
  """impl="pallas": kernels where a stage has one (the forward; interpret mode here), the staged
  backward's references after."""
  cu = _inputs().cu_seqlens
  fn = lambda q, k, v, g, b, h0: kda.chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, chunk_size=BT, impl="pallas")
  _grad_case("sprinkled", fn)


def test_gradients_f32_autodiff_path():
  """JAX autodiff through the forward references (the check path of the staged backward)."""
  cu = _inputs().cu_seqlens
  fn = lambda q, k, v, g, b, h0: chunk_kda_with(q, k, v, g, b, backward="autodiff", initial_state=h0,
                                                 output_final_state=True, cu_seqlens=cu, chunk_size=BT,
                                                 impl="reference")
  _grad_case("sprinkled", fn)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_forward_and_gradients_every_pattern(dtype):
  """impl="xla" (the CPU default; its intra stages factor each decay into two exps of non-positive
  exponents): o, final state and every gradient against the recurrence for each pattern, finite, float32
  to the contract's F32_TOL, bf16 inputs to one bf16 rounding.
  One compile of each side serves every pattern (the gates are an argument)."""
  inp = _inputs(dtype)
  cu, T = inp.cu_seqlens, sum(LENS)

  def both(fn):
    def run(q, k, v, g, b, h0):
      out = fn(q, k, v, g, b, h0)
      return out, jax.grad(lambda *a: _loss(*fn(*a)), argnums=tuple(range(6)))(q, k, v, g, b, h0)
    return jax.jit(run)

  xla = both(lambda q, k, v, g, b, h0: kda.chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                     cu_seqlens=cu, chunk_size=BT, impl="xla"))
  rec = both(lambda q, k, v, g, b, h0: kda.reference.recurrent_kda(q, k, v, g, b, initial_state=h0,
                                                                   output_final_state=True, cu_seqlens=cu))
  # bf16 inputs: the xla stages compute in float32 from the (exactly upcast) bf16 values, as the
  # recurrence does, and round o and each gradient once to bf16: <= 2^-8 of each value (measured
  # <= 1.2e-4 of the max, dv with sprinkled gates)
  tol = F32_TOL if dtype == "float32" else 2.0 ** -8
  for pattern in PATTERNS:
    g = _gates(inp.g, pattern)
    args = (inp.q, inp.k, inp.v, g, inp.beta, inp.initial_state)
    (o, S), got = xla(*args)
    (want_o, want_S), want = rec(*args)
    _close(f"{pattern} o", o[:, :T], want_o[:, :T], tol)
    _close(f"{pattern} final_state", S, want_S, tol)
    for name, a, b in zip(ARGS, got, want):
      a, b = (x[:, :T] if name != "initial_state" else x for x in (a, b))
      _close(f"{pattern} d{name}", a, b, tol)
    assert not np.any(np.asarray(got[3])[np.isneginf(np.asarray(g))]), "a -inf gate's gradient is not 0"


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_bf16_never_nan(impl):
  """bf16 q/k/v/beta, float32 gates with -inf and huge values: finite, within bf16 error."""
  inp = _inputs("bfloat16")
  g = _gates(inp.g, "sprinkled")
  o, S = _call(inp, g, impl)
  want_o, want_S = _recurrence(inp, g)
  T = sum(LENS)
  _close("o", o[:, :T], want_o[:, :T], BF16_TOL)
  _close("final_state", S, want_S, BF16_TOL)
  impl = impl if impl == "reference" else {n: impl for n in stages.FORWARD}
  grads = jax.grad(lambda q, g: _loss(*_call(inp._replace(q=q), g, impl)), argnums=(0, 1))(inp.q, g)
  for name, x in zip(("dq", "dg"), grads):
    assert bool(jnp.all(jnp.isfinite(x[:, :T]))), f"{name} is not finite"


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_gate_in_kernel_extremes(impl):
  """Raw gates of +inf (softplus -> an activated -inf), huge raw values and a large A_log (activated
  gates of -1e5): the recurrence on the activated gates, forward; gradients finite and equal where
  the recurrence's own are defined (raw +inf gives it -inf * 0 = NaN for A_log)."""
  inp = _inputs()
  raw = np.array(inp.g)
  T = sum(LENS)
  raw[0, 40, :, :5] = np.inf
  raw[0, 90, :, :] = 1e4
  A_log = inp.A_log if inp.A_log is not None else jnp.zeros((2,))
  A_log = jnp.asarray(A_log).at[1].set(12.0)          # exp(12) * softplus(x): gates down to ~-1e5
  raw = jnp.asarray(raw)
  kw = dict(use_gate_in_kernel=True, A_log=A_log)
  o, S = _call(inp, raw, impl, **kw)
  g_act = kda.stages.gate.activate(raw, A_log, None, use_gate_in_kernel=True, lower_bound=None)
  assert float(jnp.min(g_act[:, :T])) == -np.inf
  want_o, want_S = _recurrence(inp, g_act)
  _close("o", o[:, :T], want_o[:, :T], F32_TOL)
  _close("final_state", S, want_S, F32_TOL)
  impl = impl if impl == "reference" else {n: impl for n in stages.FORWARD}
  grads = jax.grad(lambda g, a: _loss(*_call(inp, g, impl, use_gate_in_kernel=True, A_log=a)),
                   argnums=(0, 1))(raw, A_log)
  for name, x in zip(("dg", "dA_log"), grads):
    assert bool(jnp.all(jnp.isfinite(x[:, :T] if name == "dg" else x))), f"{name} is not finite"
  assert not np.any(np.asarray(grads[0])[0, 40, :, :5]), "raw +inf gate: gradient is not 0"


def test_lower_bound_gate_with_infinite_raw_gates():
  """lower_bound * sigmoid(exp(A_log) * x) with raw gates of +-inf: sigmoid saturates, so their
  A_log and dt_bias gradients are the limit 0 (z * s (1 - s) -> 0), not inf * 0 = NaN. Every
  gradient is finite and equal to that with raw gates of +-1e30 (which saturate the same in float32)."""
  inp = _inputs()
  raw = np.array(inp.g)
  raw[0, 40, :, :5] = np.inf
  raw[0, 41, :, 3:9] = -np.inf
  big = np.where(np.isinf(raw), np.sign(raw) * 1e30, raw)
  A_log = jnp.asarray([0.5, -1.0])
  kw = dict(use_gate_in_kernel=True, lower_bound=-5.0)

  def grads(g):
    loss = lambda g, a: _loss(*_call(inp, g, "reference", A_log=a, **kw))
    return jax.grad(loss, argnums=(0, 1))(jnp.asarray(g), A_log)

  got, want = grads(raw), grads(big)
  for name, x, w in zip(("dg", "dA_log"), got, want):
    x, w = np.asarray(x), np.asarray(w)
    assert np.all(np.isfinite(x)), f"{name} is not finite"
    np.testing.assert_allclose(x, w, rtol=1e-6, atol=1e-6 * np.abs(w).max(), err_msg=name)
