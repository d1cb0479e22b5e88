"""python -m tools.gpu_check: compile every forward kernel on the GPU, check and time it.

On realistic shapes (varlen T = 32768 packed, H = 16, K = V = 128, bf16; lengths uniform in
[64, 4096] ("long") and in [1, 128] ("short")):
  1. every forward stage's kernel (pallas, and mosaic_gpu where a stage has one) against its jnp
     reference on the same recorded inputs (tools.stages.compare_stages, compiled, not interpreted);
  2. the whole forward (impl=None, the default: Mosaic GPU on Hopper; and impl="pallas") against
     the token-by-token recurrence in float32, next to the XLA-compiled reference pipeline's error
     on the same inputs; and impl=None (the packed group) against the same kernels on the aligned
     layout (PipelineConfig(packed=False), against the packed forward with inverse_in_state off as
     that path has it), which must agree (0 on the H200), with packed_forward's fuse_gate_intra off
     (the gate -> intra group), which must give the same bits, and with inverse_in_state off (Ainv
     applied in the state + output kernel), within one bf16 rounding of o;
  3. per-stage times (kernel vs XLA reference on the recorded inputs; mosaic_gpu kernels also with
     the inputs they take in bf16 cast, "mosaic_gpu_bf16_inputs") and the whole forward's time
     (median after warm-up) against the reference pipeline compiled by XLA.
--parts (stages, forward, times) and --impls (pallas, mosaic_gpu) pick a subset, so that one case
fits a device call (the whole set compiles some twenty programs per case); each part prints its
JSON line when done. Writes everything to --out as JSON; exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kda import reference, stages
from kda import plan as planning
from kda.fused.packed_forward import mosaic_gpu as packed_forward_mgpu
from kda.padding import pieces
from tools import bench
from tools.stages import compare_stages, record_reference
from tools.trace import make_inputs

CASES = {"long": (64, 4096), "short": (1, 128)}
H, K = 16, 128


def _rel(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


# The inputs a stage's mosaic_gpu kernel takes in bf16 under the dtype policy (positions): timed
# also with those cast, since the recorded inputs are the float32 reference's and the launchers
# would otherwise time their own casts.
MOSAIC_BF16_ARGS = {"state": (0, 1, 2), "output": (0, 1, 2, 3)}


def stage_times(lens, gate, reps, impls=("reference", "pallas", "mosaic_gpu")):
  """Per forward stage: median ms of its kernels (those in `impls`) and of the XLA reference on the
  same inputs."""
  plan, rec, _ = record_reference(lens, head_dim=K, heads=H, dtype="bfloat16", gate=gate, interpret=False)
  out = {}
  for name in stages.FORWARD:
    st = stages.get(name)
    kw = plan.stage_kwargs(name)
    args = rec["inputs"][name]
    row = {}
    for impl in st.implementations():
      if impl not in impls and impl != "reference":
        continue
      fn = jax.jit(lambda *a, st=st, impl=impl: st(impl, *a, interpret=False, **kw))
      row[impl] = bench.timeit(fn, *args, reps=reps)
      if impl == "mosaic_gpu" and name in MOSAIC_BF16_ARGS:
        bf = tuple(x.astype(jnp.bfloat16) if i in MOSAIC_BF16_ARGS[name] else x for i, x in enumerate(args))
        row["mosaic_gpu_bf16_inputs"] = bench.timeit(fn, *bf, reps=reps)
    out[name] = row
  return out


def _forward(impl, kw, config=None):
  """A jitted chunk_kda of make_inputs' record, with the initial and the final state."""
  return jax.jit(lambda i: __import__("kda").chunk_kda(
      i.q, i.k, i.v, i.g, i.beta, initial_state=i.initial_state, output_final_state=True,
      cu_seqlens=i.cu_seqlens, impl=impl, config=config, **kw))


