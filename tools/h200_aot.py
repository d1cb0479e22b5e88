"""Compile kda for an NVIDIA H200 on a machine without a GPU: jax's deviceless ahead-of-time compile
through its CUDA plugin (needs jax[cuda12] of the installed jax's version; not part of CI).

  JAX_PLATFORMS=cpu PYTHONPATH=$PWD /path/to/cuda-venv/bin/python -m tools.h200_aot
      [--variants A,B,C] [--config TEXT] [--no-bwd] [--kernels] [--traffic] [--out FILE.json]

Per shape of tools.bench (its inputs and calls, cu_seqlens traced): XLA's memory analysis of the
compiled forward and forward + backward (temp, arguments, outputs in MiB: the compiler and the
figures tools.bench reads on the device), and the seconds this machine took to lower and compile
each. With --traffic, every Mosaic GPU call of each program: the bytes of its operands (an upper
bound of what it reads) and of its results, and the time those bytes take at the H200's bandwidth
(a floor for a kernel that moves them once; the device profile, tools.profile, gives the time it
takes). With --kernels, ptxas's report of every Mosaic GPU kernel the programs compile (registers per
thread and spills: tools.compile_report's parser): a kernel of one warpgroup at R registers runs at
most 65536 // (128 * R) CTAs per SM, whatever its SMEM.

The plan targets the H200 through `jax.default_device` (kda.plan.platform_of reads it), so the
stages choose and compile exactly what they would on the device. The device description
(`TARGET`) is the H200's as the CUDA plugin reports it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H200"
"""

def target_device():
  """The deviceless H200 (a topology device: compile for it, never run on it)."""
  from jax.experimental import topologies
  return topologies.get_topology_desc(platform="cuda", target_config=TARGET, topology="1x1x1").devices[0]


BANDWIDTH = 4.8e12   # the H200's HBM bytes/s (TARGET's memory_bandwidth)


def compile_shape(name: str, config: str, bwd: bool, device, traffic=False) -> dict:
  import jax
  from tools import bench
  from tools.compile_report import mosaic_traffic
  args, fwd, loss = bench.calls(name, "plain", "auto", config=config, device=device)   # made on the host
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
  calls = {"fwd": fwd}
  if bwd:
    calls["fwdbwd"] = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))
  out = {}
  with jax.default_device(device):
    for label, fn in calls.items():
      t0 = time.perf_counter()
      lowered = jax.jit(fn).lower(*spec)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      m = compiled.memory_analysis()
      out[label] = {"temp_mb": m.temp_size_in_bytes / 2**20, "args_mb": m.argument_size_in_bytes / 2**20,
                    "out_mb": m.output_size_in_bytes / 2**20, "lower_s": t1 - t0,
                    "compile_s": time.perf_counter() - t1}
      if traffic:
        out[label]["traffic"] = mosaic_traffic(compiled.as_text(), BANDWIDTH)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A,B,C", help="tools.bench shapes")
  p.add_argument("--config", default="", help="tools.configs text, e.g. bwd_wy.split=1")
  p.add_argument("--no-bwd", action="store_true", help="the forward alone")
  p.add_argument("--kernels", action="store_true", help="ptxas's report of every Mosaic GPU kernel")
  p.add_argument("--traffic", action="store_true",
                 help="each Mosaic GPU call's operand and result bytes and their time at the H200's bandwidth")
  p.add_argument("--out", help="write the results as JSON")
  a = p.parse_args(argv)
  from tools.compile_report import ptxas_logs
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")     # no GPU to check the driver of
  if a.kernels:
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  device = target_device()
  import subprocess
  import jax
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  results = {"tool": "tools.h200_aot", "run": {"commit": commit or "?", "jax": jax.__version__},
             "device": device.device_kind, "config": a.config, "shapes": {}, "kernels": {}}
  with ptxas_logs(a.kernels, results["kernels"]):
    for name in a.variants.split(","):
      r = compile_shape(name, a.config, not a.no_bwd, device, a.traffic)
      results["shapes"][name] = r
      for label, x in r.items():
        print(f"{name} {label:6s} temp {x['temp_mb']:7.0f} MiB  args {x['args_mb']:5.0f}  out {x['out_mb']:5.0f}  "
              f"lower {x['lower_s']:5.1f} s  compile {x['compile_s']:5.1f} s", flush=True)
      for x in r.get("fwdbwd", {}).get("traffic", []):
        print(f"  {x['kernel']:32s} read <= {x['read_mb']:6.0f} MiB  write {x['write_mb']:6.0f} MiB  "
              f"at {BANDWIDTH / 1e12:.1f} TB/s {x['floor_ms']:.3f} ms", flush=True)
  for k, x in sorted(results["kernels"].items()):
    print(f"  {k:48s} " + " ".join(f"{f} {v}" for f, v in x.items()))
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(results, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
