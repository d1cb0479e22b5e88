"""A non-finite input confined to its sequence (impl="xla", the CPU default, and impl="reference").

A NaN in q, k, v, g or beta at one token of one sequence leaves every other sequence's o, final
state and gradients (q, k, v, g, beta at its tokens, its initial state's) finite and bit-identical to
the run where that value is 0, while the bad sequence stays non-finite (nothing sanitises it). On the
aligned layout every sequence owns its chunks, so this holds where every stage masks with selects,
never by multiplying with 0, and the state entering a sequence is its initial state by a select.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from tests import cases

LENS = [40, 1, 37, 0, 16]        # several chunks, a 1-token and an empty sequence, partial chunks
BT = 16
BAD_SEQ, BAD_TOKEN = 2, 21       # token 21 of the third sequence (its second chunk)
FIELDS = ("q", "k", "v", "g", "beta")


@functools.lru_cache(maxsize=None)
def _inputs():
  inp = cases.make_inputs(3, lens=LENS, H=2, K=16, V=16)
  keys = jax.random.split(jax.random.PRNGKey(4), 2)
  Wo = jax.random.normal(keys[0], inp.v.shape)
  Wh = jax.random.normal(keys[1], inp.initial_state.shape)
  return inp, Wo, Wh


@functools.lru_cache(maxsize=None)
def _run(impl):
  """jit: (q, k, v, g, beta, h0) -> (o, final_state, gradients of sum(o Wo) + sum(final Wh))."""
  inp, Wo, Wh = _inputs()

  def forward(*x):
    return kda.chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=inp.cu_seqlens,
                         chunk_size=BT, impl=impl)

  def loss(*x):
    o, s = forward(*x)
    return jnp.sum(o * Wo) + jnp.sum(s * Wh)

  return jax.jit(lambda *x: (*forward(*x), jax.grad(loss, argnums=tuple(range(6)))(*x)))


def _with(inp, field, value):
  x = getattr(inp, field)
  t = int(np.asarray(inp.cu_seqlens)[BAD_SEQ]) + BAD_TOKEN
  return inp._replace(**{field: x.at[0, t].set(value)})


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("field", FIELDS)
def test_nan_stays_in_its_sequence(field, impl):
  inp, _, _ = _inputs()
  run = _run(impl)
  args = lambda x: (x.q, x.k, x.v, x.g, x.beta, x.initial_state)
  bad = run(*args(_with(inp, field, jnp.nan)))
  ok = run(*args(_with(inp, field, 0.0)))
  cu = np.asarray(inp.cu_seqlens)
  mine = np.zeros(cu[-1], bool)
  mine[cu[BAD_SEQ]:cu[BAD_SEQ + 1]] = True
  others = np.flatnonzero(np.arange(len(LENS)) != BAD_SEQ)
  (o, s, grads), (o0, s0, grads0) = bad, ok
  per_token = [("o", o, o0)] + [(f"d{n}", a, b) for n, a, b in zip(FIELDS, grads[:5], grads0[:5])]
  for name, a, b in per_token:
    a, b = np.asarray(a)[0, ~mine], np.asarray(b)[0, ~mine]
    assert np.all(np.isfinite(a)), f"{field} NaN: {name} not finite outside its sequence"
    np.testing.assert_array_equal(a, b, err_msg=f"{field} NaN: {name} changed outside its sequence")
  for name, a, b in (("final_state", s, s0), ("dinitial_state", grads[5], grads0[5])):
    a, b = np.asarray(a)[others], np.asarray(b)[others]
    assert np.all(np.isfinite(a)), f"{field} NaN: {name} of another sequence not finite"
    np.testing.assert_array_equal(a, b, err_msg=f"{field} NaN: {name} of another sequence changed")
  # the bad sequence is not sanitised: its outputs and its gradients carry the NaN
  assert not (np.all(np.isfinite(np.asarray(o)[0, mine])) and np.all(np.isfinite(np.asarray(s)[BAD_SEQ])))
  assert not all(np.all(np.isfinite(np.asarray(d)[0, mine])) for d in grads[:5])
