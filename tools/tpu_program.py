"""python -m tools.tpu_program: compile chunk_kda's forward and a training step for TPU generations
ahead of time, on a machine without a TPU (needs libtpu: jax[tpu] of the installed jax's version;
not part of CI).

  JAX_PLATFORMS=cpu PYTHONPATH=$PWD /work/tpu-venv/bin/python -m tools.tpu_program --out tpu.json
  ... -m tools.tpu_program --gen v7x --shapes fixed --impls auto,reference

The call is traced as on a TPU host (jax.default_backend() says "tpu", jax.devices() are the
topology's), so impl=None ("auto") picks what it picks there. Shapes (bf16 q, k, v, beta, H = 16,
K = V = 128, chunk 64):
  varlen  B=1, T=8192, 8 sequences through a traced cu_seqlens, initial_state and
          output_final_state, float32 gates
  fixed   B=4, T=2048, bfloat16 gates
  A, B, C tools.bench's shapes (A, B: T=32768 packed, lengths in [64, 4096] and [1, 128]; C: B=4,
          T=8192), float32 gates
Per generation, shape and impl: the forward (o and the final state) and the training step
(jax.value_and_grad of a loss of both outputs, in q, k, v, g, beta and the initial state) compiled
or the error, the Mosaic TPU custom calls in each, memory_analysis()'s temp bytes and
cost_analysis()'s flops and bytes; with the jnp path ("reference") beside, the training step's temp
against it.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kda
from tools import bench

TOPOLOGIES = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "v7x": "tpu7x:1x1x1"}
# HBM bandwidth per chip, bytes/s (published figures; a v7x chip's is shared by its two TensorCores,
# so a one-core program's estimate is a lower bound)
HBM = {"v5e": 819e9, "v6e": 1640e9, "v7x": 7370e9}
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s16": 2}
H, K, V, BT = 16, 128, 128, 64


@functools.cache
def tpu_mesh(gen: str) -> Mesh:
  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[gen], platform="tpu",
                                      chips_per_host_bounds=(1, 1, 1))
  return Mesh(np.array(topo.devices[:1]), ("x",))


@contextlib.contextmanager
def tpu_host(gen: str):
  """jax.default_backend() -> "tpu" and jax.devices() -> the topology's devices inside the block."""
  devs, saved = list(tpu_mesh(gen).devices.flat), (jax.default_backend, jax.devices, jax.local_devices)
  pick = lambda orig: lambda backend=None, **kw: devs if backend in (None, "tpu") else orig(backend, **kw)
  jax.default_backend, jax.devices, jax.local_devices = (lambda: "tpu"), pick(saved[1]), pick(saved[2])
  try:
    yield
  finally:
    jax.default_backend, jax.devices, jax.local_devices = saved


def shape_specs(name: str):
  """(B, T, N or None (fixed rows), gate dtype, with states)."""
  if name == "varlen":
    return 1, 8192, 8, jnp.float32, True
  if name == "fixed":
    return 4, 2048, None, jnp.bfloat16, False
  if name in ("A", "B"):
    lo, hi = (64, 4096) if name == "A" else (1, 128)
    return 1, bench.TOTAL, len(bench.varlen_lens(bench.TOTAL, lo, hi)), jnp.float32, False
  if name == "C":
    return 4, 8192, None, jnp.float32, False
  raise ValueError(f"unknown shape {name!r}")


def programs(name: str, impl):
  """(forward, step, specs): the two functions of a shape and their argument specs."""
  B, T, N, gdt, states = shape_specs(name)
  S = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  specs = [S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, H, V), bf), S((B, T, H, K), gdt), S((B, T, H), bf)]
  specs.append(S((N + 1,), jnp.int32) if N is not None else None)
  specs.append(S((N if N is not None else B, H, K, V), jnp.float32) if states else None)

  def forward(q, k, v, g, beta, cu, h0):
    return kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=states,
                         chunk_size=BT, impl=impl)

  def loss(q, k, v, g, beta, cu, h0):
    o, ht = forward(q, k, v, g, beta, cu, h0)
    out = jnp.mean(jnp.square(o.astype(jnp.float32)))
    return out + (0.0 if ht is None else jnp.mean(ht))

  argnums = (0, 1, 2, 3, 4) + ((6,) if states else ())
  return forward, jax.value_and_grad(loss, argnums=argnums), specs


