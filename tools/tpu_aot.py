"""Ahead-of-time compile of the Mosaic TPU forward kernels for TPU generations, on a machine without
a TPU (needs libtpu: jax[tpu] of the installed jax's version; not part of CI).

  JAX_PLATFORMS=cpu PYTHONPATH=$PWD /work/tpu-venv/bin/python -m tools.tpu_aot
  ... -m tools.tpu_aot --gen v7x --dtype bf16 --kernels intra,state_output --min-vmem
  ... -m tools.tpu_aot --K 256 --V 256 --BT 16
(ALLOW_MULTIPLE_LIBTPU_LOAD=1 where another process holds libtpu.)

Per kernel x generation x dtype, at the production shape (default T = 8192 aligned, HV = 16,
K = V = 128, BT = 64, N = 5 sequences): compiled or the error, the heads per program MB of the
generation's default Config, the VMEM its budget counts (kda._mosaic_tpu.budget: 2 x blocks + scratch
+ values) and the vmem_limit_bytes it asks for against the generation's VMEM, memory_analysis()'s
temp bytes (HBM: the launcher's transposes and lane pads around the kernel) and, with --min-vmem,
the smallest vmem_limit_bytes that compiles (bisection to 0.25 MiB: what Mosaic really uses).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kda import _mosaic_tpu as tpu
from kda.fused.gate_intra import mosaic_tpu as gate_intra_tpu
from kda.fused.state_output import mosaic_tpu as state_output_tpu
from kda.stages.gate import mosaic_tpu as gate_tpu
from kda.stages.intra import mosaic_tpu as intra_tpu
from kda.stages.output import mosaic_tpu as output_tpu
from kda.stages.state import mosaic_tpu as state_tpu

TOPOLOGIES = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "v7x": "tpu7x:1x1x1"}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
  T: int = 8192
  HV: int = 16
  K: int = 128
  V: int = 128
  BT: int = 64
  N: int = 5


def kernels(s: Shape, dt):
  """name -> (module, fn(config), specs, tiles(MB, gen)): each kernel's launcher at shape s."""
  S = jax.ShapeDtypeStruct
  tok = lambda D, d=dt: S((1, s.T, s.HV, D), d)
  Kp, Vp = tpu.lanes(s.K), tpu.lanes(s.V)
  gate_args = [tok(s.K), S((1, s.T), jnp.bool_), S((s.HV,), F32), S((s.HV * s.K,), F32)]
  beta = S((1, s.T, s.HV), dt)
  state_args = [tok(s.K), tok(s.K), tok(s.V), tok(s.K, F32), tok(s.K, F32), S((s.N, s.HV, s.K, s.V), F32),
                S((s.N + 1,), jnp.int32)]
  gkw = dict(chunk_size=s.BT, use_gate_in_kernel=True, lower_bound=None)
  scale = s.K ** -0.5
  return {
      "gate": (gate_tpu, lambda c: functools.partial(gate_tpu.apply, config=c, **gkw), gate_args,
               lambda mb: gate_tpu.tiles(mb, s.BT, Kp, dt, True, True)),
      "intra": (intra_tpu, lambda c: functools.partial(intra_tpu.apply, scale=scale, chunk_size=s.BT, config=c),
                [tok(s.K), tok(s.K), tok(s.V), beta, tok(s.K, F32), tok(s.K, F32)],
                lambda mb: intra_tpu.tiles(mb, s.BT, Kp, Vp, dt)),
      "state": (state_tpu, lambda c: functools.partial(state_tpu.apply, chunk_size=s.BT, config=c), state_args,
                lambda mb: state_tpu.tiles(mb, s.BT, Kp, Vp, dt)),
      "output": (output_tpu, lambda c: functools.partial(output_tpu.apply, scale=scale, chunk_size=s.BT, config=c),
                 [tok(s.K), S((1, s.T // s.BT, s.HV, s.K, s.V), dt), tok(s.BT), tok(s.V)],
                 lambda mb: output_tpu.tiles(mb, s.BT, Kp, Vp, dt, dt)),
      "gate_intra": (gate_intra_tpu, lambda c: functools.partial(gate_intra_tpu.apply, scale=scale, config=c, **gkw),
                     [tok(s.K), tok(s.K), tok(s.V), beta] + gate_args,
                     lambda mb: gate_intra_tpu.tiles(mb, s.BT, Kp, Vp, dt, dt)),
      "state_output": (state_output_tpu,
                       lambda c: functools.partial(state_output_tpu.apply, scale=scale, chunk_size=s.BT, config=c),
                       state_args[:3] + [tok(s.K), tok(s.BT)] + state_args[3:],
                       lambda mb: state_output_tpu.tiles(mb, s.BT, Kp, Vp, dt)),
  }


@functools.cache
def mesh(gen):
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[gen], platform="tpu", chips_per_host_bounds=(1, 1, 1))
  return jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))


