"""python -m tools.compile_report: where the compile time of one kda.chunk_kda program goes.

For each variant it times tools.bench's forward (or, by default, forward + backward: jax.grad of
its loss, cu_seqlens traced) in phases: trace, lower, XLA compile (which includes every Mosaic GPU
kernel's CUDA compile) and the first call. With --kernels it also records each Mosaic GPU kernel
the program calls (its plgpu.kernel function and abstract arguments, while tracing) and lowers and
compiles each one alone: a kernel's own compile time is then its CUDA compile (its program holds
nothing else), and the whole compile less their sum is XLA's share. Mosaic GPU's kernel cache does
carries over from one lowering to the next only through kda._lowering_cache (a kernel lowered
once per process unless KDA_LOWERING_CACHE=0), which this tool turns off for the per-kernel
lowerings (each is measured cold) and, with --no-lowering-cache, for the program too; the Python and XLA caches of the process still
carry over, so run one variant per process for cold figures.

  python -m tools.compile_report [--variants A:plain] [--no-bwd] [--kernels] [--total 32768]
      [--lower-only] [--no-precompile] [--no-lowering-cache] [--ptxas] [--out FILE.json]

--ptxas: each kernel's registers per thread and spills, from ptxas's log (Mosaic GPU's dumps,
MOSAIC_GPU_DUMP_TO, into a temporary folder).

kda's kernels compile on worker threads while the program lowers (kda._precompile), so the
compile phase holds only what those threads had not finished; --no-precompile turns that off.

--lower-only (a CPU): lowers for CUDA without compiling (the platform taken as an H200), timing the
lowering of the program and of each kernel.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import re
import sys
import tempfile
import time
from unittest import mock

import jax

from kda import _precompile
from tools import bench


@contextlib.contextmanager
def recording_kernels(calls):
  """Within: every plgpu.kernel function, when called, appends (kernel name, function, abstract
  arguments) to `calls`."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  real = plgpu.kernel

  def kernel(body, *a, **kw):
    f = real(body, *a, **kw)
    name = kw.get("kernel_name") or getattr(body, "__name__", "kernel")

    def call(*args):
      calls.append((name, f, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)))
      return f(*args)
    return call

  plgpu.kernel = kernel
  try:
    yield
  finally:
    plgpu.kernel = real


def ptxas_summary(texts):
  """{kernel: {registers, spill_stores, spill_loads, stack}} from ptxas logs (`ptxas -v`'s info
  lines, as Mosaic GPU dumps them per module): the entry function each block of lines describes."""
  out, name = {}, None
  for text in texts:
    for line in text.splitlines():
      if m := re.search(r"(?:Compiling entry function|Function properties for) '?([\w.$]+)'?", line):
        name = m.group(1)
        out.setdefault(name, {})
      if name is None:
        continue
      if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
        out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
      if m := re.search(r"Used (\d+) registers", line):
        out[name]["registers"] = int(m.group(1))
  return out


_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s16": 2, "s8": 1, "u8": 1, "pred": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")


def _array_bytes(text: str) -> int:
  """Bytes of every array type `dtype[d0,d1,...]` named in `text`."""
  return sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _ARRAY.findall(text))


