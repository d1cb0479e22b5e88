"""What one KDA layer holds between its forward and its backward (the residuals: the leaves of
jax.vjp's closure), kda and jax-linear-attention (jla) on tools.bench's shapes, abstractly evaluated
for a deviceless H200 (no GPU needed; jla's Hopper check is answered yes, since its kernels are only
traced here). In a model of L layers trained without rematerialisation, L times these bytes live
at the backward's start.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/h200-aot-2026-12-07b/residuals.py \
      --variants A,B,C --out benchmarks/h200-aot-2026-12-07b/residuals.json

Needs jax[cuda12] and the jla wheel (../shared/peer); its inputs are jla_bench.py's."""
import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "..", "shared", "peer"), os.path.join(ROOT, ".peer")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tools import bench  # noqa: E402
from tools.h200_aot import target_device  # noqa: E402


def residuals(fn, args, device):
  """[(shape, dtype, bytes)] of the vjp closure's leaves, largest first."""
  sh = jax.sharding.SingleDeviceSharding(device)
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), args)
  with jax.default_device(device):
    res = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *spec)
  out = [(list(x.shape), str(x.dtype), int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize)
         for x in jax.tree.leaves(res)]
  return sorted(out, key=lambda r: -r[2])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--variants", default="A,B,C")
  p.add_argument("--out")
  a = p.parse_args()
  import common
  import jla_bench
  from jla.ops.mosaic_gpu import vector_gate_ops
  from jla.ops.mosaic_gpu.kda import kda as jla_kda
  vector_gate_ops.is_hopper = lambda: True
  dev = target_device()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
  out = {"tool": "residuals", "run": {"commit": commit.strip(), "jax": jax.__version__}, "shapes": {}}
  for name in a.variants.split(","):
    args, fwd, _ = bench.calls(name, "plain", "auto", device=dev)
    q, k, v, g, beta, dkw, tkw, _ = args
    kda_leaves = residuals(lambda q, k, v, g, beta, dkw: fwd(q, k, v, g, beta, dkw, tkw), (q, k, v, g, beta, dkw), dev)
    s = common.shapes()[name]
    x = jla_bench.inputs(s["B"], s["T"], common.H, common.K, common.V)
    sid = None if s["cu"] is None else jla_bench.seg_ids(s["cu"], s["T"])
    jla_leaves = residuals(lambda q, k, v, g, beta: jla_kda(q, k, v, g, beta, segment_ids=sid)[0],
                           (x["q"], x["k"], x["v"], x["g"], x["beta"]), dev)
    out["shapes"][name] = {}
    for who, leaves in (("kda", kda_leaves), ("jla", jla_leaves)):
      mib = sum(r[2] for r in leaves) / 2**20
      out["shapes"][name][who] = {"residual_MiB": mib, "leaves": leaves}
      print(f"{name} {who}: {mib:.0f} MiB in {len(leaves)} arrays", flush=True)
      for shape, dtype, nbytes in leaves:
        if nbytes >= 2**20:
          print(f"    {shape} {dtype} {nbytes / 2**20:.0f} MiB")
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
