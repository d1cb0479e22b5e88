"""chunk_kda(..., validate=True): bad traced values raise at run time, naming the argument, the first
offending index and the value (kda.validate); good input passes and computes the same result."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from tests import cases

T, H, K = 12, 2, 8     # two sequences [5, 7]


@pytest.fixture(scope="module")
def inp():
  i = cases.make_inputs(0, lens=[5, 7], H=H, K=K, V=K, gate="plain")
  return i._replace(g=jnp.minimum(i.g, 0.0))


def run(inp, *, cu=None, seg=None, num_segments=None, raw=False, **over):
  """Jitted chunk_kda forward + gradient with validate=True; cu / seg traced."""
  args = [over.get(f, getattr(inp, f)) for f in ("q", "k", "v", "g", "beta")]
  kw = dict(validate=True, num_segments=num_segments)
  if raw:
    kw.update(use_gate_in_kernel=True, lower_bound=-5.0)

  def loss(q, k, v, g, beta, cu, seg):
    o, _ = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, segment_ids=seg, **kw)
    return o.astype(jnp.float32).sum()
  cu = inp.cu_seqlens if cu is None and seg is None else cu
  out = jax.jit(jax.value_and_grad(loss))(*args, cu, seg)
  return jax.block_until_ready(out)


def raises(*parts):
  return pytest.raises(Exception, match=".*".join(re.escape(p) for p in parts))


BAD = [
    ("cu_start", dict(cu=jnp.array([1, 5, 12], jnp.int32)), ("cu_seqlens must start at 0", "cu_seqlens[0]=1")),
    ("cu_decreasing", dict(cu=jnp.array([0, 9, 5], jnp.int32)),
     ("cu_seqlens must be non-decreasing", "cu_seqlens[1]=9 > the next entry, 5")),
    ("cu_past_T", dict(cu=jnp.array([0, 5, 13], jnp.int32)), ("cu_seqlens[-1] must be <= T=12", "got 13")),
    ("seg_negative", dict(seg=jnp.array([[1] * 5 + [2] * 6 + [-1]], jnp.int32), num_segments=2),
     ("segment_ids must be >= 0", "segment_ids[0, 11]=-1")),
    ("seg_too_many", dict(seg=jnp.array([[1] * 4 + [2] * 4 + [3] * 4], jnp.int32), num_segments=2),
     ("segment_ids must hold at most N=2 sequences", "got 3")),
    ("q_nan", lambda i: dict(q=i.q.at[0, 7, 1, 3].set(jnp.nan)), ("q must be finite", "q[0, 7, 1, 3]=nan")),
    ("v_inf", lambda i: dict(v=i.v.at[0, 2, 0, 0].set(jnp.inf)), ("v must be finite", "v[0, 2, 0, 0]=inf")),
    ("beta_nan", lambda i: dict(beta=i.beta.at[0, 11, 1].set(jnp.nan)), ("beta must be finite", "beta[0, 11, 1]=nan")),
    ("g_positive", lambda i: dict(g=i.g.at[0, 3, 0, 5].set(0.25)), ("g: gates (log space) must be <= 0", "g[0, 3, 0, 5]=0.25")),
    ("g_nan", lambda i: dict(g=i.g.at[0, 4, 1, 1].set(jnp.nan)), ("g: gates", "g[0, 4, 1, 1]=nan")),
]


@pytest.mark.parametrize("over,parts", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validate_names_argument_index_and_value(inp, over, parts):
  over = over(inp) if callable(over) else over
  with raises(*parts):
    run(inp, **over)


def test_validate_passes_good_input_and_changes_nothing(inp):
  """-inf gates are valid; tokens past cu_seqlens[-1] (never read) may hold NaN."""
  g = inp.g.at[0, 3].set(-jnp.inf)
  q = inp.q.at[0, 11].set(jnp.nan)
  cu = jnp.array([0, 5, 11], jnp.int32)
  val, grads = run(inp, g=g, q=q, cu=cu)
  f = lambda q, g: kda.chunk_kda(q, inp.k, inp.v, g, inp.beta, cu_seqlens=cu)[0].astype(jnp.float32).sum()
  want = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(q, g)
  np.testing.assert_array_equal(np.asarray(val), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(grads), np.asarray(want[1][0]))


def test_validate_activated_gates(inp):
  """With use_gate_in_kernel the raw gate may be positive; only a NaN raw gate is flagged."""
  run(inp, g=inp.g + 3.0, raw=True)
  with raises("g: activated gates must be <= 0", "g[0, 1, 0, 2]=nan"):
    run(inp, g=inp.g.at[0, 1, 0, 2].set(jnp.nan), raw=True)
