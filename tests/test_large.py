"""Larger cases, skipped by default (run with `pytest -m large`): K = V = 128, a seeded random
length profile with every boundary kind, long enough for many chunks per sequence.

Tolerances are the end-to-end ones of test_pipeline / test_grad (float32: the chunked form only
reassociates sums; the references compute in float32 at HIGHEST precision).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda.reference import recurrent_kda
from tests import cases

pytestmark = pytest.mark.large

LENS = [1, 63, 64, 65, 700, 0, 129, 300, 2]     # T = 1324 real tokens + a poisoned tail


def _inputs(seed, **kw):
  return cases.make_inputs(seed, lens=LENS, H=2, HV=4, K=128, V=128, extra_T=20, **kw)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_forward_matches_recurrence_large(impl):
  inp = _inputs(0)
  f = jax.jit(lambda i: kda.chunk_kda(i.q, i.k, i.v, i.g, i.beta, initial_state=i.initial_state,
                                      output_final_state=True, cu_seqlens=i.cu_seqlens, impl=impl))
  o, s = f(inp)
  o_r, s_r = jax.jit(lambda i: recurrent_kda(i.q, i.k, i.v, i.g, i.beta, initial_state=i.initial_state,
                                              output_final_state=True, cu_seqlens=i.cu_seqlens))(inp)
  scale_o, scale_s = float(jnp.max(jnp.abs(o_r))), float(jnp.max(jnp.abs(s_r)))
  cases.report_close(f"o ({impl})", o, o_r, atol=2e-5 * scale_o, rtol=2e-5)
  cases.report_close(f"final_state ({impl})", s, s_r, atol=2e-5 * scale_s, rtol=2e-5)
  assert float(jnp.max(jnp.abs(o[:, sum(LENS):]))) == 0.0


def test_gradients_match_recurrence_large():
  inp = _inputs(1, gate="raw")
  Wo = jax.random.normal(jax.random.PRNGKey(5), inp.v.shape)
  Wh = jax.random.normal(jax.random.PRNGKey(6), inp.initial_state.shape)
  real = (jnp.arange(inp.q.shape[1]) < sum(LENS))[None, :, None, None]
  clean = lambda x: jnp.where(real if x.ndim == 4 else real[..., 0], x, 0)   # recurrence sees no NaN

  def loss_kda(p):
    o, s = kda.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["h0"],
                         output_final_state=True, cu_seqlens=inp.cu_seqlens, use_gate_in_kernel=True,
                         A_log=p["A_log"], dt_bias=p["dt_bias"])
    return jnp.sum(o * Wo) + jnp.sum(s * Wh)

  def loss_rec(p):
    from kda.stages.gate import activate
    g = activate(clean(p["g"]), p["A_log"], p["dt_bias"], use_gate_in_kernel=True, lower_bound=None)
    o, s = recurrent_kda(clean(p["q"]), clean(p["k"]), clean(p["v"]), g, clean(p["beta"]),
                         initial_state=p["h0"], output_final_state=True, cu_seqlens=inp.cu_seqlens)
    return jnp.sum(o * Wo) + jnp.sum(s * Wh)

  p = dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta, h0=inp.initial_state, A_log=inp.A_log,
           dt_bias=inp.dt_bias)
  got = jax.jit(jax.grad(loss_kda))(p)
  want = jax.jit(jax.grad(loss_rec))(p)
  for name in p:
    w = want[name]
    if w.ndim >= 3 and w.shape[1] == inp.q.shape[1]:
      w = clean(w)
    scale = float(jnp.max(jnp.abs(w)))
    # dg sums cancelling terms over long chunks (see test_grad's strong-gate note): 1e-4 of the max
    cases.report_close(f"d{name}", got[name], w, atol=1e-4 * scale, rtol=1e-4)
  for name in ("q", "k", "v", "g", "beta"):
    assert float(jnp.max(jnp.abs(got[name][:, sum(LENS):]))) == 0.0, f"d{name} leaks into the tail"
  assert np.isfinite(np.asarray(got["q"])).all()
