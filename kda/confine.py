"""Non-finite values confined to their sequence where sequences share chunks.

In the segmented layout (kda.padding.pieces) several sequences share a chunk, and the kernels keep
them apart by decays that are exactly 0 across a reset: NaN * 0 is NaN, so a non-finite input of one
sequence would reach its neighbours. `confined` runs such a call on inputs whose non-finite values
are replaced by 0 and marks the sequences that held one:

    o[t]      = NaN                 for every token t of a marked sequence
    d{x}[t]   = NaN                 likewise, for x in q, k, v, g, beta
    o, d{x}   = run(inputs with 0)  everywhere else, bit for bit

A sequence is marked by a non-finite q, k, v or beta, a NaN or +inf gate (-inf is a valid gate)
at one of its tokens (forward), or a non-finite cotangent of o there (backward). Every other sequence gets exactly what the call gives
with the bad values replaced by 0, as its tokens never read another sequence's values; the marked
sequence stays non-finite, so the user sees it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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


def _zero_bad(x, keep_neg_inf=False):
  ok = jnp.isfinite(x) | (x == -jnp.inf) if keep_neg_inf else jnp.isfinite(x)
  return jnp.where(ok, x, jnp.zeros((), x.dtype))


def _poison(mask, x):
  """x with NaN at the marked tokens ([1, T, ...]). A scatter whose indices of unmarked tokens fall
  out of range and are dropped: in place, it writes the marked rows only (usually none), where a
  select would read and write all of x."""
  T = mask.shape[0]
  idx = jnp.where(mask, jnp.arange(T, dtype=jnp.int32), T)
  return x.at[0, idx].set(jnp.full((), jnp.nan, x.dtype), mode="drop", indices_are_sorted=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def confined(run, seqs, q, k, v, g, beta, rest):
  """run(q, k, v, g, beta, *rest) -> (o [1, T, ...], final_state), with the module's confinement;
  seqs: `sequences` of the call; rest (states, gate parameters) passes unchanged."""
  mask, clean = _clean(seqs, q, k, v, g, beta)
  o, final_state = run(*clean, *rest)
  with steps.scope("confine"):
    return _poison(mask, o), final_state


def _clean(seqs, q, k, v, g, beta):
  with steps.scope("confine"):
    mask = _marked(seqs, q, k, v, beta, g=g)
    return mask, (_zero_bad(q), _zero_bad(k), _zero_bad(v), _zero_bad(g, keep_neg_inf=True), _zero_bad(beta))


def _fwd(run, seqs, q, k, v, g, beta, rest):
  mask, clean = _clean(seqs, q, k, v, g, beta)
  (o, final_state), vjp = jax.vjp(run, *clean, *rest)
  with steps.scope("confine"):
    return (_poison(mask, o), final_state), (seqs, mask, vjp)


def _bwd(run, res, cts):
  seqs, mask, vjp = res
  do, dht = cts
  with steps.scope("confine"):
    mask = mask | _marked(seqs, do)
    do = _zero_bad(do)
  grads = vjp((do, dht))
  with steps.scope("confine"):
    return (None, *(_poison(mask, d) for d in grads[:5]), tuple(grads[5:]))


confined.defvjp(_fwd, _bwd)
