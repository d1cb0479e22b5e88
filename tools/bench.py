"""python -m tools.bench: forward and forward+backward timings of kda.chunk_kda (GPU).

Shapes are the peer harness's (flash-linear-attention's chunk_kda is timed on the same ones):
  A  B=1, T=32768 packed, lengths uniform in [64, 4096] (numpy default_rng(0)), H=16, K=V=128
  B  B=1, T=32768 packed, lengths uniform in [1, 128]
  C  B=4, T=8192, no cu_seqlens
bf16 q/k/v/beta; gates "plain" (log-space logsigmoid(randn)/16) or "gate_safe" (raw gates,
use_gate_in_kernel, safe_gate, lower_bound=-5). Times are medians over --reps runs after warm-up
(jax.block_until_ready around each call); memory is XLA's compiled memory analysis (arguments +
outputs + temporaries). With --peer FILE (the peer's JSON from the same device run) it prints ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kda

H, K, V, TOTAL = 16, 128, 128, 32768


def varlen_lens(total, lo, hi, seed=0):
  rng = np.random.default_rng(seed)
  lens, s = [], 0
  while s < total:
    L = min(int(rng.integers(lo, hi + 1)), total - s)
    lens.append(L)
    s += L
  return lens


def shape(name):
  if name == "A":
    return 1, TOTAL, varlen_lens(TOTAL, 64, 4096)
  if name == "B":
    return 1, TOTAL, varlen_lens(TOTAL, 1, 128)
  if name == "C":
    return 4, 8192, None
  raise ValueError(f"shape must be A, B or C, got {name!r}")


def make_inputs(name, gate, seed=0):
  B, T, lens = shape(name)
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, T, H, K))).astype(jnp.bfloat16)
  k = unit(jax.random.normal(ks[1], (B, T, H, K))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, H, V)).astype(jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H))).astype(jnp.bfloat16)
  kw = {}
  if gate == "plain":
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, H, K))) / 16
  elif gate == "gate_safe":
    g = jax.random.normal(ks[4], (B, T, H, K)).astype(jnp.bfloat16)
    kw = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              A_log=jnp.log(jax.random.uniform(ks[5], (H,)) * 15 + 1),
              dt_bias=jax.random.normal(ks[6], (H * K,)))
  else:
    raise ValueError(f"gate must be plain or gate_safe, got {gate!r}")
  if lens is not None:
    kw["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  do = jax.random.normal(ks[7], v.shape).astype(jnp.bfloat16)
  return (q, k, v, g, beta), kw, do


def timeit(fn, *args, reps=20, warmup=3):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def memory_mb(fn, *args):
  try:
    m = fn.lower(*args).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return total / 2**20
  except Exception:  # noqa: BLE001 - not every backend reports it
    return None


def bench_one(name, gate, impl, reps, do_bwd=True):
  """impl: "auto" (chunk_kda's default: kernels where a stage has one), "pallas" or "reference"."""
  label, impl = impl, (None if impl == "auto" else impl)
  args, kw, do = make_inputs(name, gate)
  diff_kw = {k: v for k, v in kw.items() if k in ("A_log", "dt_bias")}
  static_kw = {k: v for k, v in kw.items() if k not in diff_kw}

  def fwd(q, k, v, g, beta, dk):
    return kda.chunk_kda(q, k, v, g, beta, impl=impl, **static_kw, **dk)[0]

  def loss(q, k, v, g, beta, dk):
    o = fwd(q, k, v, g, beta, dk)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  f = jax.jit(fwd)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args, diff_kw))
  out = {"shape": name, "gate": gate, "impl": label, "compile_fwd_s": time.perf_counter() - t0}
  out["fwd_ms"] = timeit(f, *args, diff_kw, reps=reps)
  out["fwd_mem_mb"] = memory_mb(f, *args, diff_kw)
  if do_bwd:
    fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    t0 = time.perf_counter()
    jax.block_until_ready(fb(*args, diff_kw))
    out["compile_fwdbwd_s"] = time.perf_counter() - t0
    out["fwdbwd_ms"] = timeit(fb, *args, diff_kw, reps=reps)
    out["fwdbwd_mem_mb"] = memory_mb(fb, *args, diff_kw)
  return out


def peer_figures(path):
  with open(path) as fh:
    data = json.load(fh)
  res = {}
  for key, val in data.get("variants", {}).items():
    if isinstance(val, dict):
      res[key] = val
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain,B:plain,C:plain", help="shape:gate pairs")
  p.add_argument("--impls", default="auto,reference",
                 help="auto = chunk_kda's default (forward kernels, backward stages without kernels in jnp)")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--no-bwd", action="store_true")
  p.add_argument("--peer", help="JSON written by the peer harness (fla_bench.py --out) in the same run")
  p.add_argument("--out", help="write results as JSON")
  a = p.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  rows = []
  for var in a.variants.split(","):
    name, gate = var.split(":")
    for impl in a.impls.split(","):
      try:
        r = bench_one(name, gate, impl, a.reps, do_bwd=not a.no_bwd)
      except Exception as e:  # noqa: BLE001 - report and go on with the other cases
        r = {"shape": name, "gate": gate, "impl": impl, "error": f"{type(e).__name__}: {e}"[:500]}
      rows.append(r)
      print(json.dumps(r), flush=True)
  peer = peer_figures(a.peer) if a.peer else {}
  print(f"\n{'variant':14s} {'impl':10s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'peer fwd':>9s} {'peer f+b':>9s} {'x fwd':>7s} {'x f+b':>7s}")
  for r in rows:
    if "error" in r:
      print(f"{r['shape']}:{r['gate']:10s} {r['impl']:10s} ERROR {r['error'][:80]}")
      continue
    pv = peer.get(f"{r['shape']}:{r['gate']}", {})
    pf, pb = pv.get("fwd_ms_median"), pv.get("fwdbwd_ms_median")
    fb = r.get("fwdbwd_ms")
    ratio = lambda a_, b_: f"{a_ / b_:7.2f}" if (a_ and b_) else f"{'-':>7s}"
    print(f"{r['shape'] + ':' + r['gate']:14s} {r['impl']:10s} {r['fwd_ms']:9.3f} "
          f"{(fb or float('nan')):11.3f} {(pf or float('nan')):9.3f} {(pb or float('nan')):9.3f} "
          f"{ratio(r['fwd_ms'], pf)} {ratio(fb, pb)}")
  if a.out:
    with open(a.out, "w") as fh:
      json.dump({"rows": rows, "peer": peer}, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
