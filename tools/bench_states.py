"""python -m tools.bench_states: many short sequences with and without states, forward+backward.

N sequences of L tokens (--many NxL, default 200000x1), H = HV heads, K = V (--heads 1, --head-dim
64), bf16 q, k, v, beta, plain gates. Times the jitted jax.grad of sum(o * do) (+ sum(final_state)
with states) over q, k, v, g, beta (and initial_state) with and without initial and final states,
medians over --reps after warm-up, and XLA's temp memory of each; cu_seqlens is an argument (traced,
the static-bound layout, as a training step passes it) unless --concrete. The ratio with / without
states is what a call that carries states across calls pays for them. --profile DIR: each variant's
device time per call by pipeline piece (tools.profile's attribution: the kda.<piece> name scopes,
kda.short the recurrence of the short sequences) and its largest ops, traces under DIR.

  python -m tools.bench_states [--many 200000x1] [--heads 1] [--head-dim 64] [--reps 10] [--concrete]
      [--profile DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import kda
from tools.backends import lens_of
from tools import profile
from tools.bench import memory_mb, timeit


def inputs(lens, H, K, seed=0):
  T = int(sum(lens))
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (1, T, H, K))).astype(jnp.bfloat16)
  k = unit(jax.random.normal(ks[1], (1, T, H, K))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, T, H, K)).astype(jnp.bfloat16)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (1, T, H, K))) / 16
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H))).astype(jnp.bfloat16)
  h0 = jax.random.normal(ks[5], (len(lens), H, K, K), jnp.float32) * 0.1
  do = jax.random.normal(ks[6], v.shape).astype(jnp.bfloat16)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  return (q, k, v, g, beta), h0, do, cu


def measure(lens, H, K, reps, concrete, states, profile_dir=None):
  """-> {compile_s, fwdbwd_ms, mem_mb, temp_mb} of one variant (with profile_dir also pieces_ms, the
  device ms per call by piece, and top_ops)."""
  xs, h0, do, cu = inputs(lens, H, K)

  def loss(xs, h0, do, cu):
    o, ht = kda.chunk_kda(*xs, cu_seqlens=cu, initial_state=h0 if states else None, output_final_state=states)
    out = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    return out + (jnp.sum(ht) if states else 0.0)

  if concrete:                     # closed over: the exact layout
    fb, args = jax.jit(jax.grad(lambda xs, h0, do: loss(xs, h0, do, cu), argnums=(0, 1))), (xs, h0, do)
  else:
    fb, args = jax.jit(jax.grad(loss, argnums=(0, 1))), (xs, h0, do, jnp.asarray(cu))
  t0 = time.perf_counter()
  jax.block_until_ready(fb(*args))
  out = {"compile_s": time.perf_counter() - t0, "fwdbwd_ms": timeit(fb, *args, reps=reps, warmup=2)}
  out["mem_mb"], out["temp_mb"] = memory_mb(fb, *args)
  if profile_dir:
    out.update(device_pieces(fb, args, reps, os.path.join(profile_dir, "states" if states else "stateless")))
  return out


def device_pieces(fb, args, reps, logdir):
  """{pieces_ms, top_ops} of the jitted fb on args: reps calls back to back under jax.profiler."""
  compiled = fb.lower(*args).compile()
  events, _ = profile.traced_events(compiled, args, reps, logdir)
  pieces, ops = profile.attribute(events, profile.hlo_scopes(compiled.as_text()), reps)
  return {"pieces_ms": pieces, "top_ops": ops[:15]}


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tools.bench_states", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--many", default="200000x1", help="NxL: N sequences of L tokens")
  p.add_argument("--heads", type=int, default=1)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--concrete", action="store_true", help="cu_seqlens closed over (the exact layout)")
  p.add_argument("--profile", metavar="DIR", help="also the device time by pipeline piece (traces under DIR)")
  p.add_argument("--out", help="write the results as JSON")
  a = p.parse_args(argv)
  lens = lens_of(None, a.many)
  res = {"many": a.many, "heads": a.heads, "head_dim": a.head_dim, "concrete": a.concrete,
         "device": jax.devices()[0].device_kind}
  for states in (False, True):
    r = measure(lens, a.heads, a.head_dim, a.reps, a.concrete, states, a.profile)
    res["states" if states else "stateless"] = r
    print(f"{'states' if states else 'stateless':9s} f+b {r['fwdbwd_ms']:9.3f} ms  compile {r['compile_s']:6.1f} s  "
          f"temp {r['temp_mb'] if r['temp_mb'] is None else round(r['temp_mb'])} MiB", flush=True)
    for piece, ms in r.get("pieces_ms", {}).items():
      print(f"  {piece:24s} {ms:9.3f} ms")
  res["ratio"] = res["states"]["fwdbwd_ms"] / res["stateless"]["fwdbwd_ms"]
  print(f"states / stateless: {res['ratio']:.2f}x")
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  main()
