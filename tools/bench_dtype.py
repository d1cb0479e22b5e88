"""python -m tools.bench_dtype: one tools.bench shape with bf16 and with float32 inputs.

The shape's inputs (tools.bench.calls, impl=None: the platform's choice), then q, k, v, beta cast to
float32; for each dtype the forward's median ms, the compiled forward + backward's
(jax.value_and_grad of sum(o * do)) median ms, its compile seconds, XLA temp MiB, and the backend
each stage and fused group chose while it traced (kda.plan.recording). The Mosaic GPU kernels take
bf16 operands and refuse float32 inputs, so on a GPU the float32 call shows what the fallbacks cost.

  python -m tools.bench_dtype [--shape A] [--reps 10] [--total 32768] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from kda import plan as planning
from tools import bench


def measure(name, dtype, reps, total):
  args, fwd, loss = bench.calls(name, "plain", "auto", total=total)
  if dtype == "float32":
    args = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args[:5]) + args[5:]
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  with planning.recording() as log:
    lowered = f.lower(*args)
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  return dict(fwd_ms=bench.timeit(jax.jit(fwd), *args, reps=reps), fwdbwd_ms=bench.timeit(compiled, *args, reps=reps),
              compile_s=compile_s, temp_mb=compiled.memory_analysis().temp_size_in_bytes / 2**20,
              backends=sorted({f"{c.name}:{c.backend}" for c in log}))


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tools.bench_dtype", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shape", default="A", help="a tools.bench shape: A, B or C")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--total", type=int, default=bench.TOTAL, help="packed tokens (smaller for a smoke run)")
  p.add_argument("--out", help="write the results as JSON")
  a = p.parse_args(argv)
  res = {"shape": a.shape, "device": jax.devices()[0].device_kind}
  for dtype in ("bfloat16", "float32"):
    res[dtype] = measure(a.shape, dtype, a.reps, a.total)
    print(dtype, json.dumps(res[dtype]), flush=True)
  res["ratio_fwdbwd"] = res["float32"]["fwdbwd_ms"] / res["bfloat16"]["fwdbwd_ms"]
  print(f"float32 / bfloat16 forward + backward: {res['ratio_fwdbwd']:.2f}x")
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  main()