_CALLED = re.compile(r"(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_TAKEN = ("body", "condition", "true_computation", "false_computation")   # run when taken, or 0..n times


def _computations(hlo_text: str):
  """{computation: its instruction lines} of an HLO module's text, and the name of its entry."""
  comps, name, entry = {}, None, None
  for line in hlo_text.splitlines():
    if m := re.match(r"(ENTRY )?%([\w.\-]+) \(", line):
      name = m.group(2)
      entry = name if m.group(1) else entry
      comps[name] = []
    elif name is not None and line.startswith("  "):
      comps[name].append(line)
  return comps, entry


def mosaic_traffic(hlo_text: str, bandwidth: float) -> list[dict]:
  """Each Mosaic GPU custom call of an optimized HLO module: its kernel (the innermost named scope
  of its op_name), the bytes of its operands and of its results (MiB), the time those bytes take at
  `bandwidth` bytes/s (ms), and `conditional`: whether it lies in a conditional's branch or a while
  loop's body (it runs when taken), not in what every call of the program runs. Operands are an
  upper bound of what the kernel reads (it may skip tail chunks, or only write an aliased buffer);
  results are written. Calls come in program order, the entry's first."""
  comps, entry = _computations(hlo_text)
  callees = {c: [] for c in comps}
  for c, lines in comps.items():
    for line in lines:
      callees[c] += [(m.group(1) in _TAKEN, m.group(2)) for m in _CALLED.finditer(line)]
      if b := re.search(r"branch_computations=\{([^}]*)\}", line):
        callees[c] += [(True, x.strip().lstrip("%")) for x in b.group(1).split(",")]

  def reached(follow):
    """The computations the entry reaches through the calls `follow` takes, breadth first."""
    seen, todo = [], [entry] if entry else list(comps)
    while todo:
      c = todo.pop(0)
      if c in comps and c not in seen:
        seen.append(c)
        todo += [callee for when_taken, callee in callees[c] if follow(when_taken)]
    return seen
  order, always = reached(lambda when_taken: True), set(reached(lambda when_taken: not when_taken))
  out = []
  for c in order:
    for line in comps[c]:
      if 'custom_call_target="mosaic_gpu' not in line or " custom-call(" not in line:
        continue
      result = line.split(" custom-call(", 1)[0].split("=", 1)[1]
      operands = re.search(r"operand_layout_constraints=\{(.*?)\}, (?:output_to|api_version)", line)
      name = re.search(r'op_name="([^"]*)"', line)
      scopes = name.group(1).split("/") if name else ["?", "?"]
      read, write = _array_bytes(operands.group(1)) if operands else 0, _array_bytes(result)
      out.append({"kernel": scopes[-2] if len(scopes) > 1 else scopes[0], "read_mb": read / 2**20,
                  "write_mb": write / 2**20, "aliased": "output_to_operand_aliasing" in line,
                  "conditional": c not in always, "floor_ms": (read + write) / bandwidth * 1e3})
  return out


@contextlib.contextmanager
def ptxas_logs(on, summary):
  """Within (if on): Mosaic GPU dumps each kernel it compiles (MOSAIC_GPU_DUMP_TO, read by its C++
  per module); after, `summary` gets ptxas_summary of the logs."""
  if not on:
    yield
    return
  d = tempfile.mkdtemp(prefix="kda-mosaic-dump-")
  old = os.environ.get("MOSAIC_GPU_DUMP_TO")
  os.environ["MOSAIC_GPU_DUMP_TO"] = d
  try:
    yield
  finally:
    if old is None:
      del os.environ["MOSAIC_GPU_DUMP_TO"]
    else:
      os.environ["MOSAIC_GPU_DUMP_TO"] = old
    texts = []
    for f in sorted(glob.glob(os.path.join(d, "*.ptxas"))):
      with open(f) as fh:
        texts.append(fh.read())
    summary.update(ptxas_summary(texts))
    print(f"  Mosaic GPU's dumps: {d}", flush=True)


@contextlib.contextmanager
def as_hopper(on):
  """Within (if on): kda's pipeline takes the platform for an H200 (its kernels lowered for CUDA)."""
  if not on:
    yield
    return
  with mock.patch("kda.plan.platform_of", lambda device=None: ("gpu", "sm90")):
    yield


def phases(fn, args, lower_only, run=True):
  """Seconds of trace, lower (and compile; and with `run` the first call) of jax.jit(fn) on args."""
  out = {}
  t0 = time.perf_counter()
  traced = jax.jit(fn).trace(*args)
  out["trace_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  lowered = traced.lower(lowering_platforms=("cuda",)) if lower_only else traced.lower()
  out["lower_s"] = time.perf_counter() - t0
  if lower_only:
    return out
  t0 = time.perf_counter()
  compiled = lowered.compile()
  out["compile_s"] = time.perf_counter() - t0
  if not run:
    return out
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  out["first_call_s"] = time.perf_counter() - t0
  return out


def report_one(name, gate, total, do_bwd, kernels, lower_only, ptxas=False, config=""):
  with as_hopper(lower_only):
    args, fwd, loss = bench.calls(name, gate, "auto", total, config)
  if lower_only:
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  fn = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)) if do_bwd else (lambda *a: fwd(*a))
  calls = []
  regs = {}
  with as_hopper(lower_only), recording_kernels(calls), ptxas_logs(ptxas and not lower_only, regs):
    row = {"variant": f"{name}:{gate}", "program": "fwd+bwd" if do_bwd else "fwd", **phases(fn, args, lower_only)}
    if not lower_only:       # the workers' compiles (their ptxas logs included) have ended
      n, busy, errors = _precompile.wait()
      row.update(precompile=_precompile.enabled(), precompiled=n, precompile_busy_s=busy,
                 precompile_errors=[str(e)[:200] for e in errors])
  if regs:
    row["ptxas"] = regs
  row["kernel_calls"] = len(calls)
  if kernels:
    rows = []
    # each kernel's own compile: not taken early from its lowering
    with as_hopper(lower_only), mock.patch.dict(os.environ, {"KDA_PRECOMPILE": "0", "KDA_LOWERING_CACHE": "0"}):
      for kname, f, avals in calls:
        r = {"kernel": kname, **phases(f, avals, lower_only, run=False)}   # abstract arguments
        rows.append(r)
        print(f"  {kname:32s} " + " ".join(f"{k} {v:6.2f}" for k, v in r.items() if k.endswith("_s")), flush=True)
    row["kernels"] = rows
    for key in ("lower_s", "compile_s"):
      if rows and key in rows[0]:
        row[f"kernels_{key}"] = sum(r[key] for r in rows)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain")
  p.add_argument("--total", type=int, default=bench.TOTAL)
  p.add_argument("--no-bwd", action="store_true", help="the forward alone (default: forward + backward)")
  p.add_argument("--kernels", action="store_true", help="also lower and compile each Mosaic GPU kernel alone")
  p.add_argument("--lower-only", action="store_true", help="lower for CUDA, compile nothing (a CPU)")
  p.add_argument("--ptxas", action="store_true",
                 help="each kernel's registers and spills from ptxas's log (Mosaic GPU's dumps, in a temporary folder)")
  p.add_argument("--no-precompile", action="store_true",
                 help="kda._precompile off: every kernel compiles inside XLA's compile of the program")
  p.add_argument("--no-lowering-cache", action="store_true",
                 help="kda._lowering_cache off: every program lowers each of its kernels")
  p.add_argument("--config", default="", help="configs of the call, name.field=value,... (tools.configs)")
  p.add_argument("--out")
  a = p.parse_args(argv)
  if a.no_precompile:
    os.environ["KDA_PRECOMPILE"] = "0"
  if a.no_lowering_cache:
    os.environ["KDA_LOWERING_CACHE"] = "0"
  rows = []
  for var in filter(None, a.variants.split(",")):
    name, gate = var.split(":")
    row = report_one(name, gate, a.total, not a.no_bwd, a.kernels, a.lower_only, a.ptxas, a.config)
    rows.append(row)
    for kname, r in row.get("ptxas", {}).items():
      print(f"  ptxas {kname:48s} " + " ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "ptxas")}), flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(rows, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
