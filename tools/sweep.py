"""python -m tools.sweep: time each forward kernel under several Configs on realistic inputs (GPU).

Records the reference pipeline's stage inputs once per length profile (T = 32768 packed, H = 16,
K = V = 128, bf16), then for every stage and Config prints the median time and the max relative
difference of every output field against the stage's jnp reference on the same inputs. Used to
choose the default Configs; results go to --out as JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import numpy as np

from kda import stages
from kda.stages import gate, intra, output, state
from tools import bench
from tools.stages import record_reference

H, K = 16, 128


def grid(cls, **axes):
  keys = list(axes)
  return [cls(**dict(zip(keys, vals))) for vals in itertools.product(*(axes[k] for k in keys))]


CONFIGS = {
    "gate": lambda: grid(gate.pallas.Config, num_warps=[1, 2, 4]),
    "intra": lambda: grid(intra.pallas.Config, precision=["highest", "tf32x3", "tf32"], num_warps=[4, 8]),
    "state": lambda: grid(state.pallas.Config, precision=["highest", "tf32x3", "tf32"], block_v=[32, 64],
                                 num_warps=[4, 8]),
    "output": lambda: grid(output.pallas.Config, precision=["highest", "tf32x3", "tf32"], block_v=[64, 128],
                                  num_warps=[4, 8]),
}


def rel(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default="long,short")
  p.add_argument("--stages", default="gate,intra,state,output")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--out")
  a = p.parse_args(argv)
  ranges = {"long": (64, 4096), "short": (1, 128)}
  results = []
  for case in a.cases.split(","):
    lens = bench.varlen_lens(bench.TOTAL, *ranges[case])
    plan, rec, _ = record_reference(lens, head_dim=K, heads=H, dtype="bfloat16", gate="plain",
                                    interpret=False)
    for name in a.stages.split(","):
      st = stages.get(name)
      kw = plan.stage_kwargs(name)
      args = rec["inputs"][name]
      want = rec[name]
      ref_ms = bench.timeit(jax.jit(lambda *x, st=st: st.reference(*x, **kw)), *args, reps=a.reps)
      print(f"{case} {name} reference {ref_ms:.3f} ms", flush=True)
      for cfg in CONFIGS[name]():
        fn = jax.jit(lambda *x, st=st, cfg=cfg: st.pallas(*x, interpret=False, config=cfg, **kw))
        try:
          got = fn(*args)
          errs = {f: rel(getattr(got, f), getattr(want, f)) for f in want._fields}
          ms = bench.timeit(fn, *args, reps=a.reps)
          row = dict(case=case, stage=name, config=repr(cfg), ms=ms, ref_ms=ref_ms, rel=errs)
        except Exception as e:  # noqa: BLE001 - a config the GPU rejects is a result too
          row = dict(case=case, stage=name, config=repr(cfg), error=f"{type(e).__name__}: {e}"[:400])
        results.append(row)
        print(json.dumps(row), flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(results, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
