"""python -m tools.packed_check: the packed backward against the aligned one (GPU).

For each shape:gate of tools.bench, jax.grad of sum(o * do) (o as aux) is compiled twice, with
kda.pipeline.PACKED_BACKWARD on (the default: g read packed by S0 and S5, dq, dk, dv, dg stored
packed by S4, S3, S5) and off (g aligned and the gradients unaligned by XLA gathers); --variant
and --baseline set other kda.pipeline switches for either side (e.g. --variant TAIL_ZEROS=0
--baseline "" checks the unwritten tail against the default), or a kda module's when dotted
(--variant kda.stages.bwd_wy.mosaic_gpu.INPLACE=0 --baseline ""). It prints,
per output (dq, dk, dv, dg, dbeta, o), whether the two are bit for bit equal and where not how many
entries differ and by how much, then both timings (median of --reps, as tools.bench), compile times
and XLA temporaries. Exit status 1 if an output is not finite or differs by more than --max-ulps
bf16 rounding steps of its value (2^-8 relative each).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kda import pipeline
from tools import bench

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "o")


def compare(a, b, max_ulps=1):
  """a, b: arrays of one output (packed, aligned) -> dict: same (bit for bit), finite, count of
  differing entries, max |a - b|, and within (every difference at most max_ulps bf16 steps of the
  larger magnitude: 2^-8 relative per step)."""
  a, b = np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32))
  finite = bool(np.isfinite(a).all() and np.isfinite(b).all())
  d = np.abs(a - b)
  step = np.maximum(np.abs(a), np.abs(b)) * 2.0 ** -8
  return {"same": bool(np.array_equal(a, b)), "finite": finite, "differ": int(np.count_nonzero(d)),
          "size": int(a.size), "max_abs": float(d.max()) if d.size else 0.0,
          "within": finite and bool(np.all(d <= max_ulps * step))}


def target(name):
  """A switch's (module, attribute): NAME is kda.pipeline's, a dotted kda.x.y.NAME that module's."""
  mod, _, attr = name.rpartition(".")
  if not mod:
    return pipeline, name
  if not mod.startswith("kda."):
    raise ValueError(f"{name!r}: a dotted switch must name a kda module")
  return importlib.import_module(mod), attr


def switches(text):
  """"NAME=0,OTHER=1" -> {NAME: False, OTHER: True}: boolean module switches of kda.pipeline, or of
  another kda module when dotted (kda.stages.bwd_wy.mosaic_gpu.INPLACE=0)."""
  out = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, _, value = item.partition("=")
    mod, attr = target(name)
    if not isinstance(getattr(mod, attr, None), bool):
      raise ValueError(f"{name!r} is not a boolean switch of {mod.__name__}")
    out[name] = value.strip().lower() in ("1", "true", "on")
  return out


def check(name, gate, reps, total=bench.TOTAL, impl="auto", max_ulps=1, variant=None, baseline=None):
  args, fwd, _ = bench.calls(name, gate, impl, total)

  def loss(q, k, v, g, beta, dk, tk, do):
    o = fwd(q, k, v, g, beta, dk, tk)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

  out = {"shape": name, "gate": gate}
  fns = {}
  sides = (("packed", {} if variant is None else variant),
           ("aligned", dict(PACKED_BACKWARD=False) if baseline is None else baseline))
  for mode, sets in sides:
    saved = {k: getattr(*target(k)) for k in sets}
    for k, val in sets.items():
      setattr(*target(k), val)
    try:
      t0 = time.perf_counter()
      f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)).lower(*args).compile()
      out[f"{mode}_compile_s"] = round(time.perf_counter() - t0, 1)
      m = f.memory_analysis()
      out[f"{mode}_temp_mb"] = None if m is None else round(m.temp_size_in_bytes / 2**20)
      fns[mode] = f
    finally:
      for k, val in saved.items():
        setattr(*target(k), val)
  res = {m: jax.tree.leaves(f(*args)) for m, f in fns.items()}
  out["outputs"] = {n: compare(a, b, max_ulps) for n, a, b in zip(NAMES, res["packed"], res["aligned"])}
  for mode, f in fns.items():
    out[f"{mode}_ms"] = bench.timeit(f, *args, reps=reps)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain,B:plain,C:plain", help="shape:gate pairs (tools.bench)")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--total", type=int, default=bench.TOTAL, help="packed tokens (smaller for a smoke run)")
  p.add_argument("--impl", default="auto", help="auto (chunk_kda's default) or an impl string (mosaic_gpu "
                                                 "on a CPU runs the simulator)")
  p.add_argument("--max-ulps", type=int, default=1)
  p.add_argument("--variant", default="", help="kda.pipeline switches of the checked side, NAME=0|1,...")
  p.add_argument("--baseline", default="PACKED_BACKWARD=0", help="kda.pipeline switches of the reference side")
  p.add_argument("--out", help="write results as JSON")
  a = p.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  rows, ok = [], True
  for var in a.variants.split(","):
    name, gate = var.split(":")
    r = check(name, gate, a.reps, a.total, a.impl, a.max_ulps, switches(a.variant), switches(a.baseline))
    rows.append(r)
    ok &= all(o["within"] for o in r["outputs"].values())
    print(json.dumps(r), flush=True)
    for n, o in r["outputs"].items():
      what = "bit for bit" if o["same"] else f"{o['differ']} of {o['size']} differ, max |d| {o['max_abs']:.3g}"
      print(f"  {var} {n:6s} {what}{'' if o['within'] else '  OUT OF BOUNDS'}")
    print(f"  {var} fwd+bwd ms: checked {r['packed_ms']:.3f}, baseline {r['aligned_ms']:.3f}; compile s "
          f"{r['packed_compile_s']} / {r['aligned_compile_s']}; XLA temp MiB {r['packed_temp_mb']} / "
          f"{r['aligned_temp_mb']}", flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(rows, fh, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
