"""Short sequences of a call with states: the recurrence token by token, every sequence at once.

The aligned layout pads each sequence to the chunk, so N one-token sequences with initial or final
states cost N chunks of BT rows (the segmented layout, which packs them, takes no states). In such a
call the sequences of at most L tokens (PipelineConfig.short_len) skip the chunks: L steps of

    S = diag(exp(g_t)) S;   S = S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = scale S^T q_t

over all N sequences at once, state [N, HV, K, V] float32 (step t reads token starts[n] + t of a
short sequence n; elsewhere q, k, g, beta are 0 there and the step leaves S as it is): the stage
kda.stages.short (its kernels, on a GPU and a TPU, keep each state on chip for all its steps,
forward and backward; its reference is jnp, differentiated through a checkpoint per step). The
other sequences run the chunked pipeline on the layout without the short ones (`split`): where the
lengths are traced its aligned length is bounded by T + (T // (L + 1)) * (BT - 1) (a sequence
there has more than L tokens), not T + N * (BT - 1). A chunk of the pipeline costs several states' traffic, the
steps one read and one write of each state.

The long sequences run first: the steps start from the chunks' final states (a short sequence's
is its h0: it is empty there), and a long sequence, whose step inputs are all 0, keeps its state,
so the steps' states are every sequence's final state. Inputs enter the steps masked (a token of no
short sequence reads 0 before any arithmetic), and each sequence's state is its own, so a NaN in one
sequence reaches no other sequence's results or gradients.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kda import shapes
from kda.padding.layout import Layout, aligned_cu_seqlens, make_layout
from kda.stages.gate import activate
from kda.steps import query_keys


def takes(L: int, *, initial_state, output_final_state: bool, N: int) -> bool:
  """Whether a call's short sequences may run the recurrence: L > 0 and states in or out."""
  return L > 0 and N > 0 and (initial_state is not None or bool(output_final_state))


def split(layout: Layout, L: int, lens=None):
  """-> (the layout of the sequences longer than L, the short ones empty there; short [N] bool;
  steps: the static number of recurrence steps; long: whether any sequence is longer than L).
  lens: the lengths as numpy where the caller knows them (concrete cu_seqlens): then steps is the
  longest short sequence's length, the layout's length exact and long a bool; else L, the traced
  bound and long a traced () bool (the caller skips the chunks at run time where it is False)."""
  BT, T = layout.chunk_size, layout.T
  if lens is not None:
    lens = np.asarray(lens)
    short = lens <= L
    rest = np.where(short, 0, lens).astype(np.int32)
    steps = int(lens[short].max()) if short.any() else 0
    return make_layout(layout.starts, rest, T, BT), jnp.asarray(short), steps, bool((~short).any())
  short = layout.lens <= L
  rest = jnp.where(short, 0, layout.lens).astype(jnp.int32)
  longest = min(layout.N, T // (L + 1))          # sequences of more than L tokens among T
  Ta = shapes.round_up(T + longest * (BT - 1), BT) if longest else BT
  return Layout(layout.starts, rest, aligned_cu_seqlens(rest, BT), T, Ta, BT), short, L, jnp.any(~short)


def run(plan, layout: Layout, short, steps: int, q, k, v, g, beta, h0, A_log, dt_bias, exact=True):
  """The recurrence on the short sequences: packed q, k [1, T, H, K], v [1, T, HV, V], g [1, T, HV, K],
  beta [1, T, HV], h0 [N, HV, K, V] -> (o [1, T, HV, V] in v's dtype, 0 at other tokens; the
  tokens it wrote [T] bool; the states after the steps [N, HV, K, V] float32: a long sequence's
  h0 as given, for it takes no step).
  exact=False (steps a bound, the lengths traced): a step no sequence reaches is skipped at run time
  (lax.cond), forward and backward."""
  T, HV = q.shape[1], v.shape[2]
  F32 = jnp.float32
  t = jnp.arange(max(steps, 1), dtype=jnp.int32)
  active = short[:, None] & (t[None] < layout.lens[:, None])            # [N, steps]
  at = jnp.where(active, layout.starts[:, None] + t[None], T)           # T: no token
  # [N, steps, ...]; no token reads an explicit 0 (kda.padding's gathers), never a neighbour's value
  take = lambda x: jnp.take(x[0], at, axis=0, mode="fill", fill_value=0)
  qs, ks = query_keys(plan, take(q), take(k), HV)
  gs = take(g)
  if plan.use_gate_in_kernel:       # the raw 0 keeps activate's derivative finite; its value is dropped
    gs = activate(gs, A_log, dt_bias, use_gate_in_kernel=True, lower_bound=plan.lower_bound)
    gs = jnp.where(active[..., None, None], gs, 0.0)
  qs, ks, gs, vs, bs = (x.astype(F32) for x in (qs, ks, gs, take(v), take(beta)))
  S = h0.astype(F32)
  lens = jnp.where(short, jnp.minimum(layout.lens, steps), 0).astype(jnp.int32)   # a long one takes no step
  xs = tuple(x[:, :steps] for x in (qs, ks, vs, gs, bs))
  o_s, S = (plan.run("short", *xs, S, lens, skip=not exact, **plan.stage_kwargs("short")) if steps
            else (None, S))
  o = jnp.zeros((T,) + v.shape[2:], v.dtype)
  wrote = jnp.zeros((T,), jnp.bool_)
  if steps:
    idx = at[:, :steps].reshape(-1)
    o = o.at[idx].set(o_s.reshape((-1,) + v.shape[2:]).astype(v.dtype), mode="drop")
    wrote = wrote.at[idx].set(True, mode="drop")
  return o[None], wrote, S

