"""AOT-compile the Mosaic TPU backward kernels for v5e, v6e, v7x at production shapes (needs libtpu).

  JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=$PWD /work/tpu-venv/bin/python \
      tools/tpu_bwd_aot.py [--stages bwd_dav,bwd_dh] [--gen v5e,v6e,v7x] [--dtype bf16,f32]

Shapes: one row of T = 8192 aligned tokens in 4 sequences, HV = 16, K = V = 128, BT = 64
(tests/stages/tpu_bwd_setup.specs; bwd_fused is kda.fused.bwd_walk.mosaic_tpu). Prints,
per kernel x generation x dtype: compiled or the error, the VMEM the kernel asks for
(vmem_limit_bytes) against the generation's VMEM, memory_analysis() temp bytes, cost flops.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, "/work/shared/tpu_probe")
from aot_compile import size, tpu_mesh  # noqa: E402

from tests.stages.tpu_bwd_setup import specs  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def compile_for(fn, args, gen):
  """fn AOT-compiled for `gen` on the ShapeDtypeStruct pytree args -> (compiled, lowered)."""
  mesh = tpu_mesh(gen)
  sh = NamedSharding(mesh, P())
  args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), args)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = jax.jit(fn).trace(*args).lower()
  return lowered.compile(), lowered


def vmem_asked(text):
  """Scoped VMEM each Mosaic call asks for (its vmem_limit_bytes, in the custom call's config)."""
  return [int(x) for x in re.findall(r"scoped_memory_configs\\22: \[\{\\22memory_space\\22:1, "
                                      r"\\22offset\\22: 0, \\22size\\22: (\d+)", text)]


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--stages", default="bwd_recompute,bwd_dav,bwd_dh,bwd_wy,bwd_intra,bwd_gate,bwd_fused")
  ap.add_argument("--gen", default="v5e,v6e,v7x")
  ap.add_argument("--dtype", default="bf16,f32")
  a = ap.parse_args(argv)
  failed = 0
  for stage in a.stages.split(","):
    mod = importlib.import_module("kda.fused.bwd_walk.mosaic_tpu" if stage == "bwd_fused" else f"kda.stages.{stage}.mosaic_tpu")
    for dname in a.dtype.split(","):
      dt = {"bf16": BF16, "f32": F32}[dname]
      args, kw = specs(stage, dt)
      for gen in a.gen.split(","):
        t = time.perf_counter()
        try:
          compiled, lowered = compile_for(functools.partial(mod.apply, **kw), args, gen)
          m = compiled.memory_analysis()
          cost = compiled.cost_analysis() or {}
          cost = cost[0] if isinstance(cost, (list, tuple)) else cost
          with jax.sharding.use_abstract_mesh(tpu_mesh(gen).abstract_mesh):
            from jax.experimental.pallas import tpu as pltpu
            cap = pltpu.get_tpu_info().vmem_capacity_bytes
          asked = vmem_asked(lowered.as_text())
          n = compiled.as_text().count('custom_call_target="tpu_custom_call"')
          print(f"{stage:14s} {dname:4s} {gen}: ok {time.perf_counter() - t:5.1f}s | kernels {n} | vmem asked "
                f"{'/'.join(size(x) for x in asked)} of {size(cap)} | temp {size(m.temp_size_in_bytes)} | "
                f"args {size(m.argument_size_in_bytes)} | out {size(m.output_size_in_bytes)} | "
                f"flops {cost.get('flops', float('nan')):.3g}", flush=True)
        except Exception as e:  # noqa: BLE001  report and go on
          failed += 1
          msg = " | ".join(l for l in f"{type(e).__name__}: {e}".splitlines() if l.strip())[:900]
          print(f"{stage:14s} {dname:4s} {gen}: FAILED {msg}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
