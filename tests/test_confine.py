"""kda.confine on its own, with a run that leaks like the segmented kernels (a NaN anywhere reaches
every token through a product with 0): the run's result as it is when every output is finite (one
run), the contract when not (a second run on cleaned inputs, the bad sequence NaN), and the same
for the backward."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import confine, steps

LENS = np.array([5, 0, 3, 1, 7], np.int32)
T = 20                                           # 16 tokens of sequences, a tail of 4
H, K = 2, 3
STARTS = np.concatenate([[0], np.cumsum(LENS)[:-1]]).astype(np.int32)
BAD_SEQ = 2                                      # the third sequence, at its second token


def _leaky(counter):
  """run(q, k, v, g, beta, h0) -> (o [1, T, H, K], final_state): at tokens of a sequence each token's
  own terms plus 0 times a sum over every token of one (a NaN there reaches every o), 0 at tokens of
  none (like the kernels: their inputs and the cotangent there are never read); counter counts the
  runs executed."""
  real = jnp.asarray(np.arange(T) < LENS.sum())[None, :, None, None]

  def run(q, k, v, g, beta, h0, clean=False):
    if clean:
      q, k, v, g, beta = steps.cleaned(q, k, v, g, beta)
    jax.debug.callback(counter.append, 1)
    own = jnp.where(real, q * k + v * jnp.exp(g) + beta[..., None], 0.0)
    o = jnp.where(real, own + 0.0 * jnp.sum(own), 0.0)
    return (steps.clean_cotangent(o) if clean else o), h0 * jnp.exp(jnp.sum(g))
  return run


def _inputs():
  r = np.random.default_rng(0)
  x = [jnp.asarray(r.standard_normal((1, T, H, K)), jnp.float32) for _ in range(3)]
  g = jnp.asarray(-np.abs(r.standard_normal((1, T, H, K))) / 4, jnp.float32)
  beta = jnp.asarray(r.uniform(0.1, 0.9, (1, T, H)), jnp.float32)
  return (*x, g, beta), jnp.asarray(r.standard_normal((1, T, H, K)), jnp.float32)


def _probed(run):
  """run with a probe last: its cotangent is 0 where the inputs at tokens of a sequence were all
  finite, else 1 (what kda's staged backward reports)."""
  real = jnp.asarray(np.arange(T) < LENS.sum())

  def probed(clean):
    @jax.custom_vjp
    def f(q, k, v, g, beta, h0, probe):
      return run(q, k, v, g, beta, h0, clean=clean)

    def fwd(*x):
      out, back = jax.vjp(functools.partial(run, clean=clean), *x[:6])
      return out, (x[:5], back)

    def bwd(res, cts):
      x, back = res
      ok = jnp.all(jnp.stack([jnp.isfinite(a[0][real]).all() for a in x]))
      return (*back(cts), jnp.where(ok, 0.0, 1.0))
    f.defvjp(fwd, bwd)
    return f
  fs = {False: probed(False), True: probed(True)}
  return lambda *x, clean=False: fs[clean](*x)


def _call(counter, probed=False):
  """jit: (inputs, do) -> (o, gradients of q, k, v, g, beta) through confine.confined; probed: the
  run reports its inputs' finiteness through a probe's cotangent."""
  run = _leaky(counter)
  seqs = confine.sequences(jnp.asarray(STARTS), jnp.asarray(LENS), T)
  h0 = jnp.zeros((2, H, K), jnp.float32)
  rest = (h0, jnp.zeros((), jnp.float32)) if probed else (h0,)
  run = _probed(run) if probed else run

  def f(x, do):
    fwd = lambda *x: confine.confined(run, probed, seqs, *x, rest)[0]
    o, vjp = jax.vjp(fwd, *x)
    return o, vjp(do)
  return jax.jit(f)


@pytest.mark.parametrize("probed", [False, True])
@pytest.mark.parametrize("where", ["none", "v", "g", "do", "do-tail", "q-tail"])
def test_reruns_only_for_a_non_finite_value(where, probed):
  x, do = _inputs()
  t = T - 2 if where.endswith("-tail") else STARTS[BAD_SEQ] + 1   # a token of no sequence, or of one
  where, tail = where.removesuffix("-tail"), where.endswith("-tail")
  lo, hi = STARTS[BAD_SEQ], STARTS[BAD_SEQ] + LENS[BAD_SEQ]

  def put(value):
    xs, d = list(x), do
    if where == "do":
      d = d.at[0, t].set(value)
    elif where != "none":
      i = "q k v g beta".split().index(where)
      xs[i] = xs[i].at[0, t].set(value)
    return xs, d

  counter = []
  o, grads = jax.block_until_ready(_call(counter, probed)(*put(jnp.nan)))
  runs = len(counter)
  # the plain run, once, for the run with the value replaced by 0 (nothing to confine)
  counter0 = []
  o0, grads0 = jax.block_until_ready(_call(counter0, probed)(*put(0.0)))
  assert len(counter0) == 1
  # a bad input: the plain run, the forward's rerun and the backward's (its residuals must be clean
  # too); a bad cotangent: the plain run and the backward's
  assert runs == (1 if tail else {"none": 1, "do": 2}.get(where, 3))
  if tail:      # a value at a token of no sequence is never read: the plain run, as with 0 there
    for name, a, b in [("o", o, o0)] + list(zip("q k v g beta".split(), grads, grads0)):
      np.testing.assert_array_equal(np.asarray(a)[:, :T - 2], np.asarray(b)[:, :T - 2], err_msg=name)
    return
  keep = np.r_[0:lo, hi:T]
  for name, a, b in [("o", o, o0)] + list(zip("q k v g beta".split(), grads, grads0)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a[:, keep]).all(), name
    if where == "none":
      np.testing.assert_array_equal(a, b, err_msg=name)
    else:   # jnp ops in a loop body may fuse (and round) apart from the plain run's; kernels do not
      np.testing.assert_allclose(a[:, keep], b[:, keep], rtol=1e-6, atol=1e-7, err_msg=name)
  if where != "none":
    assert np.isnan(np.asarray(grads[0])[:, lo:hi]).all()
    assert np.isnan(np.asarray(o)[:, lo:hi]).all() == (where != "do")


@pytest.mark.large      # four lowerings for an H200 (~60 s on a 2-core machine)
def test_confined_grad_drops_the_forward_output_kernel_as_the_plain_program_does():
  """Under jax.grad of a loss linear in o, JAX drops the kernel that computes the dead o from the
  plain program, and from the confined one too: its backward decides on the probe S0's kernel
  reports, not on o. With value_and_grad both programs hold that kernel."""
  from tools import confine_cost
  found = confine_cost.lowered_kernels("B", 4096)
  assert "kda_state_output" not in found[("plain", "grad")]
  assert found[("plain", "value_and_grad")]["kda_state_output"] == 1
  # the backward's rerun (forward and backward on the cleaned inputs) keeps one in its loop body
  assert found[("confined", "grad")]["kda_state_output"] == 1
  assert found[("confined", "value_and_grad")]["kda_state_output"] == 2
  # the rerun lives in the same program: every kernel of the plain call appears there too
  assert set(found[("plain", "value_and_grad")]) <= set(found[("confined", "grad")])
