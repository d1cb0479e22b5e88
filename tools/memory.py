"""python -m tools.memory: what XLA holds at the memory peak of one compiled kda.chunk_kda call.

Compiles the forward+backward (jax.grad of tools.bench's loss, cu_seqlens traced) or the forward of
tools.bench's shapes with XLA's dump on, then reads the entry computation's buffer assignment
(each value's bytes) and live ranges (the program steps where each value is live), and prints: the
step where the live bytes of XLA's own allocations (temporaries and outputs: not the parameters or
constants) peak, the op running there, and the values live at that step, largest first, each with
the kda piece that made it (its op's kda.<piece> name scope in the optimized HLO, as tools.profile
attributes device time). The step totals approximate XLA's temp + output bytes (values of one
allocation may share bytes), so read them as which buffers meet at the peak.

  python -m tools.memory [--variants A:plain] [--no-bwd] [--total 32768] [--impl auto] [--config TEXT] [--top 25]
      [--dir /tmp/kda-memory] [--h200] [--out FILE.json]

--h200 compiles for an NVIDIA H200 on a machine without one (tools.h200_aot: jax's CUDA plugin
installed, JAX_PLATFORMS=cpu), as the device would.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

import jax

from tools import bench
from tools.profile import hlo_scopes

STEP = re.compile(r"^\s+(\d+):(\S+)\s*$")
RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)\s*$")
ALLOC = re.compile(r"^allocation (\d+): size \d+, (.*)$")
VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def live_ranges(text: str):
  """An HloLiveRange dump -> ({step: instruction}, [(value, first step, last step)])."""
  steps, ranges = {}, []
  head, _, body = text.partition("BufferLiveRange")
  for line in head.splitlines():
    if m := STEP.match(line):
      steps[int(m.group(1))] = m.group(2)
  for line in body.splitlines():
    if m := RANGE.match(line):
      ranges.append((m.group(1), int(m.group(2)), int(m.group(3))))
  return steps, ranges


def _sized(ranges, sizes):
  """The ranges under the buffer assignment's value names (which drop an array value's '{}')."""
  out = []
  for n, s, e in ranges:
    key = n if n in sizes else n[:-2] if n.endswith("{}") and n[:-2] in sizes else None
    if key is not None:
      out.append((key, s, e))
  return out


def value_sizes(text: str):
  """A buffer-assignment dump -> {value: (bytes, shape, kind, (allocation, offset))}, kind the
  allocation's description ("preallocated-temp", "maybe-live-out", "parameter 0, ...", "constant",
  ...); values at the same (allocation, offset) share bytes (an in-place result and its operand)."""
  out, kind, alloc = {}, "", -1
  for line in text.splitlines():
    if m := ALLOC.match(line):
      alloc, kind = int(m.group(1)), m.group(2)
    elif m := VALUE.search(line):
      out.setdefault(m.group(1), (int(m.group(2)), m.group(4), kind, (alloc, int(m.group(3)))))
  return out


def peak(steps, ranges, sizes):
  """-> (step, live bytes there, [(bytes, value, shape, first, last)] live there, largest first):
  XLA's own allocations only (parameters and constants left out), each place (allocation, offset)
  counted once per step: values written in place over another share its bytes."""
  own = [(n, s, e) for n, s, e in _sized(ranges, sizes)
         if not any(w in sizes[n][2] for w in ("parameter", "constant", "thread-local"))]
  if not own:
    return None, 0, []
  last = max(e for _, _, e in own)
  places = [{} for _ in range(last + 1)]
  for n, s, e in own:
    size, _, _, place = sizes[n]
    for t in range(s, e + 1):
      if size > places[t].get(place, (0, None))[0]:
        places[t][place] = (size, n)
  total = [sum(b for b, _ in p.values()) for p in places]
  t = max(range(last + 1), key=total.__getitem__)
  live = sorted((sizes[n][0], n, sizes[n][1], s, e) for n, s, e in own
                if s <= t <= e and places[t].get(sizes[n][3], (0, None))[1] == n)
  return t, total[t], live[::-1]


def _instr(value: str) -> str:
  """'mpmd_map.99{2}' -> 'mpmd_map.99' (the instruction defining the value)."""
  return value.split("{")[0]


def _newest(dump_dir: str, module: str, suffix: str) -> str:
  paths = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*{suffix}")), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no *{module}*{suffix} under {dump_dir}")
  return paths[-1]


def analyse(dump_dir: str, module: str, top: int):
  """The peak of the newest dumped module named like `module` -> a JSON-able dict."""
  read = lambda suffix: open(_newest(dump_dir, module, suffix)).read()
  steps, ranges = live_ranges(read("after_optimizations-live-range.txt"))
  sizes = value_sizes(read("after_optimizations-buffer-assignment.txt"))
  scopes = hlo_scopes(read("after_optimizations.txt"))
  t, total, live = peak(steps, ranges, sizes)
  piece = lambda v: scopes.get(_instr(v), "(no kda scope)")
  return {"peak_step": t, "peak_op": steps.get(t), "peak_piece": piece(steps.get(t) or ""),
          "live_mb": total / 2**20, "steps": len(steps),
          "live": [{"mb": b / 2**20, "value": v, "shape": shp, "piece": piece(v), "first": s, "last": e,
                    "first_op": steps.get(s)} for b, v, shp, s, e in live[:top]]}


def report(label: str, r) -> str:
  lines = [f"{label}: peak at step {r['peak_step']} of {r['steps']} ({r['peak_op']}, {r['peak_piece']}): "
           f"{r['live_mb']:.0f} MiB of XLA's own buffers live"]
  for x in r["live"]:
    lines.append(f"  {x['mb']:8.1f} MiB  {x['shape'][:34]:34s} {x['piece'][:22]:22s} "
                 f"{x['value'][:28]:28s} steps {x['first']}-{x['last']}")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain", help="shape:gate pairs (tools.bench's)")
  p.add_argument("--impl", default="auto", help="auto (impl=None), mosaic_gpu, pallas or reference")
  p.add_argument("--no-bwd", action="store_true", help="the forward alone")
  p.add_argument("--total", type=int, default=bench.TOTAL)
  p.add_argument("--config", default="", help="configs of the call, name.field=value,... (tools.configs)")
  p.add_argument("--top", type=int, default=25, help="how many live values to list")
  p.add_argument("--dir", default="/tmp/kda-memory", help="XLA's dump goes there (emptied first)")
  p.add_argument("--h200", action="store_true", help="compile for an H200 here (tools.h200_aot)")
  p.add_argument("--out", help="write the results as JSON")
  a = p.parse_args(argv)
  shutil.rmtree(a.dir, ignore_errors=True)
  # read when the XLA client starts: before the first device query
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={a.dir}").strip()
  device = None
  if a.h200:
    from tools import h200_aot
    device = h200_aot.target_device()
  print(f"jax {jax.__version__} on {(device or jax.devices()[0]).device_kind}", flush=True)
  results = {}
  for var in a.variants.split(","):
    name, gate = var.split(":")
    args, fwd, loss = bench.calls(name, gate, a.impl, a.total, config=a.config, device=device)
    f, module = (jax.jit(fwd), "jit_fwd") if a.no_bwd else (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))), "jit_loss")
    if device is None:
      m = f.lower(*args).compile().memory_analysis()
    else:                          # the same program for the H200: abstract inputs placed there
      spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=jax.sharding.SingleDeviceSharding(device)), args)
      with jax.default_device(device):
        m = f.lower(*spec).compile().memory_analysis()
    r = analyse(a.dir, module, a.top)
    if m is not None:
      r["xla_temp_mb"], r["xla_out_mb"] = m.temp_size_in_bytes / 2**20, m.output_size_in_bytes / 2**20
    results[var] = r
    print(report(var, r), flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(results, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
