"""python -m tools.cpu_check: time and peak memory of kda.chunk_kda on the CPU against the recurrence.

One sequence of T tokens (default 8192), H heads (4), K = V (128), chunk 64, float32 inputs: q and k
standard normal scaled by K^-1/2, v standard normal, g = -|randn| / 16, beta = sigmoid(randn). Three
measurements, each in a fresh process (so one's compile and buffers do not count in another's peak):

  recurrence  jax.jit(kda.reference.recurrent_kda): the token-by-token ground truth
  forward     jax.jit(chunk_kda) (o only)
  fwdbwd      jax.jit(jax.grad) of sum(o * do) in q, k, v, g, beta (do standard normal)

Each prints one JSON line: median_s, the median wall time of --reps timed calls (compile excluded:
the first call is timed apart as compile_s); cpu_s, the median CPU time (user + system, all
threads) of those calls, which other processes on a shared machine disturb less than the wall
time; and rss_growth_mib, the process's peak resident memory after the calls minus before them
(inputs already made, compile included; getrusage's ru_maxrss). Then a summary line with forward /
recurrence for both times. --impl picks chunk_kda's impl (default: None, what a CPU
caller gets); --measure runs one measurement in this process.

  python -m tools.cpu_check [--T 8192] [--H 4] [--K 128] [--chunk 64] [--reps 3] [--impl xla]
      [--measures recurrence,forward,fwdbwd] [--measure recurrence|forward|fwdbwd]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

MEASURES = ("recurrence", "forward", "fwdbwd")


def cpu_seconds() -> float:
  """User + system CPU time of this process so far (every thread), seconds."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def peak_rss_mib() -> float:
  """The process's peak resident set size so far, MiB (Linux reports ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def make_inputs(T, H, K, seed=0):
  """The issue's inputs: (q, k, v, g, beta, do) float32, one sequence [1, T, ...]."""
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (1, T, H, K)) * K ** -0.5
  k = jax.random.normal(ks[1], (1, T, H, K)) * K ** -0.5
  v = jax.random.normal(ks[2], (1, T, H, K))
  g = -jnp.abs(jax.random.normal(ks[3], (1, T, H, K))) / 16
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H)))
  do = jax.random.normal(ks[5], (1, T, H, K))
  return jax.block_until_ready((q, k, v, g, beta, do))


def measure(what, *, T, H, K, chunk, reps, impl):
  """One measurement in this process -> its JSON record."""
  import jax
  import jax.numpy as jnp
  import kda
  q, k, v, g, beta, do = make_inputs(T, H, K)
  if what == "recurrence":
    fn = jax.jit(lambda *x: kda.reference.recurrent_kda(*x)[0])
  else:
    fwd = lambda q, k, v, g, beta: kda.chunk_kda(q, k, v, g, beta, chunk_size=chunk, impl=impl)[0]
    if what == "forward":
      fn = jax.jit(fwd)
    else:
      fn = jax.jit(jax.grad(lambda *x: jnp.sum(fwd(*x) * do), argnums=(0, 1, 2, 3, 4)))
  args = (q, k, v, g, beta)
  before = peak_rss_mib()
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  times, cpu = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), cpu_seconds()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
    cpu.append(cpu_seconds() - c0)
  rec = {"measure": what, "impl": None if what == "recurrence" else impl, "T": T, "H": H, "K": K,
         "chunk": chunk, "median_s": round(statistics.median(times), 4),
         "cpu_s": round(statistics.median(cpu), 4), "compile_s": round(compile_s, 2),
         "rss_growth_mib": round(peak_rss_mib() - before, 1)}
  if what != "recurrence":
    from kda import plan as planning
    rec["impls"] = sorted(set(dict(planning.make_plan(scale=1.0, chunk_size=chunk).impls).values())) if impl is None else impl
  return rec


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--T", type=int, default=8192, help="tokens of the one sequence")
  p.add_argument("--H", type=int, default=4, help="heads (H = HV)")
  p.add_argument("--K", type=int, default=128, help="head dim (K = V)")
  p.add_argument("--chunk", type=int, default=64, help="chunk_size")
  p.add_argument("--reps", type=int, default=3, help="timed calls after the first (median reported)")
  p.add_argument("--impl", default=None, help="chunk_kda's impl (a string; default None)")
  p.add_argument("--measure", choices=MEASURES, help="run this one measurement in this process")
  p.add_argument("--measures", default=",".join(MEASURES),
                 help="comma-separated measurements to run, each in a fresh process (default: all three)")
  a = p.parse_args(argv)
  kw = dict(T=a.T, H=a.H, K=a.K, chunk=a.chunk, reps=a.reps, impl=a.impl)
  if a.measure:
    print(json.dumps(measure(a.measure, **kw)), flush=True)
    return 0
  recs = {}
  for what in a.measures.split(","):   # each in a fresh process: its own peak RSS and compile caches
    cmd = [sys.executable, "-m", "tools.cpu_check", "--measure", what, "--T", str(a.T), "--H", str(a.H),
           "--K", str(a.K), "--chunk", str(a.chunk), "--reps", str(a.reps)]
    if a.impl is not None:
      cmd += ["--impl", a.impl]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
      recs[what] = {"measure": what, "error": res.stderr.strip().splitlines()[-1:] or ["exit %d" % res.returncode]}
    else:
      recs[what] = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(recs[what]), flush=True)
  ok = all("median_s" in r for r in recs.values())
  if ok and {"forward", "recurrence"} <= set(recs):
    ratio = lambda key: round(recs["forward"][key] / recs["recurrence"][key], 2)
    print(json.dumps({"summary": True, "forward_over_recurrence": ratio("median_s"),
                      "forward_over_recurrence_cpu": ratio("cpu_s")}), flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
