"""kda.reference.recurrent_kda against an independent float64 numpy token loop (tiny shapes)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.reference import recurrent_kda
from tests import cases

# float32 math with HIGHEST precision over <= 20 tokens and K <= 8 terms per dot: measured max
# relative error vs float64 ~1e-7; 2e-6 leaves headroom without hiding a wrong formula.
F32_TOL = dict(atol=2e-6, rtol=2e-6)


def numpy_kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
  """The recurrence of docs/api.md, one sequence and one value head at a time, in float64.

  q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV] -> (o [B,T,HV,V], final [N,HV,K,V]).
  """
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  q, k, v, g, beta = (f64(x) for x in (q, k, v, g, beta))
  B, T, H, K = q.shape
  HV, V = v.shape[2:]
  scale = K ** -0.5 if scale is None else scale
  if cu_seqlens is None:
    bounds = [(b, 0, T) for b in range(B)]
  else:
    cu = np.asarray(cu_seqlens)
    bounds = [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
  N = len(bounds)
  h0 = np.zeros((N, HV, K, V)) if initial_state is None else f64(initial_state)
  o = np.zeros((B, T, HV, V))
  final = np.zeros((N, HV, K, V))
  for n, (b, bos, eos) in enumerate(bounds):
    for j in range(HV):
      i = j // (HV // H)
      S = h0[n, j].copy()
      for t in range(bos, eos):
        S = np.exp(g[b, t, j])[:, None] * S
        kt = k[b, t, i]
        S = S + beta[b, t, j] * np.outer(kt, v[b, t, j] - kt @ S)
        o[b, t, j] = scale * q[b, t, i] @ S
      final[n, j] = S
  return o, final


@functools.lru_cache(maxsize=None)
def _jitted(output_final_state, scale=None, with_cu=True, with_h0=True):
  def f(q, k, v, g, beta, h0, cu):
    return recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0 if with_h0 else None,
                         output_final_state=output_final_state, cu_seqlens=cu if with_cu else None)
  return jax.jit(f)


def _run(inp, *, output_final_state=True, scale=None, with_cu=True, with_h0=True):
  fn = _jitted(output_final_state, scale, with_cu, with_h0)
  return fn(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state if with_h0 else None,
            inp.cu_seqlens if with_cu else None)


def _check(inp, o, final, *, tol=F32_TOL, scale=None, with_cu=True, with_h0=True):
  want_o, want_s = numpy_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=scale,
                             initial_state=inp.initial_state if with_h0 else None,
                             cu_seqlens=inp.cu_seqlens if with_cu else None)
  cases.report_close("o", o, want_o, **tol)
  if final is not None:
    cases.report_close("final_state", final, want_s, **tol)
  return want_o, want_s


# T = 17, N = 4 everywhere below where the case allows: one shape, so the compiles are shared
@pytest.mark.parametrize("lens", [[5, 0, 9, 3], [0, 7, 4, 6], [6, 11, 0, 0]],
                         ids=["inner_empty", "leading_empty", "trailing_empty"])
def test_varlen_with_empty_sequences_and_states(lens):
  inp = cases.make_inputs(1, lens=lens, H=2, K=8, V=6)
  o, final = _run(inp)
  assert o.shape == inp.v.shape and o.dtype == jnp.float32
  assert final.shape == (len(lens), 2, 8, 6) and final.dtype == jnp.float32
  _check(inp, o, final)
  for n, L in enumerate(lens):   # an empty sequence hands its initial state straight back
    if L == 0:
      np.testing.assert_array_equal(np.asarray(final[n]), np.asarray(inp.initial_state[n]))


def test_sequences_are_independent():
  """Changing one sequence's tokens or initial state leaves the others' outputs and states alone."""
  lens = [6, 8, 0, 3]
  inp = cases.make_inputs(2, lens=lens, H=2, K=8, V=6)
  o, final = _run(inp)
  sl = slice(6, 14)
  inp2 = inp._replace(v=inp.v.at[:, sl].multiply(-3.0), initial_state=inp.initial_state.at[1].add(1.0))
  o2, final2 = _run(inp2)
  np.testing.assert_array_equal(np.asarray(o2[:, :6]), np.asarray(o[:, :6]))
  np.testing.assert_array_equal(np.asarray(o2[:, 14:]), np.asarray(o[:, 14:]))
  for n in (0, 2, 3):
    np.testing.assert_array_equal(np.asarray(final2[n]), np.asarray(final[n]))
  assert not np.allclose(np.asarray(o2[:, sl]), np.asarray(o[:, sl]))


def test_no_initial_state_and_custom_scale():
  inp = cases.make_inputs(3, lens=[7, 4, 0, 6], H=2, K=8, V=6, initial_state=False)
  o, final = _run(inp, scale=0.3, with_h0=False)
  _check(inp, o, final, scale=0.3, with_h0=False)


def test_final_state_is_none_unless_requested():
  inp = cases.make_inputs(4, lens=[7, 4, 3, 3], H=2, K=8, V=6)
  o, final = _run(inp, output_final_state=False)
  assert final is None
  _check(inp, o, None)


def test_gva():
  # H = 2 tells value head j // 2 (FLA) from j % 2; H = 1 could not
  H, HV = 2, 4
  inp = cases.make_inputs(5, lens=[6, 9], H=H, HV=HV, K=8, V=6)
  o, final = _run(inp)
  assert o.shape == (1, 15, HV, 6) and final.shape == (2, HV, 8, 6)
  _check(inp, o, final)


def test_tokens_past_cu_seqlens_are_zero_and_never_read():
  # make_inputs poisons the 5 tail tokens of every input with NaN
  inp = cases.make_inputs(6, lens=[6, 0, 9], H=2, K=8, V=6, extra_T=5)
  assert np.isnan(np.asarray(inp.q[0, 15:])).all()
  o, final = _run(inp)
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final)).all()
  np.testing.assert_array_equal(np.asarray(o[0, 15:]), 0.0)
  head = inp._replace(**{f: getattr(inp, f)[:, :15] for f in ("q", "k", "v", "g", "beta")})
  _check(head, o[:, :15], final)


def test_batch_rows_without_cu_seqlens():
  inp = cases.make_inputs(7, B=3, T=7, H=2, K=8, V=6)
  assert inp.initial_state.shape[0] == 3
  o, final = _run(inp, with_cu=False)
  assert o.shape == (3, 7, 2, 6) and final.shape == (3, 2, 8, 6)
  _check(inp, o, final, with_cu=False)


def test_bf16_inputs_give_bf16_output():
  inp = cases.make_inputs(8, lens=[6, 9], H=2, K=8, V=6, dtype=jnp.bfloat16)
  o, final = _run(inp)
  assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  # the float64 loop reads the same bf16-rounded inputs; o is then rounded once to bf16 (unit
  # roundoff 2^-8 relative), final_state stays float32 (float32 tolerance)
  want_o, want_s = numpy_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.initial_state,
                             cu_seqlens=inp.cu_seqlens)
  cases.report_close("o", o, want_o, atol=1e-6, rtol=2.0 ** -8)
  cases.report_close("final_state", final, want_s, **F32_TOL)