def forward_errors(lens, gate, impls=("auto", "pallas", "reference")):
  """Whole forward (`impls` of impl=None as "auto", pallas, XLA reference) vs the recurrence, on the
  same bf16 inputs; with "auto" also its packed-vs-aligned, gate -> intra and no-states checks."""
  inp = make_inputs(1, lens, H=H, K=K, V=K, gate=gate, dtype=jnp.bfloat16)
  kw = {}
  g_rec = inp.g
  if gate == "raw":
    kw = dict(use_gate_in_kernel=True, A_log=inp.A_log, dt_bias=inp.dt_bias)
    g_rec = stages.gate.activate(inp.g, inp.A_log, inp.dt_bias, use_gate_in_kernel=True, lower_bound=None)
  rec = jax.jit(lambda i, g: reference.recurrent_kda(i.q, i.k, i.v, g, i.beta, initial_state=i.initial_state,
                                                     output_final_state=True, cu_seqlens=i.cu_seqlens))
  o_r, s_r = rec(inp, g_rec)
  res = {}
  for label, impl in (("auto", None), ("pallas", "pallas"), ("reference", "reference")):
    if label not in impls:
      continue
    o, s = _forward(impl, kw)(inp)
    res[label] = {"o_rel": _rel(o, o_r), "final_rel": _rel(s, s_r), "finite": bool(jnp.isfinite(o).all())}
    if label == "auto":
      # the aligned path forms w, u in the solve: compare it with the packed path doing the same
      wu = _forward(None, kw, {"packed_forward": packed_forward_mgpu.Config(inverse_in_state=False)})(inp)
      res["auto_inverse_in_state_vs_not"] = {"o": _rel(wu[0], o), "final": _rel(wu[1], s)}
      aligned = _forward(None, kw, {"pipeline": planning.PipelineConfig(packed=False)})(inp)
      res["auto_packed_vs_aligned"] = {"o": _rel(wu[0], aligned[0]), "final": _rel(wu[1], aligned[1])}
      unfused = _forward(None, kw, {"packed_forward": packed_forward_mgpu.Config(fuse_gate_intra=False)})(inp)
      res["auto_gate_intra_fused_vs_not"] = {"o": _rel(unfused[0], o), "final": _rel(unfused[1], s)}
      res["auto_no_states"] = _no_states(inp, kw, g_rec)
  return res