def _bytes(shapes: str) -> int:
  total = 0
  for dt, dims in re.findall(r"\b(f32|s32|u32|bf16|f16|s8|u8|pred|s16)\[([\d,]*)\]", shapes):
    total += BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def mosaic_kernels(hlo: str):
  """[(kernel name, bytes in, bytes out)] of each Mosaic TPU call in a compiled HLO text: the
  operands' and results' sizes, what the kernel must move through HBM at least once."""
  out = []
  for line in hlo.splitlines():
    if 'custom_call_target="tpu_custom_call"' not in line:
      continue
    m = re.match(r"\s*%?([\w.\-]+) = (.*?) custom-call\(", line)
    start = line.find("operand_layout_constraints={")
    ins, depth = "", 0
    for ch in line[start + len("operand_layout_constraints="):] if start >= 0 else "":
      depth += {"{": 1, "}": -1}.get(ch, 0)
      ins += ch
      if depth == 0:
        break
    if m:
      out.append((m.group(1).split(".")[0], _bytes(ins), _bytes(m.group(2))))
  return out


def compile_one(fn, specs, gen):
  mesh = tpu_mesh(gen)
  sh = NamedSharding(mesh, P())
  specs = [None if s is None else jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s in specs]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tpu_host(gen):
    lowered = jax.jit(fn).trace(*specs).lower()
  compiled = lowered.compile()
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  kernels = [{"kernel": n, "in_mib": i / 2**20, "out_mib": o / 2**20, "roofline_us": (i + o) / HBM[gen] * 1e6}
             for n, i, o in mosaic_kernels(text)]
  return {"mosaic_calls": text.count('custom_call_target="tpu_custom_call"'), "kernels": kernels,
          "temp_mib": m.temp_size_in_bytes / 2**20, "args_mib": m.argument_size_in_bytes / 2**20,
          "flops": cost.get("flops"), "bytes": cost.get("bytes accessed")}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gen", default="v5e,v6e,v7x")
  ap.add_argument("--shapes", default="varlen,fixed,A,B,C")
  ap.add_argument("--impls", default="auto,reference", help="auto (impl=None) and/or backend names")
  ap.add_argument("--parts", default="forward,step")
  ap.add_argument("--out", help="write the rows as JSON")
  a = ap.parse_args(argv)
  rows = []
  for gen in a.gen.split(","):
    for name in a.shapes.split(","):
      for impl in a.impls.split(","):
        fwd, step, specs = programs(name, None if impl == "auto" else impl)
        for part, fn in (("forward", fwd), ("step", step)):
          if part not in a.parts:
            continue
          row = {"gen": gen, "shape": name, "impl": impl, "program": part}
          t = time.perf_counter()
          try:
            row.update(compile_one(fn, specs, gen))
          except Exception as e:  # noqa: BLE001 - report and go on
            row["error"] = " | ".join(l for l in f"{type(e).__name__}: {e}".splitlines() if l.strip())[:600]
          row["compile_s"] = round(time.perf_counter() - t, 1)
          rows.append(row)
          print(json.dumps(row), flush=True)
  print("\n| gen | shape | program | impl | Mosaic calls | temp MiB | vs reference | compile s |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  ref = {(r["gen"], r["shape"], r["program"]): r.get("temp_mib") for r in rows if r["impl"] == "reference"}
  for r in rows:
    base = ref.get((r["gen"], r["shape"], r["program"]))
    vs = f"{r['temp_mib'] / base:.2f}x" if base and "temp_mib" in r else ""
    got = (f"{r['mosaic_calls']} | {r['temp_mib']:.0f}" if "error" not in r else f"error | {r['error'][:80]}")
    print(f"| {r['gen']} | {r['shape']} | {r['program']} | {r['impl']} | {got} | {vs} | {r['compile_s']} |")
  print("\nMosaic TPU kernels (auto): bytes each call reads and writes at least once, and the time those take "
        "at the chip's HBM bandwidth")
  print("| gen | shape | program | kernel | in MiB | out MiB | roofline us |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    for kr in r.get("kernels", []):
      print(f"| {r['gen']} | {r['shape']} | {r['program']} | {kr['kernel']} | {kr['in_mib']:.1f} | "
            f"{kr['out_mib']:.1f} | {kr['roofline_us']:.0f} |")
  if a.out:
    run = {"commit": bench.run_info()["commit"], "target": "TPU " + ", ".join(a.gen.split(",")) + " (ahead of time)",
           "jax": jax.__version__}
    with open(a.out, "w") as fh:
      json.dump({"tool": "tools.tpu_program", "run": run, "rows": rows}, fh, indent=1)
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
