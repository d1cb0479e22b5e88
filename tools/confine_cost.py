"""python -m tools.confine_cost: what kda.confine costs a call, measured interleaved in one process.

Separate tools.bench processes move by several percent from one to the next on a GPU, more than
the cost measured here. This tool compiles tools.bench's forward and forward+backward of one shape
twice in the same process, as shipped and with `kda.confine.confined` replaced by the plain call
(the segmented layout run on the raw inputs: what the call would cost without confinement, and
what it would give for finite inputs), then times them in alternating rounds (tools.bench.timeit,
median of --reps calls each) and prints the medians and the median of the per-round ratios.
Only calls that run the segmented layout (shape B: many short sequences) go through kda.confine.
The forward + backward is jax.grad of tools.bench's loss (tools.bench's program: the forward's o is
then dead and JAX drops the kernel computing it, from both programs: the backward's check reads
its probe, not o), or with --value jax.value_and_grad (a training step: the loss uses o).

--kernels (any machine, no GPU): instead of timing, lowers the four forward + backward programs
(confined and plain, jax.grad and jax.value_and_grad) for an H200 and prints the kda kernels each
holds: under jax.grad of the linear loss neither has the state+output kernel outside the confined
backward's rerun (JAX drops what computes the dead o before XLA sees the program).

  python -m tools.confine_cost [--shape B] [--rounds 9] [--reps 10] [--total 32768] [--value] [--kernels]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
from unittest import mock

import jax

from kda import confine
from tools import bench


def _plain(run, probed, seqs, q, k, v, g, beta, rest):
  del seqs
  return run(q, k, v, g, beta, *(rest[:-1] if probed else rest))   # no probe: the unconfined backward


def kernels(text: str) -> dict:
  """{kda kernel name: Mosaic GPU custom calls of it} in a lowered program's text."""
  calls = text.split("stablehlo.custom_call @mosaic_gpu_v2")[1:]
  found = collections.Counter()
  for call in calls:
    m = re.search(r"kda_[a-z_]+?(?=_*mosaic_gpu|_*\W)", call)
    found[m.group(0).rstrip("_") if m else "?"] += 1
  return dict(sorted(found.items()))


def lowered_kernels(shape, total, diffs=(jax.grad, jax.value_and_grad)) -> dict:
  """{(wrapper, diff name): kernels()} of the forward + backward lowered for an H200 from this
  machine (kda's plan taking the platform for one; no GPU needed)."""
  from tools import compile_report
  with compile_report.as_hopper(True):
    args, _, loss = bench.calls(shape, "plain", "auto", total=total)
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  shipped, out = confine.confined, {}
  try:
    for name, wrapper in (("confined", shipped), ("plain", _plain)):
      confine.confined = wrapper
      for diff in diffs:
        fb = jax.jit(diff(lambda *x, _l=loss: _l(*x), argnums=(0, 1, 2, 3, 4, 5)))
        with compile_report.as_hopper(True), mock.patch.dict(os.environ, {"KDA_PRECOMPILE": "0"}):
          text = fb.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        out[(name, diff.__name__)] = kernels(text)
  finally:
    confine.confined = shipped
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="B")
  p.add_argument("--rounds", type=int, default=9)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--total", type=int, default=bench.TOTAL, help="tokens of the shape")
  p.add_argument("--value", action="store_true", help="forward + backward as jax.value_and_grad")
  p.add_argument("--kernels", action="store_true",
                 help="print the kda kernels of each lowered forward + backward program instead of timing")
  a = p.parse_args(argv)
  if a.kernels:
    for (name, diff), found in lowered_kernels(a.shape, a.total).items():
      print(f"{a.shape} {name} {diff}: {sum(found.values())} kernels: "
            + ", ".join(f"{k} x{n}" for k, n in found.items()), flush=True)
    return
  args, fwd, loss = bench.calls(a.shape, "plain", "auto", total=a.total)
  shipped, fns = confine.confined, {}
  try:
    for name, wrapper in (("confined", shipped), ("plain", _plain)):
      confine.confined = wrapper       # read when the call is traced, i.e. at the first call below
      f = jax.jit(lambda *x, _f=fwd: _f(*x))
      diff = jax.value_and_grad if a.value else jax.grad
      fb = jax.jit(diff(lambda *x, _l=loss: _l(*x), argnums=(0, 1, 2, 3, 4, 5)))
      jax.block_until_ready(f(*args))
      jax.block_until_ready(fb(*args))
      temp = lambda fn: fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 20
      fns[name] = (f, fb)
      print(f"{name}: XLA temp MiB forward {temp(f):.0f}, forward+backward {temp(fb):.0f}", flush=True)
  finally:
    confine.confined = shipped
  times = {name: ([], []) for name in fns}
  for r in range(a.rounds):
    for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
      for i, fn in enumerate(fns[name]):
        times[name][i].append(bench.timeit(fn, *args, reps=a.reps))
  for i, what in enumerate(("forward", "forward+backward")):
    c, b = times["confined"][i], times["plain"][i]
    ratios = [x / y for x, y in zip(c, b)]
    print(f"{a.shape} {what}: confined {statistics.median(c):.3f} ms, plain {statistics.median(b):.3f} ms, "
          f"ratio {statistics.median(ratios):.4f} (rounds {min(ratios):.3f}..{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
  main()
