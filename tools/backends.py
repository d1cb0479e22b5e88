"""python -m tools.backends: which backend each stage of one chunk_kda call runs, and why not another.

Traces the call (its forward, and by default jax.grad of it) with jax.make_jaxpr on abstract inputs:
nothing is compiled or run, so it takes seconds even for large shapes, and on any machine. For each
stage and fused group it prints the backend that runs and, before it, every backend whose predicate
refused the call with the predicate's reason (kda.plan.recording), after the aligned layout's
length (each sequence padded to the chunk: what many sequences with states cost, past the short ones
that run the recurrence). The backends are this machine's (a GPU's on a GPU); `--impl mosaic_gpu`
on a CPU shows what the Mosaic GPU predicates take, as the simulator would run it.

  python -m tools.backends [--seq-lens 100,50 | --many 200000x1] [--heads 1] [--head-dim 64]
      [--value-dim V] [--dtype bfloat16] [--states] [--raw-gate] [--chunk-size 64] [--impl auto]
      [--no-bwd]
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kda
from kda import padding, plan as planning
from tools.trace import parse_lens


def lens_of(seq_lens: str, many: str | None) -> list[int]:
  """--many NxL (N sequences of L tokens) or --seq-lens a,b,c."""
  if many:
    n, _, length = many.partition("x")
    if not (n.isdigit() and length.isdigit()):
      raise ValueError(f"--many must look like 200000x1 (sequences x tokens), got {many!r}")
    return [int(length)] * int(n)
  return parse_lens(seq_lens)


def choices(lens, *, heads, K, V, dtype, states, raw_gate, chunk_size, impl, backward):
  """The kda.plan.Choice list of tracing the call (and, with backward, jax.grad of it)."""
  T, N = int(sum(lens)), len(lens)
  S = jax.ShapeDtypeStruct
  qk, vv = S((1, T, heads, K), dtype), S((1, T, heads, V), dtype)
  g, beta, h0 = S((1, T, heads, K), jnp.float32), S((1, T, heads), dtype), S((N, heads, K, V), jnp.float32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  extra = dict(A_log=S((heads,), jnp.float32), dt_bias=S((heads * K,), jnp.float32)) if raw_gate else {}

  def loss(q, k, v, g, beta, h0, extra):
    o, ht = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0 if states else None,
                          output_final_state=states, use_gate_in_kernel=raw_gate, chunk_size=chunk_size,
                          impl=None if impl == "auto" else impl, **extra)
    return jnp.sum(o.astype(jnp.float32)) + (jnp.sum(ht) if states else 0.0)

  fn = jax.grad(loss, argnums=(0, 1, 2, 3, 4)) if backward else loss
  with planning.recording() as log:
    jax.make_jaxpr(fn)(qk, qk, vv, g, beta, h0, extra)
  return log


def summary(log) -> list[str]:
  """One line per distinct choice, in the order first made."""
  lines, seen = [], set()
  for c in log:
    if c in seen:
      continue
    seen.add(c)
    runs = c.backend if c.backend is not None else "(not taken: its members run)"
    lines.append(f"{c.name:<16} {runs}")
    lines += [f"{'':<16}   refused {b}: {why}" for b, why in c.refused]
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tools.backends", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq-lens", default="100,50", help="sequence lengths, comma separated")
  p.add_argument("--many", help="NxL: N sequences of L tokens (instead of --seq-lens)")
  p.add_argument("--heads", type=int, default=1)
  p.add_argument("--head-dim", type=int, default=128, help="K")
  p.add_argument("--value-dim", type=int, help="V (default: K)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--states", action="store_true", help="initial_state given and final_state returned")
  p.add_argument("--raw-gate", action="store_true", help="use_gate_in_kernel=True (A_log, dt_bias)")
  p.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64))
  p.add_argument("--impl", default="auto", help="chunk_kda's impl: auto (None) or a backend name")
  p.add_argument("--no-bwd", action="store_true", help="the forward only")
  a = p.parse_args(argv)
  try:
    lens = lens_of(a.seq_lens, a.many)
  except ValueError as e:
    p.error(str(e))
  log = choices(lens, heads=a.heads, K=a.head_dim, V=a.value_dim or a.head_dim, dtype=jnp.dtype(a.dtype),
                states=a.states, raw_gate=a.raw_gate, chunk_size=a.chunk_size, impl=a.impl,
                backward=not a.no_bwd)
  platform, generation = planning.platform_of()
  print(f"{len(lens)} sequences, {sum(lens)} tokens, H = {a.heads}, K = {a.head_dim}, "
        f"V = {a.value_dim or a.head_dim}, {a.dtype}, states {'in and out' if a.states else 'none'}, "
        f"impl {a.impl}, on {platform} ({generation})")
  L = planning.PipelineConfig().short_len if a.states else 0
  chunked = [n for n in lens if n > L]
  if len(chunked) < len(lens):
    print(f"{len(lens) - len(chunked)} sequences of at most {L} tokens run the recurrence (kda.short), "
          f"{len(chunked)} the chunks")
  T, Ta = sum(chunked), padding.aligned_length(sum(chunked), len(chunked), a.chunk_size, chunked)
  if chunked:
    print(f"each sequence padded to the chunk: {Ta} rows for {T} tokens ({Ta / max(T, 1):.1f}x), the length of "
          f"the per-row tensors between stages (unless the segmented layout runs: no states, many sequences)")
  print("\n".join(summary(log)) if log else "no stage chose a backend (nothing to compute)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
