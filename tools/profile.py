"""python -m tools.profile: where the device time of one kda.chunk_kda call goes, by pipeline piece.

Runs the forward (and forward+backward) of tools.bench's shapes under jax.profiler, reads the
trace's device events, and sums their time per call by the piece they belong to: the name scope
kda.pipeline gives each piece (kda.gate, kda.intra, kda.state+output, kda.bwd_intra, kda.prepare,
...), read from the compiled HLO's op metadata; events of no kda scope are XLA's own (e.g. the
custom VJP's cotangent plumbing). The Mosaic GPU kernels are also named (kda_<stage>...), so a kernel
is attributed even where its HLO op is not in the trace (inside a CUDA graph: XLA's command buffers
are turned off here unless --command-buffers, so wall times may differ a little from tools.bench's).
Prints, per variant: the median wall time
of a call (medians of --reps), the device busy time per call, the device's span and idle time per
call with its largest gaps (the profiled calls are dispatched back to back), compile seconds (lower +
compile), XLA's temporary and output MiB, a table per piece and the largest ops.

  python -m tools.profile [--variants A:plain,B:plain] [--reps 5] [--no-bwd | --no-fwd] [--total 32768]
      [--impl auto] [--config name.field=value,...] [--dir /tmp/kda-profile] [--command-buffers]
      [--hlo-dir DIR] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import jax

from tools import bench

SCOPE = re.compile(r"kda\.([\w+]+)")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")
KERNEL_PREFIX = "kda_"


def scope_of(op_name: str) -> str | None:
  """The innermost kda.<piece> scope of an op_name ("jit(f)/jvp(kda.intra)/mul" -> "intra"), with
  " (vjp)" where JAX made the op transposing that piece ("transpose(jvp(kda.prepare))/..."), else None."""
  for part in reversed(op_name.split("/")):
    found = SCOPE.findall(part)
    if found:
      return found[-1] + (" (vjp)" if part.startswith("transpose(") else "")
  return None


def hlo_scopes(hlo_text: str) -> dict[str, str]:
  """Compiled HLO text -> {instruction name: scope_of its op_name metadata} (instructions of no kda
  scope are left out)."""
  out = {}
  for line in hlo_text.splitlines():
    m = INSTR.match(line)
    if m and (piece := scope_of(m.group(2))):
      out[m.group(1)] = piece
  return out


def kernel_piece(name: str) -> str | None:
  """The piece of a kda Mosaic GPU kernel from its CUDA name (kda_bwd_intra... -> bwd_intra), else None."""
  i = name.find(KERNEL_PREFIX)
  if i < 0:
    return None
  rest = name[i + len(KERNEL_PREFIX):]
  for piece in ("state_output", "bwd_recompute", "bwd_dav", "bwd_dh", "bwd_wy", "bwd_intra", "bwd_gate",
                "gate", "intra", "state", "output"):
    if rest.startswith(piece):
      return "state+output" if piece == "state_output" else piece
  return None


def trace_events(logdir: str) -> list:
  """The events of the newest *.trace.json.gz under logdir (jax.profiler.trace's output)."""
  paths = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {logdir}")
  with gzip.open(paths[-1]) as fh:
    data = json.load(fh)
  return data["traceEvents"] if isinstance(data, dict) else data


def device_events(logdir: str):
  """The newest trace under logdir -> (events [(name, dur_us, args, ts_us)], thread names used). Device
  events are those of a process named like a GPU; of its threads the CUDA streams where there are
  any (the other lines repeat the same kernels as XLA ops / modules)."""
  ev = trace_events(logdir)
  procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  gpu = {p for p, n in procs.items() if "GPU" in n.upper()}
  if not gpu:          # a CPU run (smoke test): the host's XLA threads
    gpu = set(procs)
  on = {key for key in threads if key[0] in gpu}
  streams = {key for key in on if threads[key].lower().startswith("stream")}
  use = streams or {key for key in on if not any(s in threads[key] for s in ("XLA Modules", "Steps", "python"))}
  out = [(e.get("name", "?"), float(e.get("dur", 0.0)), e.get("args") or {}, float(e.get("ts", 0.0)))
         for e in ev if e.get("ph") == "X" and (e["pid"], e.get("tid")) in use]
  return out, sorted({threads[k] for k in use})


def attribute(events, scopes, calls):
  """-> ({piece: ms per call}, [(op, piece, ms per call, count per call)] largest first)."""
  by_piece, by_op, count = collections.Counter(), collections.Counter(), collections.Counter()
  piece_of = {}
  for name, dur, args, *_ in events:
    op = args.get("hlo_op") or args.get("long_name") or name
    op = str(op).split(" ")[0].lstrip("%")
    piece = scopes.get(op) or kernel_piece(name) or kernel_piece(str(args.get("kernel_details", "")))
    piece = piece or "(no kda scope)"
    key = f"{name[:60]} [{op[:40]}]" if op != name else name[:100]
    by_piece[piece] += dur
    by_op[key] += dur
    count[key] += 1
    piece_of[key] = piece
  ms = lambda us: us / 1e3 / calls
  ops = [(k, piece_of[k], ms(v), count[k] / calls) for k, v in by_op.most_common()]
  return {p: ms(v) for p, v in by_piece.most_common()}, ops


def idle(events, calls, top=6):
  """The device's idle time between its events (calls dispatched back to back, so what is idle is
  inside or between calls without a host round trip in the way) -> (span ms per call, idle ms per
  call, the `top` largest gaps [(us, event before, event after)])."""
  evs = sorted(events, key=lambda e: e[3])
  if not evs:
    return 0.0, 0.0, []
  gaps, end, prev = [], evs[0][3] + evs[0][1], evs[0][0]
  for name, dur, _, ts in evs[1:]:
    if ts > end:
      gaps.append((ts - end, prev, name))
    if ts + dur >= end:
      end, prev = ts + dur, name
  span = end - evs[0][3]
  gaps.sort(key=lambda g: -g[0])
  return span / 1e3 / calls, sum(g[0] for g in gaps) / 1e3 / calls, gaps[:top]


def traced_events(compiled, args, reps, logdir):
  """device_events of `reps` calls of compiled(*args) under jax.profiler (after one call outside),
  dispatched back to back so the device never waits for the host's loop."""
  jax.block_until_ready(compiled(*args))
  with jax.profiler.trace(logdir):
    res = None
    for _ in range(reps):
      res = compiled(*args)
    jax.block_until_ready(res)
  return device_events(logdir)


def profile_one(name, gate, impl, reps, do_bwd, total, logdir, hlo_dir=None, config="", do_fwd=True):
  args, fwd, loss = bench.calls(name, gate, impl, total, config)
  fns = {"fwd": jax.jit(fwd)} if do_fwd else {}
  if do_bwd:
    # value_and_grad: the loss needs o, so the forward's output kernels run as in a training step
    # (jax.grad of this linear loss, as tools.bench and the jax peer time it, lets XLA drop them)
    fns["fwdbwd"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
  out = {}
  for label, f in fns.items():
    t0 = time.perf_counter()
    compiled = f.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    scopes = hlo_scopes(text)
    if hlo_dir:                   # the optimized HLO: which ops each fusion holds, their metadata
      os.makedirs(hlo_dir, exist_ok=True)
      with open(os.path.join(hlo_dir, f"{name}-{gate}-{label}.hlo.txt"), "w") as fh:
        fh.write(text)
    wall = bench.timeit(compiled, *args, reps=reps)
    events, threads = traced_events(compiled, args, reps, os.path.join(logdir, f"{name}-{gate}-{label}"))
    pieces, ops = attribute(events, scopes, reps)
    span, idle_ms, gaps = idle(events, reps)
    out[label] = {"wall_ms": wall, "device_ms": sum(pieces.values()), "compile_s": compile_s,
                  "temp_mb": getattr(mem, "temp_size_in_bytes", 0) / 2**20,
                  "out_mb": getattr(mem, "output_size_in_bytes", 0) / 2**20, "pieces_ms": pieces,
                  "top_ops": ops[:25], "threads": threads, "scoped_instructions": len(scopes),
                  "span_ms": span, "idle_ms": idle_ms, "largest_gaps_us": gaps}
  return out


def report(key, r) -> str:
  lines = []
  for label, x in r.items():
    lines.append(f"{key} {label}: wall {x['wall_ms']:.3f} ms, device busy {x['device_ms']:.3f} ms per call, "
                 f"compile {x['compile_s']:.1f} s, XLA temp {x['temp_mb']:.0f} MiB + outputs {x['out_mb']:.0f} MiB "
                 f"(threads: {', '.join(x['threads'])[:120]})")
    lines.append(f"  device span {x['span_ms']:.3f} ms per call, idle {x['idle_ms']:.3f} ms; largest gaps (us):")
    for us, before, after in x["largest_gaps_us"]:
      lines.append(f"    {us:8.1f}  {before[:50]} -> {after[:50]}")
    for p, ms in x["pieces_ms"].items():
      lines.append(f"  {p:24s} {ms:8.3f} ms")
    lines.append("  largest ops (ms per call, launches per call):")
    for op, p, ms, n in x["top_ops"][:15]:
      lines.append(f"    {ms:8.3f} {n:5.1f}x  {p:16s} {op}")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain,B:plain", help="shape:gate pairs (tools.bench's)")
  p.add_argument("--impl", default="auto", help="auto (impl=None), mosaic_gpu, pallas or reference")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--no-bwd", action="store_true")
  p.add_argument("--no-fwd", action="store_true", help="forward + backward alone")
  p.add_argument("--config", default="", help="configs of the call, name.field=value,... (tools.configs)")
  p.add_argument("--total", type=int, default=bench.TOTAL)
  p.add_argument("--dir", default="/tmp/kda-profile", help="where the traces go")
  p.add_argument("--command-buffers", action="store_true",
                 help="keep XLA's CUDA command buffers (graphs): then the trace names the graph, not the "
                      "HLO op, and only the kda kernels are attributed by name; by default they are off here")
  p.add_argument("--hlo-dir", help="also write each compiled call's optimized HLO text there")
  p.add_argument("--out", help="write the results as JSON")
  a = p.parse_args(argv)
  if not a.command_buffers:     # read when the GPU client starts: before the first device query
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
  if a.reps < 1:
    p.error(f"--reps must be >= 1, got {a.reps}")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  if a.no_fwd and a.no_bwd:
    p.error("--no-fwd and --no-bwd leave nothing to profile")
  bench.each_variant(a.variants, lambda name, gate: profile_one(name, gate, a.impl, a.reps, not a.no_bwd, a.total,
                                                               a.dir, a.hlo_dir, a.config, not a.no_fwd),
                     report, a.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
