"""Non-finite values confined to their sequence where sequences share chunks.

In the segmented layout (kda.padding.pieces) several sequences share a chunk, and the kernels keep
them apart by decays that are exactly 0 across a reset: NaN * 0 is NaN, so a non-finite input of one
sequence would reach its neighbours. `confined` gives such a call this contract:

    o[t]      = NaN                 for every token t of a marked sequence
    d{x}[t]   = NaN                 likewise, for x in q, k, v, g, beta
    o, d{x}   = run(inputs with 0)  everywhere else, bit for bit

A sequence is marked by a non-finite q, k, v or beta, a NaN or +inf gate (-inf is a valid gate:
full decay) at one of its tokens (forward), or a non-finite cotangent of o there (backward). The
marked sequence stays non-finite, so the user sees it.

Reading every input to find the bad values would cost a pass over q, k, v and g on every call, and
cleaning them a copy of each. Instead the call runs on the inputs as given and checks what it
produced: a non-finite input reaches its own token's output (o_t = q_t S_t and S_t holds every
input of token t), so outputs that are all finite mean every input a sequence reads was finite,
and the plain result is the contract's. Only when an output is not finite does the call run again
as run(..., clean=True), marks and all (a loop of at most one pass: on a GPU, one read of its
predicate when it does not run). run cleans its inputs itself, so that its kernels may clean what
they read (then no cleaned copy is held). The backward reruns, forward and backward on the
cleaned inputs and cotangent, only if the cotangent of o is not finite or the inputs were not:
with a probed run, as the backward itself reports it (the cotangent of its probe, from values its
first stage forms at every token anyway: so a program that never uses o, jax.grad of a loss linear
in o, need not compute o for the check), else as the forward's o showed it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kda import steps
from kda.padding.layout import search_right


def sequences(starts, lens, T: int):
  """(seq, starts, ends): seq [T] int32 the sequence of each token of a contiguous layout (N past
  the last sequence's end), starts and ends [N] int32 each sequence's token range."""
  starts = starts.astype(jnp.int32)
  ends = starts + lens.astype(jnp.int32)
  return search_right(ends, jnp.arange(T, dtype=jnp.int32)).astype(jnp.int32), starts, ends


def _marked(seqs, *xs, g=None) -> jax.Array:
  """[T] bool: the tokens of every sequence holding a non-finite value in xs ([1, T, ...] each) or a
  NaN or +inf in the log-space gates g (-inf is a valid gate: full decay)."""
  seq, starts, ends = seqs
  flags = [~jnp.isfinite(x) for x in xs] + ([] if g is None else [jnp.isnan(g) | (g == jnp.inf)])
  bad = functools.reduce(jnp.logical_or, (f.reshape(f.shape[1], -1).any(axis=1) for f in flags))
  # a sequence's tokens are contiguous: its count of bad ones is a difference of the running count
  count = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(bad.astype(jnp.int32))])
  per_seq = jnp.concatenate([count[ends] > count[starts], jnp.zeros((1,), bool)])  # tokens of no sequence: none
  return per_seq[seq]


def _poison(mask, x):
  """x with NaN at the marked tokens ([1, T, ...]). A scatter whose indices of unmarked tokens fall
  out of range and are dropped: in place, it writes the marked rows only."""
  T = mask.shape[0]
  idx = jnp.where(mask, jnp.arange(T, dtype=jnp.int32), T)
  return x.at[0, idx].set(jnp.full((), jnp.nan, x.dtype), mode="drop", indices_are_sorted=True)


def _finite(xs, real=None) -> jax.Array:
  """steps.finite in the confine scope."""
  with steps.scope("confine"):
    return steps.finite(xs, real)


def _mask(seqs, q, k, v, g, beta, *cts):
  """`_marked` of the inputs (and of cts, the cotangent of o)."""
  with steps.scope("confine"):
    return _marked(seqs, q, k, v, beta, *cts, g=g)


def _poisoned(mask, xs):
  with steps.scope("confine"):
    return tuple(_poison(mask, x) for x in xs)


def _unless(ok, xs, slow):
  """xs where ok, else slow() (the same structure). A loop of at most one pass rather than a cond:
  XLA copies an array that a cond's branch returns unchanged, where a loop's carry stays in place."""
  body = lambda carry: (tuple(slow()), jnp.bool_(True))
  return lax.while_loop(lambda carry: ~carry[1], body, (tuple(xs), ok))[0]


def _primal(f, *args):
  return f(*args), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def confined(run, probed, seqs, q, k, v, g, beta, rest):
  """run(q, k, v, g, beta, *rest) -> (o [1, T, ...], final_state), with the module's confinement;
  seqs: `sequences` of the call; rest (states, gate parameters) passes unchanged. The final state is
  passed on unchecked: the segmented layout runs only where the caller drops it. probed: rest's
  last entry is a () float32 probe whose cotangent, in run's backward, is 0 if every input that
  backward read was finite and non-zero otherwise. run(..., clean=True) must give, value and
  gradients, bit for bit run on the inputs with their non-finite values replaced by 0 and -inf
  gates kept (kda.steps.cleaned), its gradients for the cotangent of o cleaned so too."""
  return _forward(run, seqs, (q, k, v, g, beta), rest, _primal)[0]


def _forward(run, seqs, args, rest, call):
  """(run's outputs under the contract, (ok, call's second result for the plain run)), ok whether
  the plain run's o was finite; call is jax.vjp or `_primal`, the same for the rerun, so that both
  trace run alike."""
  (o, final_state), back = call(run, *args, *rest)

  def slow():
    o, final_state = call(functools.partial(run, clean=True), *args, *rest)[0]
    return _poisoned(_mask(seqs, *args), (o,))[0], final_state
  ok = _finite((o,))
  return _unless(ok, (o, final_state), slow), (ok, back)


def _fwd(run, probed, seqs, q, k, v, g, beta, rest):
  out, (ok, back) = _forward(run, seqs, (q, k, v, g, beta), rest, jax.vjp)
  return out, (seqs, (q, k, v, g, beta), rest, None if probed else ok, back)


def _bwd(run, probed, res, cts):
  seqs, args, rest, ok, back = res
  do, dht = cts
  grads = tuple(back(cts))
  if probed:                   # the backward's own report; the probe's cotangent is 0 outward
    ok, grads = grads[-1] == 0, grads[:-1] + (jnp.zeros_like(grads[-1]),)

  def slow():
    again = tuple(jax.vjp(functools.partial(run, clean=True), *args, *rest)[1]((do, dht)))
    mask = _mask(seqs, *args, do)
    if probed:
      again = again[:-1] + (jnp.zeros_like(again[-1]),)
    return _poisoned(mask, again[:5]) + again[5:]
  # finite inputs (as the probe or the forward's o showed) and a finite do leave nothing to confine: reading do
  # is a fifth of reading the gradients, and a gradient that overflows would rerun to the same value.
  # do at tokens of no sequence is never read, whatever it holds.
  seq, starts, _ = seqs
  ok = ok & _finite((do,), real=seq < starts.shape[0])
  grads = _unless(ok, grads, slow)
  return (None, *grads[:5], tuple(grads[5:]))


confined.defvjp(_fwd, _bwd)