def compile_for(fn, specs, gen):
  m = mesh(gen)
  sh = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec())
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x in specs]
  with jax.sharding.use_abstract_mesh(m.abstract_mesh):
    return jax.jit(fn).trace(*specs).lower().compile()


def min_vmem(fn_of, config, specs, gen, lo=0.5, hi=None, res=0.25):
  """The smallest vmem_limit_bytes (MiB) that compiles, by bisection (compile caches cleared, as
  the limit is part of the kernel's lowering)."""
  def fits(mib):
    jax.clear_caches()
    try:
      compile_for(fn_of(dataclasses.replace(config, vmem_limit=int(mib * tpu.MiB))), specs, gen)
      return True
    except Exception as e:  # noqa: BLE001 - a scoped-VMEM overflow is the expected failure
      if "vmem" not in str(e).lower():
        raise
      return False
  hi = hi or tpu.GENERATIONS[gen].vmem_cap / tpu.MiB
  if not fits(hi):
    return None
  while hi - lo > res:
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if fits(mid) else (mid, hi)
  return hi


def mib(n):
  return f"{n / tpu.MiB:.1f}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gen", default="v5e,v6e,v7x")
  ap.add_argument("--dtype", default="bf16,f32")
  ap.add_argument("--kernels", default=None, help="comma list (default: all)")
  ap.add_argument("--min-vmem", action="store_true", help="also bisect the smallest vmem_limit_bytes that compiles")
  for f in dataclasses.fields(Shape):
    ap.add_argument(f"--{f.name}", type=int, default=f.default)
  a = ap.parse_args(argv)
  shape = Shape(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Shape)})
  print(f"shape {shape}")
  print("| kernel | dtype | gen | result | MB | budget need MiB | asked MiB / VMEM MiB | min compiling MiB "
        "| temp (HBM) MiB | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  failed = 0
  for dname in a.dtype.split(","):
    dt = DTYPES[dname]
    table = kernels(shape, dt)
    for name in (a.kernels.split(",") if a.kernels else table):
      module, fn_of, specs, tiles = table[name]
      for gen in a.gen.split(","):
        g = tpu.GENERATIONS[gen]
        args = (shape.K, shape.V, shape.BT, dt, g) if name != "gate" else (shape.K, shape.BT, dt, g)
        config = module.default_config(*args)
        MB = tpu.heads_per_program(shape.HV, config.heads)
        b = tpu.budget(*tiles(MB), g)
        t = time.perf_counter()
        try:
          compiled = compile_for(fn_of(config), specs, gen)
          result, temp = "compiled", mib(compiled.memory_analysis().temp_size_in_bytes)
        except Exception as e:  # noqa: BLE001 - report and go on
          failed += 1
          result, temp = " ".join(str(e).split())[:160].replace("|", "/"), "-"
        secs = time.perf_counter() - t
        low = min_vmem(fn_of, config, specs, gen) if a.min_vmem and result == "compiled" else None
        print(f"| {name} | {dname} | {gen} | {result} | {MB} | {mib(b.need)} | {mib(b.limit)} / {mib(g.vmem_bytes)} "
              f"| {'-' if low is None else f'{low:.2f}'} | {temp} | {secs:.1f} |", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
