"""python -m tools.gpu_check_bwd: compile the backward stages' Mosaic GPU kernels, check and time them.

On bf16 inputs (tools.trace's make_inputs, varlen lengths as tools.gpu_check's "long" / "short"
cases, H = 16, K = V = 128 by default):
  1. the reference backward (jnp), every stage recorded (pipeline.backward(record=True));
  2. every backward stage that has a mosaic_gpu kernel, on the recorded inputs of its stage, against
     the recorded reference output: max |d| / max |ref| per field, and the median ms of both;
  3. jax.grad of sum(o * do) with impl="mosaic_gpu" (and with the candidates PipelineConfig(defer_qg=True),
     PipelineConfig(keep_forward=True), bwd_wy's Config(terms=True) and bwd_recompute's
     Config(per_slab=True)) against impl="reference"
     (max relative error per gradient), all timed;
  4. determinism: that compiled jax.grad (and with terms, keep_forward) called --repeat more times
     gives the first call's gradients bit for bit (the elements that differ are counted per gradient), and that
     per_slab gives the default's bits.
`--interpret --total 256 --heads 1 --head-dim 64` runs it in the simulator on a CPU (a smoke run).
Writes everything to --out as JSON; exit status 1 if a check fails (a field above --tol).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import kda
from kda import padding, pipeline, stages
from kda import plan as planning
from tools import bench
from tools.trace import make_inputs

CASES = {"long": (64, 4096), "short": (1, 128)}
# Inputs a backward kernel takes in bf16 under the dtype policy (positions): the reference records
# them in float32, so the kernel is checked with those cast (what S0's kernels would hand it).
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")   # jax.grad's outputs, in order
BF16_ARGS = {"bwd_dav": (0, 1), "bwd_dh": (0, 1, 2, 5, 6), "bwd_wy": (0, 1, 2, 6)}


def _variants():
  """Config variants of the backward kernels checked and timed besides their defaults (stage ->
  {label: config}): the candidates for the next default."""
  from kda.stages.bwd_dav import mosaic_gpu as dav
  from kda.stages.bwd_dh import mosaic_gpu as dh
  from kda.stages.bwd_intra import mosaic_gpu as intra
  from kda.stages.bwd_recompute import mosaic_gpu as recompute
  from kda.stages.bwd_wy import mosaic_gpu as wy
  return {"bwd_recompute": {"no_skip_tail": recompute.Config(skip_tail=False),
                            "per_slab": recompute.Config(per_slab=True)},
          "bwd_dav": {"no_skip_tail": dav.Config(skip_tail=False)},
          "bwd_dh": {"input_order": dh.Config(longest_first=False)},
          "bwd_wy": {"no_skip_tail": wy.Config(skip_tail=False), "overlap_loads": wy.Config(overlap_loads=True),
                     "split": wy.Config(split=True)},
          "bwd_intra": {"no_skip_tail": intra.Config(skip_tail=False)}}


def _rel(got, want):
  got, want = np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(jnp.asarray(want, jnp.float32))
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30)) if want.size else 0.0


def bit_differences(first, again) -> dict:
  """{gradient: elements whose bits differ between `first` and any call of `again`}."""
  bits = lambda a: np.asarray(a).reshape(-1).view(np.uint8).reshape(np.size(a), -1)
  differ = lambda i: np.any([np.any(bits(run[i]) != bits(first[i]), axis=1) for run in again], axis=0)
  return {n: int(differ(i).sum()) if again else 0 for i, n in enumerate(GRADS[:len(first)])}


def check_case(lens, *, heads, head_dim, gate, reps, interpret, repeat=3):
  inp = make_inputs(0, lens, H=heads, K=head_dim, V=head_dim, gate=gate, dtype=jnp.bfloat16)
  raw = gate == "raw"
  T = inp.q.shape[1]
  plan = planning.make_plan(scale=head_dim ** -0.5, chunk_size=64, use_gate_in_kernel=raw, impl="reference",
                            interpret=interpret)
  x = (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state, inp.A_log, inp.dt_bias)
  do = jax.random.normal(jax.random.PRNGKey(7), inp.v.shape, jnp.float32).astype(jnp.bfloat16)
  dht = jax.random.normal(jax.random.PRNGKey(8), inp.initial_state.shape, jnp.float32)

  @jax.jit
  def recorded(x, cu, do, dht):
    layout = padding.layout_from_cu_seqlens(cu, T, 64)
    _, _, frec = pipeline.forward(plan, layout, *x)
    _, rec = pipeline.backward(plan, layout, *x, pipeline.saved(frec), do, dht, record=True)
    return rec

  rec = recorded(x, inp.cu_seqlens, do, dht)
  out = {"stages": {}}
  ok = True
  for name in stages.BACKWARD:
    st = stages.get(name)
    if st.mosaic_gpu is None:
      continue
    kw = plan.stage_kwargs(name)
    args = tuple(x.astype(jnp.bfloat16) if i in BF16_ARGS.get(name, ()) else x
                 for i, x in enumerate(rec["inputs"][name]))
    why = st.supports("mosaic_gpu", *args, config=plan.config(name, "mosaic_gpu"), **kw)
    if why is not None:
      out["stages"][name] = {"refused": why}
      continue
    ref = jax.jit(lambda *a, st=st, kw=kw: st("reference", *a, **kw))
    for label, cfg in {"": None, **_variants().get(name, {})}.items():
      extra = {"config": plan.config(name, "mosaic_gpu") if cfg is None else cfg}
      kernel = jax.jit(lambda *a, st=st, kw=kw, extra=extra: st("mosaic_gpu", *a, interpret=interpret, **kw, **extra))
      key = f"{name} [{label}]" if label else name
      try:
        got = kernel(*args)
      except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the default must not
        if not label:
          raise
        out["stages"][key] = {"error": f"{type(e).__name__}: {e}"[:500]}
        continue
      errs = {f: _rel(getattr(got, f), getattr(rec[name], f)) for f in rec[name]._fields
              if getattr(rec[name], f) is not None}
      out["stages"][key] = {"max_rel": errs, "kernel_ms": bench.timeit(kernel, *args, reps=reps)}
      print(" ", key, json.dumps(out["stages"][key]), flush=True)     # as it comes: a call cut short keeps it
    out["stages"][name]["reference_ms"] = bench.timeit(ref, *args, reps=reps)
  kw = dict(cu_seqlens=inp.cu_seqlens, output_final_state=True, use_gate_in_kernel=raw, chunk_size=64)

  def loss(impl, config=None):
    def f(q, k, v, g, beta, h0, A_log, dt_bias):
      extra = dict(A_log=A_log, dt_bias=dt_bias) if raw else {}
      o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, impl=impl, config=config, **kw, **extra)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(ht * dht)
    argnums = (0, 1, 2, 3, 4, 5) + ((6, 7) if raw else ())
    return jax.jit(jax.grad(f, argnums=argnums))

  # the kernels' gradient, the reference's, and the kernels' with the candidate switches on
  from kda.stages.bwd_recompute import mosaic_gpu as recompute
  from kda.stages.bwd_wy import mosaic_gpu as wy
  candidates = {"defer_qg": {"pipeline": planning.PipelineConfig(defer_qg=True)},
                "keep_forward": {"pipeline": planning.PipelineConfig(keep_forward=True)},
                "terms": {"bwd_wy": wy.Config(terms=True)},
                "per_slab": {"bwd_recompute": recompute.Config(per_slab=True)}}
  grads = {"mosaic_gpu": loss("mosaic_gpu"), "reference": loss("reference"),
           **{f"mosaic_gpu [{c}]": loss("mosaic_gpu", cfg) for c, cfg in candidates.items()}}
  want = grads["reference"](*x)
  rel = lambda got: {n: _rel(a, b) for n, a, b in zip(GRADS, got, want)}
  got = grads["mosaic_gpu"](*x)
  out["grad_max_rel"] = rel(got)
  print("  grad_max_rel", json.dumps(out["grad_max_rel"]), flush=True)
  for c in candidates:
    out[f"grad_max_rel [{c}]"] = rel(grads[f"mosaic_gpu [{c}]"](*x))
    print(f"  grad_max_rel [{c}]", json.dumps(out[f"grad_max_rel [{c}]"]), flush=True)
  out["grad_finite"] = bool(all(np.isfinite(np.asarray(jnp.asarray(a, jnp.float32))).all() for a in got))
  out["grad_ms"] = {i: bench.timeit(grads[i], *x, reps=reps) for i in grads}
  out["grad_bits_differ"] = bit_differences(got, [grads["mosaic_gpu"](*x) for _ in range(repeat)])
  for c in ("terms", "keep_forward"):
    f = grads[f"mosaic_gpu [{c}]"]
    out[f"grad_bits_differ [{c}]"] = bit_differences(f(*x), [f(*x) for _ in range(repeat)])
  # per_slab schedules the same arithmetic: the default's gradients, bit for bit
  out["grad_bits_differ [per_slab]"] = bit_differences(got, [grads["mosaic_gpu [per_slab]"](*x)])
  same = not any(any(out[f"grad_bits_differ{c}"].values()) for c in ("", " [per_slab]", " [keep_forward]"))
  return out, ok and out["grad_finite"] and same


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default="long,short")
  p.add_argument("--gates", default="plain,raw")
  p.add_argument("--total", type=int, default=bench.TOTAL, help="packed tokens")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--tol", type=float, default=2e-2, help="max rel error per field and per gradient")
  p.add_argument("--repeat", type=int, default=3, help="calls of the kernel gradient compared bit for bit")
  p.add_argument("--interpret", action="store_true", help="simulator (CPU smoke run)")
  p.add_argument("--out")
  a = p.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  results, ok = {}, True
  for case in a.cases.split(","):
    lens = bench.varlen_lens(a.total, *CASES[case])
    for gate in a.gates.split(","):
      key = f"{case}:{gate}"
      try:
        r, good = check_case(lens, heads=a.heads, head_dim=a.head_dim, gate=gate, reps=a.reps,
                             interpret=a.interpret, repeat=a.repeat)
        worst = [e for s in r["stages"].values() for e in s.get("max_rel", {}).values()]
        worst += [e for k, v in r.items() if k.startswith("grad_max_rel") for e in v.values()]
        ok &= good and all(e <= a.tol for e in worst)
      except Exception as e:  # noqa: BLE001 - report, go on with the other cases
        r, ok = {"error": f"{type(e).__name__}: {e}"[:2000]}, False
      results[key] = r
      print(key, json.dumps(r, default=str), flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(results, fh, indent=1, default=str)
  print("ALL CHECKS PASS" if ok else "SOME CHECKS FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
