"""python -m tools.timeline: where the time of one waited kda.chunk_kda call goes, host and device.

tools.bench and the peers time a call from the host: dispatch, then wait for the result. That time
is the device's busy span plus what comes before the first kernel starts (Python, PjRt, the launch
of XLA's command buffer) and after the last one ends (the host learning of it). This tool times the
forward of tools.bench's shapes three ways (host-timed median as tools.bench, back to back = device
time, dispatch alone), then profiles single waited calls (each inside a TraceAnnotation) and prints
per call: the host's time, when its first kernel started and its last one ended (us after the call
began), the device's busy time and event count, and the tail; then the device events of the median
call in order (kernels and XLA's small ops, with their start offsets and durations).

  python -m tools.timeline [--variants A:plain] [--calls 8] [--reps 30] [--gate-scale 1]
      [--switch NAME=0|1,...] [--total 32768] [--dir /tmp/kda-timeline] [--out FILE.json]

--switch sets boolean kda switches as tools.packed_check's --variant does
(FUSE_GATE_INTRA=0, kda.stages.intra.mosaic_gpu.RESIDENT_AKK=0, ...); --gate-scale multiplies the
plain gates (40: bounded chunks that reach -1; 640: no chunk bounded).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

from tools import bench, packed_check, profile

MARK = "kda.timeline.call"


def timings(compiled, args, reps):
  """(host-timed median ms as tools.bench times it, back to back ms per call, dispatch alone median ms)."""
  host = bench.timeit(compiled, *args, reps=reps, warmup=0)
  dispatch = []
  jax.block_until_ready(compiled(*args))
  t0, res = time.perf_counter(), None
  for _ in range(reps):
    res = compiled(*args)
  jax.block_until_ready(res)
  b2b = (time.perf_counter() - t0) / reps
  for _ in range(reps):
    jax.block_until_ready(compiled(*args))
    t0 = time.perf_counter()
    res = compiled(*args)
    dispatch.append(time.perf_counter() - t0)
    jax.block_until_ready(res)
  return host, b2b * 1e3, statistics.median(dispatch) * 1e3


def split_calls(events, marks):
  """events: device events [(name, dur_us, args, ts_us)]; marks: the calls' host spans [(ts_us,
  dur_us)] -> per call {host_us, first_us, last_us, busy_us, events, tail_us, timeline} (offsets from
  the call's start; timeline [(offset_us, dur_us, name)] in start order). Calls whose span holds no
  device event are left out."""
  out = []
  for t0, dur in sorted(marks):
    inside = sorted((e for e in events if t0 <= e[3] <= t0 + dur), key=lambda e: e[3])
    if not inside:
      continue
    last = max(e[3] + e[1] for e in inside) - t0
    out.append({"host_us": dur, "first_us": inside[0][3] - t0, "last_us": last,
                "busy_us": sum(e[1] for e in inside), "events": len(inside), "tail_us": dur - last,
                "timeline": [(e[3] - t0, e[1], e[0]) for e in inside]})
  return out


def marks_of(logdir):
  """The host spans [(ts_us, dur_us)] of the MARK annotations in the newest trace under logdir."""
  return [(float(e["ts"]), float(e.get("dur", 0.0))) for e in profile.trace_events(logdir)
          if e.get("ph") == "X" and e.get("name") == MARK]


def run_one(name, gate, calls, reps, scale, logdir, total=bench.TOTAL):
  args, fwd, _ = bench.calls(name, gate, "auto", total)
  if scale != 1.0:
    args = (*args[:3], args[3] * scale, *args[4:])
  t0 = time.perf_counter()
  compiled = jax.jit(lambda *a: fwd(*a)).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  for _ in range(3):
    jax.block_until_ready(compiled(*args))
  host, b2b, dispatch = timings(compiled, args, reps)
  with jax.profiler.trace(logdir):
    for _ in range(calls):
      with jax.profiler.TraceAnnotation(MARK):
        jax.block_until_ready(compiled(*args))
  events, _ = profile.device_events(logdir)
  rows = split_calls(events, marks_of(logdir))
  return {"compile_s": compile_s, "host_ms": host, "b2b_ms": b2b, "dispatch_ms": dispatch, "calls": rows}


def report(key, r) -> str:
  lines = [f"{key}: host-timed {r['host_ms']:.3f} ms, back to back {r['b2b_ms']:.3f} ms, dispatch "
           f"{r['dispatch_ms']:.3f} ms, compile {r['compile_s']:.1f} s"]
  for i, c in enumerate(r["calls"]):
    lines.append(f"  call {i}: host {c['host_us']:7.0f} us, first kernel +{c['first_us']:5.0f}, last ends "
                 f"+{c['last_us']:6.0f}, busy {c['busy_us']:6.0f}, {c['events']} events, tail {c['tail_us']:4.0f}")
  if r["calls"]:
    mid = sorted(r["calls"], key=lambda c: c["host_us"])[len(r["calls"]) // 2]
    lines.append("  the median call's device events (start us, duration us, name):")
    lines += [f"    +{t:8.1f} {d:8.1f}  {n[:80]}" for t, d, n in mid["timeline"]]
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain", help="shape:gate pairs (tools.bench's)")
  p.add_argument("--calls", type=int, default=8, help="waited calls under the profiler")
  p.add_argument("--reps", type=int, default=30, help="calls per timing")
  p.add_argument("--gate-scale", type=float, default=1.0)
  p.add_argument("--total", type=int, default=bench.TOTAL, help="packed tokens (smaller for a smoke run)")
  p.add_argument("--switch", default="", help="kda switches NAME=0|1,... (tools.packed_check's)")
  p.add_argument("--dir", default="/tmp/kda-timeline", help="where the traces go")
  p.add_argument("--out", help="write the results as JSON")
  a = p.parse_args(argv)
  if a.calls < 1 or a.reps < 1:
    p.error(f"--calls and --reps must be >= 1, got {a.calls}, {a.reps}")
  for sw, value in packed_check.switches(a.switch).items():
    mod, attr = packed_check.target(sw)
    setattr(mod, attr, value)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  bench.each_variant(a.variants, lambda name, gate: run_one(name, gate, a.calls, a.reps, a.gate_scale,
                                                            f"{a.dir}/{name}-{gate}", a.total), report, a.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