def _no_states(inp, kw, g_rec):
  """impl=None without initial or final state (what a training step passes; many short sequences
  then run as segmented pieces, kda.padding.pieces) against the recurrence from zero states."""
  import kda
  o = jax.jit(lambda i: kda.chunk_kda(i.q, i.k, i.v, i.g, i.beta, cu_seqlens=i.cu_seqlens, **kw)[0])(inp)
  o_r = jax.jit(lambda i, g: reference.recurrent_kda(i.q, i.k, i.v, g, i.beta, cu_seqlens=i.cu_seqlens)[0])(inp, g_rec)
  plan = planning.make_plan(scale=inp.q.shape[-1] ** -0.5, chunk_size=64,
                            use_gate_in_kernel=kw.get("use_gate_in_kernel", False))
  N, HV = inp.cu_seqlens.shape[0] - 1, inp.v.shape[2]
  pc = plan.config("pipeline")
  seg = bool(plan.members_select("packed_forward")) and pieces.takes(
      pieces.count(HV, pc.segment_pieces, pc.segment_walks), contiguous=True, initial_state=None,
      output_final_state=False, N=N, use_gate_in_kernel=kw.get("use_gate_in_kernel", False))
  return {"o_rel": _rel(o, o_r), "finite": bool(jnp.isfinite(o).all()), "segmented": bool(seg)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default="long,short")
  p.add_argument("--gates", default="plain,raw")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--tol-o", type=float, default=2e-2, help="max rel error of o vs the recurrence (bf16 inputs)")
  p.add_argument("--timing", default="A:plain,B:plain,A:gate_safe", help="bench shapes:gates to time")
  p.add_argument("--total", type=int, default=bench.TOTAL, help="packed tokens (smaller for a smoke run)")
  p.add_argument("--parts", default="stages,forward,times",
                 help="what to run per case: stages (each kernel against its reference on recorded inputs), "
                      "forward (the whole forward against the recurrence), times (per-stage times)")
  p.add_argument("--impls", default="pallas,mosaic_gpu",
                 help="the kernel families to check (the forward part's impl=None runs with mosaic_gpu)")
  p.add_argument("--out")
  a = p.parse_args(argv)
  parts, impls = set(a.parts.split(",")), set(a.impls.split(","))
  for name, got, allowed in (("--parts", parts, {"stages", "forward", "times"}),
                             ("--impls", impls, {"pallas", "mosaic_gpu"})):
    if not got <= allowed:
      p.error(f"{name} takes a comma-separated subset of {sorted(allowed)}, got {sorted(got - allowed)}")
  bench.TOTAL = a.total
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  results, ok = {}, True
  for case in a.cases.split(","):
    lens = bench.varlen_lens(bench.TOTAL, *CASES[case])
    for gate in a.gates.split(","):
      key = f"{case}:{gate}"
      r = results[key] = {"N": len(lens)}
      def report(part):       # progress per part: a run cut short by a time limit still reports
        print(key, part, json.dumps(r.get(part), default=str), flush=True)

      try:
        if "stages" in parts and "pallas" in impls:
          rep = compare_stages(lens, chunk_size=64, head_dim=K, heads=H, dtype="bfloat16", gate=gate,
                               interpret=False)
          r["stages"] = {s.name: {"status": s.status, "fields": {f.field: [f.max_abs, f.max_rel] for f in s.fields},
                                  "message": s.message} for s in rep.stages}
          ok &= rep.ok
          report("stages")
        if ("stages" in parts and "mosaic_gpu" in impls
            and any(stages.get(n).mosaic_gpu is not None for n in stages.FORWARD)):
          rep = compare_stages(lens, chunk_size=64, head_dim=K, heads=H, dtype="bfloat16", gate=gate,
                               interpret=False, impl="mosaic_gpu")
          r["stages_mosaic_gpu"] = {s.name: {"status": s.status, "fields": {
              f.field: [f.max_abs, f.max_rel] for f in s.fields}, "message": s.message} for s in rep.stages}
          ok &= rep.ok
          report("stages_mosaic_gpu")
        if "forward" in parts:
          runs = ("reference",) + (("auto",) if "mosaic_gpu" in impls else ()) + (("pallas",) if "pallas" in impls else ())
          r["forward"] = forward_errors(lens, gate, runs)
          for impl in set(runs) - {"reference"} | ({"auto_no_states"} if "auto" in runs else set()):
            ok &= r["forward"][impl]["finite"] and r["forward"][impl]["o_rel"] < a.tol_o
          if "auto" in runs:
            ok &= max(r["forward"]["auto_packed_vs_aligned"].values()) <= 1e-3   # measured 0 on the H200
            ok &= max(r["forward"]["auto_gate_intra_fused_vs_not"].values()) == 0  # the same bits
            # one bf16 rounding of o (2^-8 of its largest entry) at most
            ok &= max(r["forward"].get("auto_inverse_in_state_vs_not", {"o": 0}).values()) <= 2 ** -7
          report("forward")
        if "times" in parts:
          r["stage_ms"] = stage_times(lens, gate, a.reps, impls | {"reference"})
      except Exception as e:  # noqa: BLE001 - report, go on with the other cases
        r["error"] = f"{type(e).__name__}: {e}"[:2000]
        ok = False
      print(key, json.dumps(r, default=str), flush=True)
  timing = {}
  for var in filter(None, a.timing.split(",")):
    name, gate = var.split(":")
    for impl in ("auto", "pallas", "reference"):
      try:
        timing[f"{var}:{impl}"] = bench.bench_one(name, gate, impl, a.reps, do_bwd=False, total=a.total)
      except Exception as e:  # noqa: BLE001
        timing[f"{var}:{impl}"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        ok = False
      print(var, impl, json.dumps(timing[f"{var}:{impl}"]), flush=True)
  results["timing"] = timing
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(results, fh, indent=1, default=str)
  print("ALL CHECKS PASS" if ok else "SOME CHECKS FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
