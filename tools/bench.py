"""python -m tools.bench: forward and forward+backward timings of kda.chunk_kda (GPU; CPU-sized on a CPU).

Shapes are the peer harness's (flash-linear-attention's chunk_kda is timed on the same ones):
  A  B=1, T=32768 packed, lengths uniform in [64, 4096] (numpy default_rng(0)), H=16, K=V=128
  B  B=1, T=32768 packed, lengths uniform in [1, 128]
  C  B=4, T=8192, no cu_seqlens
  L  one sequence of --total tokens (the scale run: --total 262144)
bf16 q/k/v/beta; gates "plain" (log-space logsigmoid(randn)/16) or "gate_safe" (raw gates,
use_gate_in_kernel, safe_gate, lower_bound=-5). Times are medians over --reps runs after warm-up
(jax.block_until_ready around each call); memory is XLA's compiled memory analysis (arguments +
outputs + temporaries). With --peer FILE (the peer's JSON from the same device run) it prints ratios.
With --stages each piece of the default forward and backward is timed apart, labelled with the
implementation the plan chooses for it.

On a CPU the defaults fit a CPU's memory and time (CPU_DEFAULTS: --total 4096, --impls auto, which
is xla there, --reps 3); the GPU's are the peers' shapes. The reference impl forms [NTa, BT, BT, HV,
K] pair tensors, 4 GiB at --total 4096, so it is left to small --total on a CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from kda import plan as planning
from kda import steps

import jax
import jax.numpy as jnp
import numpy as np

import kda

H, K, V, TOTAL = 16, 128, 128, 32768
# on a CPU: {option: default} where a GPU's default would not fit (main() picks by jax.default_backend())
CPU_DEFAULTS = {"total": 4096, "impls": "auto", "reps": 3}
GPU_DEFAULTS = {"total": TOTAL, "impls": "auto,reference", "reps": 20}


def varlen_lens(total, lo, hi, seed=0):
  rng = np.random.default_rng(seed)
  lens, s = [], 0
  while s < total:
    L = min(int(rng.integers(lo, hi + 1)), total - s)
    lens.append(L)
    s += L
  return lens


def shape(name, total=TOTAL):
  if name == "A":
    return 1, total, varlen_lens(total, 64, 4096)
  if name == "B":
    return 1, total, varlen_lens(total, 1, 128)
  if name == "C":
    return 4, total // 4, None
  if name == "L":
    return 1, total, [total]
  raise ValueError(f"shape must be A, B, C or L, got {name!r}")


def make_inputs(name, gate, seed=0, total=TOTAL):
  B, T, lens = shape(name, total)
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, T, H, K))).astype(jnp.bfloat16)
  k = unit(jax.random.normal(ks[1], (B, T, H, K))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, H, V)).astype(jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H))).astype(jnp.bfloat16)
  kw = {}
  if gate == "plain":
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, H, K))) / 16
  elif gate == "gate_safe":
    g = jax.random.normal(ks[4], (B, T, H, K)).astype(jnp.bfloat16)
    kw = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              A_log=jnp.log(jax.random.uniform(ks[5], (H,)) * 15 + 1),
              dt_bias=jax.random.normal(ks[6], (H * K,)))
  else:
    raise ValueError(f"gate must be plain or gate_safe, got {gate!r}")
  if lens is not None:
    kw["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  do = jax.random.normal(ks[7], v.shape).astype(jnp.bfloat16)
  return (q, k, v, g, beta), kw, do


def timeit(fn, *args, reps=20, warmup=3):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def memory_mb(fn, *args):
  """XLA's compiled memory analysis in MiB: (arguments + outputs + temporaries, temporaries), or
  (None, None) where the backend does not report it."""
  try:
    m = fn.lower(*args).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return total / 2**20, m.temp_size_in_bytes / 2**20
  except Exception:  # noqa: BLE001 - not every backend reports it
    return None, None


def _default_call(name, gate, total):
  """The pieces' common setup: the shape's inputs packed [1, T, ...] (fixed-length rows packed as
  chunk_kda does), their cu_seqlens, the default plan, a layout builder and zero initial states."""
  from kda import padding
  (q, k, v, g, beta), kw, do = make_inputs(name, gate, total=total)
  B, T = q.shape[:2]
  cu = kw.get("cu_seqlens")
  if cu is None:
    q, k, v, g, beta, do = (x.reshape((1, B * T) + x.shape[2:]) for x in (q, k, v, g, beta, do))
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    T = B * T
  plan = planning.make_plan(scale=q.shape[-1] ** -0.5, chunk_size=64,
                            use_gate_in_kernel=kw.get("use_gate_in_kernel", False),
                            lower_bound=kw.get("lower_bound"))
  lay = lambda cu: padding.layout_from_cu_seqlens(cu, T, plan.chunk_size)
  h0 = jnp.zeros((cu.shape[0] - 1, v.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)
  return (q, k, v, g, beta), do, cu, plan, lay, h0, kw.get("A_log"), kw.get("dt_bias")


def _timer(out, reps):
  """piece(label, fn, *args): jit fn, run it, time it into out[label] (median ms); returns its result."""
  def piece(label, fn, *args):
    f = jax.jit(fn)
    res = f(*args)
    out[label] = timeit(f, *args, reps=reps)
    return res
  return piece


def stage_times(name, gate, reps, total=TOTAL):
  """Median ms of each piece of the default (impl=None) forward, each jitted on its own on the
  previous pieces' outputs, cu_seqlens traced: prepare (align, l2norm, GVA, gate neutralisation),
  every forward stage with the implementation the pipeline chooses for it, the fused group where
  the pipeline would fuse, and unalign. Pieces run apart, so their sum exceeds the whole call."""
  from kda import padding, stages
  (q, k, v, g, beta), _, cu, plan, lay, h0, A_log, dt_bias = _default_call(name, gate, total)
  out = {}
  piece = _timer(out, reps)

  qa, ka, va, ga, ba, valid = piece("prepare", lambda cu, *x: steps.prepare(plan, lay(cu), *x),
                                    cu, q, k, v, g, beta)
  acu = jax.jit(lambda cu: lay(cu).aligned_cu)(cu)

  def stage(name_, *args):
    impl = planning.choose(plan, name_, *args, **plan.stage_kwargs(name_))
    return impl, piece(f"{name_} ({impl})", lambda *a: stages.get(name_)(
        impl, *a, interpret=plan.interpret, **plan.stage_kwargs(name_)), *args)

  _, gt = stage("gate", ga, valid, A_log, dt_bias)
  _, it = stage("intra", qa, ka, va, ba, gt.gc_int, gt.gc_frac, acu)
  sargs = (it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, h0, acu)
  fargs = (it.kg, it.w, it.u, it.qg, it.Aqk, gt.gc_int, gt.gc_frac, h0, acu)
  fkw = dict(scale=plan.scale, chunk_size=plan.chunk_size, out_dtype=steps.o_dtype(v))
  state_impl = plan.group_backend("state_output", *fargs, **fkw)
  _, st = stage("state", *sargs)
  _, ot = stage("output", it.qg, st.h, it.Aqk, st.v_new)
  o = ot.o
  if state_impl is not None:
    o, _ = piece(f"state+output (fused {state_impl})", lambda *a: kda.fused.GROUPS["state_output"](
        state_impl, *a, interpret=plan.interpret, config=plan.config("state_output", state_impl), **fkw), *fargs)
  piece("unalign", lambda cu, o: padding.unalign_with(lay(cu), o).astype(v.dtype), cu, o)
  if state_impl == "mosaic_gpu" and packed_reason(plan, lay, cu, q, k, v, g, beta, h0, A_log, dt_bias) is None:
    packed_pieces(piece, plan, lay, cu, q, k, v, g, beta, h0, A_log, dt_bias)
  return out


def backward_stage_times(name, gate, reps, total=TOTAL):
  """Median ms of each piece of the default (impl=None) backward, each jitted on its own on the
  inputs the staged backward hands it (recorded by pipeline.backward(record=True)): the whole
  pipeline.backward, every backward stage with the implementation the pipeline chooses, and the
  glue (prepare's vjp, aligning do). Pieces run apart, so their sum exceeds the whole call."""
  from kda import padding, pipeline, stages
  (q, k, v, g, beta), do, cu, plan, lay, h0, A_log, dt_bias = _default_call(name, gate, total)
  dht = jnp.zeros_like(h0)
  x = (q, k, v, g, beta, h0, A_log, dt_bias)
  saved = jax.jit(lambda cu, x: pipeline.saved(pipeline.forward(plan, lay(cu), *x)[2]))(cu, x)
  out = {}
  piece = _timer(out, reps)

  _, rec = piece("backward (whole, pipeline.backward)", lambda cu, x, s, do: pipeline.backward(
      plan, lay(cu), *x, s, do, dht, record=True), cu, x, saved, do)
  piece("glue: prepare + its vjp", lambda cu, *x: jax.vjp(
      lambda *y: steps.prepare(plan, lay(cu), *y)[:5], *x)[1](
          tuple(steps.prepare(plan, lay(cu), *x)[:5])), cu, q, k, v, g, beta)
  piece("glue: align do", lambda cu, do: padding.align_with(lay(cu), do), cu, do)
  for n in stages.BACKWARD:
    args, skw = rec["inputs"][n], plan.stage_kwargs(n)
    impl = planning.choose(plan, n, *args, **skw)
    piece(f"{n} ({impl})", lambda *a, n=n, impl=impl, skw=skw: stages.get(n)(
        impl, *a, interpret=plan.interpret, **skw), *args)
  return out


def packed_reason(plan, lay, cu, q, k, v, g, beta, h0, A_log, dt_bias):
  """None if the packed group (kda.fused.packed_forward's Hopper backend) takes the call, else why not."""
  return kda.fused.GROUPS["packed_forward"].supports(
      "mosaic_gpu", plan, lay(cu), q, k, v, g, beta, h0, A_log, dt_bias,
      config=plan.config("packed_forward", "mosaic_gpu"))


def packed_pieces(piece, plan, lay, cu, q, k, v, g, beta, h0, A_log, dt_bias):
  """The packed group's pieces (kda.fused.packed_forward), each jitted apart: the layout glue
  (chunk_rows) and the group itself on the packed inputs (its kernels one after another, o stored
  packed; tools.profile splits its time by kernel on the device). -> the group's (o, final_state).
  Raises ValueError where the group does not take the call."""
  from kda import padding
  group = kda.fused.GROUPS["packed_forward"]
  why = packed_reason(plan, lay, cu, q, k, v, g, beta, h0, A_log, dt_bias)
  if why is not None:
    raise ValueError(f"the packed forward does not take this call: {why}")
  piece("packed: chunk_rows", lambda cu: padding.chunk_rows(lay(cu)), cu)
  o, final, _ = piece("packed: forward (fused mosaic_gpu, o packed)", lambda cu, *x: group(
      "mosaic_gpu", plan, lay(cu), *x, A_log, dt_bias, interpret=plan.interpret,
      config=plan.config("packed_forward", "mosaic_gpu")), cu, q, k, v, g, beta, h0)
  return o, final


def calls(name, gate, impl, total=TOTAL, config="", device=None):
  """The timed calls of a shape: (args, fwd, loss) with args = (q, k, v, g, beta, diff_kw, traced_kw,
  do), fwd(*args) -> o and loss(*args) = sum(o * do), differentiated in args[:6]. diff_kw holds the
  differentiable keywords (A_log, dt_bias), traced_kw cu_seqlens: both are arguments of the jitted
  call, so cu_seqlens is traced as a training step passes it (the static-bound layout, one compile
  per N); a closed-over cu_seqlens would be concrete and get the exact layout. do is an argument
  too, as the jax peer passes it (closed over, it would be a 128 MiB constant of the program, whose
  lowering and compile then take seconds longer). impl: "auto" (chunk_kda's default: kernels where
  a stage has one), or an impl string; config: tools.configs' text, checked against the plan for
  `device` (default: this process's)."""
  impl = None if impl == "auto" else impl
  args, kw, do = make_inputs(name, gate, total=total)
  cfg = None
  if config:
    from tools import configs
    q, v = args[0], args[2]
    cfg = configs.parse(config, planning.make_plan(scale=1.0, chunk_size=64, impl=impl, dtype=q.dtype,
                                                    K=q.shape[-1], V=v.shape[-1], device=device))
  diff_kw = {k: v for k, v in kw.items() if k in ("A_log", "dt_bias")}
  traced_kw = {k: v for k, v in kw.items() if k == "cu_seqlens"}
  static_kw = {k: v for k, v in kw.items() if k not in diff_kw and k not in traced_kw}

  def fwd(q, k, v, g, beta, dk, tk, do=None):
    del do
    return kda.chunk_kda(q, k, v, g, beta, impl=impl, config=cfg, **static_kw, **dk, **tk)[0]

  def loss(q, k, v, g, beta, dk, tk, do):
    return jnp.sum(fwd(q, k, v, g, beta, dk, tk).astype(jnp.float32) * do.astype(jnp.float32))

  return (*args, diff_kw, traced_kw, do), fwd, loss


def bench_one(name, gate, impl, reps, do_bwd=True, total=TOTAL, config=""):
  """impl: "auto" (chunk_kda's default: kernels where a stage has one), "pallas" or "reference"."""
  label = impl + (f" [{config}]" if config else "")
  args, fwd, loss = calls(name, gate, impl, total, config)
  f = jax.jit(fwd)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  out = {"shape": name, "gate": gate, "impl": label, "compile_fwd_s": time.perf_counter() - t0}
  out["fwd_ms"] = timeit(f, *args, reps=reps)
  out["fwd_mem_mb"], out["fwd_temp_mb"] = memory_mb(f, *args)
  if do_bwd:
    fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    t0 = time.perf_counter()
    jax.block_until_ready(fb(*args))
    out["compile_fwdbwd_s"] = time.perf_counter() - t0
    out["fwdbwd_ms"] = timeit(fb, *args, reps=reps)
    out["fwdbwd_mem_mb"], out["fwdbwd_temp_mb"] = memory_mb(fb, *args)
  out["device_peak_mb"] = device_peak_mb()
  return out


def each_variant(variants, run, report, out=None):
  """run(name, gate) for each "shape:gate" of the comma-separated variants, report(variant, result)
  printed as each finishes, and every result written to `out` as JSON -> {variant: result}."""
  results = {}
  for var in variants.split(","):
    name, gate = var.split(":")
    results[var] = run(name, gate)
    print(report(var, results[var]), flush=True)
  if out:
    with open(out, "w") as fh:
      json.dump(results, fh, indent=1)
  return results


def device_peak_mb():
  """The device allocator's peak bytes in use so far in this process (MiB), or None where the
  backend does not report it: the whole process's peak, inputs and every call included."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001
    return None
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**20


def run_info():
  """What identifies a run: the commit (with "-dirty" when the tree had changes), the device, the
  versions. tools.perf_report names every figure by it."""
  import datetime
  import os
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=30)
  try:
    commit = git("rev-parse", "HEAD").stdout.strip() or None
    if commit and git("status", "--porcelain", "--untracked-files=no").stdout.strip():
      commit += "-dirty"
  except (OSError, subprocess.SubprocessError):
    commit = None
  dev = jax.devices()[0]
  return {"commit": commit, "device": dev.device_kind, "platform": dev.platform,
          "device_count": jax.device_count(), "jax": jax.__version__,
          "kda": getattr(kda, "__version__", None),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def peer_figures(path):
  """FLA's JSON (fla_bench.py --out): {"A:plain": {"fwd_ms_median", "fwdbwd_ms_median", ...}}."""
  with open(path) as fh:
    data = json.load(fh)
  return {key: val for key, val in data.get("variants", {}).items() if isinstance(val, dict)}


def jla_figures(path):
  """jax-linear-attention's JSON (jla_bench.py --out, plain gates): {"A:plain": {"fwd_ms_median", ...}}."""
  with open(path) as fh:
    data = json.load(fh)
  out = {}
  for name, val in data.get("shapes", {}).items():
    if isinstance(val, dict):
      out[f"{name}:plain"] = {"fwd_ms_median": (val.get("fwd") or {}).get("ms_median"),
                              "fwdbwd_ms_median": (val.get("fwdbwd") or {}).get("ms_median")}
  return out


def table(rows, fla, jla):
  """kda against both peers; x = kda / the faster peer measured."""
  nan = float("nan")
  f = lambda x: f"{x:9.3f}" if x else f"{'-':>9s}"
  lines = [f"{'variant':14s} {'impl':10s} {'kda fwd':>9s} {'FLA fwd':>9s} {'jla fwd':>9s} {'x fwd':>7s} "
           f"{'kda f+b':>9s} {'FLA f+b':>9s} {'jla f+b':>9s} {'x f+b':>7s} {'compile s':>9s} {'temp MiB':>9s}"]
  for r in rows:
    key = f"{r['shape']}:{r['gate']}"
    if "error" in r:
      lines.append(f"{key:14s} {r['impl']:10s} ERROR {r['error'][:80]}")
      continue
    pf = [p.get(key, {}).get("fwd_ms_median") for p in (fla, jla)]
    pb = [p.get(key, {}).get("fwdbwd_ms_median") for p in (fla, jla)]
    best = lambda xs: min([x for x in xs if x] or [nan])
    ratio = lambda a_, b_: f"{a_ / b_:7.2f}" if (a_ and b_ == b_) else f"{'-':>7s}"
    fb = r.get("fwdbwd_ms")
    lines.append(f"{key:14s} {r['impl']:10s} {f(r['fwd_ms'])} {f(pf[0])} {f(pf[1])} {ratio(r['fwd_ms'], best(pf))} "
                 f"{f(fb)} {f(pb[0])} {f(pb[1])} {ratio(fb, best(pb))} {r['compile_fwd_s']:9.1f} "
                 f"{f(r.get('fwd_temp_mb'))}")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="A:plain,B:plain,C:plain", help="shape:gate pairs")
  p.add_argument("--impls", default=None,
                 help="auto = chunk_kda's default (forward kernels, backward stages without kernels in jnp; "
                      "xla off a GPU); default auto,reference (a CPU: auto)")
  p.add_argument("--reps", type=int, default=None, help="timed calls per case (default 20, a CPU: 3)")
  p.add_argument("--no-bwd", action="store_true")
  p.add_argument("--stages", action="store_true",
                 help="also time each piece of the default forward (stage_times) and, unless --no-bwd, "
                      "of the backward (backward_stage_times) apart")
  p.add_argument("--total", type=int, default=None,
                 help=f"packed tokens (default {TOTAL}, a CPU: {CPU_DEFAULTS['total']}; smaller for a smoke run)")
  p.add_argument("--peer", help="FLA's JSON (fla_bench.py --out, run_peer.sh's fla.json) from the same device run")
  p.add_argument("--jla", help="jax-linear-attention's JSON (run_peer.sh's jla.json) from the same device run")
  p.add_argument("--config", default="",
                 help="configs of the timed calls, name.field=value,... (tools.configs), e.g. "
                      "pipeline.packed=0 (the aligned layout) or packed_forward.fuse_gate_intra=0")
  p.add_argument("--out", help="write results as JSON")
  a = p.parse_args(argv)
  defaults = CPU_DEFAULTS if jax.default_backend() == "cpu" else GPU_DEFAULTS
  for key, value in defaults.items():
    if getattr(a, key) is None:
      setattr(a, key, value)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  rows, pieces = [], {}
  for var in a.variants.split(","):
    name, gate = var.split(":")
    for impl in a.impls.split(","):
      try:
        r = bench_one(name, gate, impl, a.reps, do_bwd=not a.no_bwd, total=a.total, config=a.config)
      except Exception as e:  # noqa: BLE001 - report and go on with the other cases
        r = {"shape": name, "gate": gate, "impl": impl, "error": f"{type(e).__name__}: {e}"[:500]}
      rows.append(r)
      print(json.dumps(r), flush=True)
    if a.stages:
      try:
        pieces[var] = stage_times(name, gate, a.reps, total=a.total)
      except Exception as e:  # noqa: BLE001
        pieces[var] = {"error": f"{type(e).__name__}: {e}"[:500]}
      if not a.no_bwd:
        try:
          pieces[var + " backward"] = backward_stage_times(name, gate, a.reps, total=a.total)
        except Exception as e:  # noqa: BLE001
          pieces[var + " backward"] = {"error": f"{type(e).__name__}: {e}"[:500]}
      print(json.dumps({"stages": var, **pieces[var]}), flush=True)
  fla = peer_figures(a.peer) if a.peer else {}
  jla = jla_figures(a.jla) if a.jla else {}
  print("\n" + table(rows, fla, jla))
  for var, pc in pieces.items():
    what = "backward" if var.endswith(" backward") else "forward"
    print(f"\n{var.split()[0]} pieces of the default {what} (ms, each jitted apart):")
    for label, ms in pc.items():
      print(f"  {label:34s} {ms if isinstance(ms, str) else f'{ms:8.3f}'}")
  if a.out:
    with open(a.out, "w") as fh:
      json.dump({"run": run_info(), "rows": rows, "stages": pieces, "fla": fla, "jla": jla}, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
