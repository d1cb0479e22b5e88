"""python -m tools.stages: every forward stage's kernel against its reference, on identical inputs.

The reference pipeline runs once with every stage recorded; then each stage's kernel of one backend
(--impl pallas, the default, or mosaic_gpu; interpret mode or the Mosaic GPU simulator on a CPU) is
called on exactly the inputs the reference stage saw, so
a difference belongs to that stage alone, not to what flowed into it. Per stage and output field it
prints the max abs difference and the max relative difference (max |diff| / max |reference|), and
flags the first stage that disagrees beyond the tolerance (exit status 1). A stage without a kernel
yet is reported as "no kernel" and skipped.

  python -m tools.stages [--seq-lens 100,50] [--chunk-size 64] [--head-dim 128] [--heads 1]
      [--dtype float32|bfloat16] [--gate raw|plain] [--seed 0] [--tol REL] [--impl pallas|mosaic_gpu]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda import padding, pipeline, stages
from kda import plan as planning
from tools.trace import make_inputs, parse_lens

# Max |diff| / max |reference| per input dtype. float32: both implementations compute in float32 and
# differ in summation order only (~1e-6). bfloat16 inputs: a kernel may also round float32
# intermediates (gc, w, u, kg) to bfloat16 dot operands (8-bit mantissa, ~4e-3 each). mosaic_gpu
# kernels take bfloat16 operands whatever the inputs, so they are held to the bfloat16 tolerance.
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
BACKENDS = ("pallas", "mosaic_gpu")


class FieldDiff(NamedTuple):
  field: str
  max_abs: float
  max_rel: float
  ok: bool
  worst: str        # where the largest difference is, with both values


class StageReport(NamedTuple):
  name: str
  status: str       # "agrees" | "differs" | "no kernel" | "error"
  fields: list
  message: str = ""


@dataclasses.dataclass
class Report:
  config: dict
  stages: list

  @property
  def first_bad(self) -> StageReport | None:
    return next((s for s in self.stages if s.status in ("differs", "error")), None)

  @property
  def ok(self) -> bool:
    return self.first_bad is None


def _locate(idx, shape, meta):
  """Name the worst element: its token and sequence for [1, Ta, ...] fields, its chunk for h."""
  Ta, NTa, seq, kind = meta
  if len(shape) >= 2 and shape[0] == 1 and shape[1] == Ta:
    t = idx[1]
    who = "tail" if kind[t] == "tail" else f"{kind[t]} of seq {seq[t]}"
    return f"token {t} ({who}), index {idx}"
  if len(shape) >= 2 and shape[0] == 1 and shape[1] == NTa:
    return f"chunk {idx[1]}, index {idx}"
  return f"index {idx}"


def _diff(field, got, want, tol, meta) -> FieldDiff:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return FieldDiff(field, np.inf, np.inf, False, f"shape {got.shape} != reference {want.shape}")
  if not want.size:
    return FieldDiff(field, 0.0, 0.0, True, "")
  err = np.abs(got - want)
  key = np.where(np.isnan(err), np.inf, err)
  i = np.unravel_index(int(np.argmax(key)), err.shape)
  max_abs = float(err[i])
  max_rel = max_abs / max(float(np.max(np.abs(want))), 1e-30)
  worst = f"{_locate(tuple(int(x) for x in i), want.shape, meta)}: pallas {got[i]:.6g}, reference {want[i]:.6g}"
  return FieldDiff(field, max_abs, max_rel, bool(max_rel <= tol), worst)


def record_reference(seq_lens, *, chunk_size=64, head_dim=128, heads=1, dtype="float32", gate="raw",
                     seed=0, interpret=None):
  """The reference pipeline on tools.trace inputs, every stage recorded -> (plan, records, aligned_cu)."""
  lens = [int(n) for n in seq_lens]
  inp = make_inputs(seed, lens, H=heads, K=head_dim, V=head_dim, gate=gate, dtype=jnp.dtype(dtype))
  plan = planning.make_plan(scale=head_dim ** -0.5, chunk_size=chunk_size,
                            use_gate_in_kernel=gate == "raw", impl="reference", interpret=interpret)
  T = inp.q.shape[1]

  @jax.jit
  def recorded(inp):
    layout = padding.layout_from_cu_seqlens(inp.cu_seqlens, T, chunk_size)
    _, _, rec = pipeline.forward(plan, layout, inp.q, inp.k, inp.v, inp.g, inp.beta,
                                 inp.initial_state, inp.A_log, inp.dt_bias, record=True)
    return rec, layout.aligned_cu

  rec, acu = recorded(inp)
  return plan, rec, acu


def compare_stages(seq_lens=(100, 50), *, chunk_size=64, head_dim=128, heads=1, dtype="float32",
                   gate="raw", seed=0, tol=None, interpret=None, impl="pallas") -> Report:
  """Run every forward stage's `impl` kernel on the reference pipeline's recorded inputs; compare."""
  if dtype not in TOL:
    raise ValueError(f"dtype must be one of {list(TOL)}, got {dtype!r}")
  if impl not in BACKENDS:
    raise ValueError(f"impl must be one of {BACKENDS}, got {impl!r}")
  tol = TOL["bfloat16" if impl == "mosaic_gpu" else dtype] if tol is None else float(tol)
  lens = [int(n) for n in seq_lens]
  plan, rec, acu = record_reference(lens, chunk_size=chunk_size, head_dim=head_dim, heads=heads,
                                    dtype=dtype, gate=gate, seed=seed, interpret=interpret)
  acu = np.asarray(acu)
  Ta = rec["valid"].shape[1]
  seq, kind = np.full(Ta, -1), np.full(Ta, "tail", dtype=object)
  for n, L in enumerate(lens):
    seq[acu[n]:acu[n + 1]] = n
    kind[acu[n]:acu[n + 1]] = "pad"
    kind[acu[n]:acu[n] + L] = "real"
  meta = (Ta, Ta // chunk_size, seq, kind)

  reports = []
  for name in stages.FORWARD:
    st = stages.get(name)
    if getattr(st, impl) is None:
      reports.append(StageReport(name, "no kernel", []))
      continue
    kw = plan.stage_kwargs(name)
    run = jax.jit(lambda *a, st=st, kw=kw: st(impl, *a, interpret=plan.interpret, **kw))
    want = rec[name]
    try:
      got = jax.block_until_ready(run(*rec["inputs"][name]))
    except Exception as e:          # a kernel that fails to trace or run is this stage's fault
      reports.append(StageReport(name, "error", [], f"{type(e).__name__}: {e}"))
      continue
    if type(got) is not type(want):
      reports.append(StageReport(name, "error", [], f"{impl} returned {type(got).__name__}, "
                                 f"reference {type(want).__module__}.{type(want).__name__}"))
      continue
    fields = [_diff(f, getattr(got, f), getattr(want, f), tol, meta) for f in want._fields]
    reports.append(StageReport(name, "agrees" if all(f.ok for f in fields) else "differs", fields))
  config = dict(seq_lens=lens, chunk_size=chunk_size, head_dim=head_dim, heads=heads, dtype=dtype,
                gate=gate, seed=seed, tol=tol, interpret=plan.interpret, impl=impl)
  return Report(config, reports)


def render(report: Report, out):
  c = report.config
  print(f"kda stages: reference vs {c['impl']}{' (interpret)' if c['interpret'] else ''} on identical "
        f"inputs; seq_lens {c['seq_lens']}, chunk {c['chunk_size']}, K = V = {c['head_dim']}, "
        f"H = {c['heads']}, {c['dtype']}, gate {c['gate']}, seed {c['seed']}", file=out)
  print(f"a field agrees when max|diff| / max|reference| <= {c['tol']:g}", file=out)
  print(f"{'stage':<8} {'field':<12} {'max|diff|':>10} {'max rel':>10}  verdict", file=out)
  for s in report.stages:
    if not s.fields:
      print(f"{s.name:<8} {'-':<12} {'-':>10} {'-':>10}  {s.status}"
            + (f": {s.message}" if s.message else ""), file=out)
      continue
    for f in s.fields:
      verdict = "ok" if f.ok else f"DIFFERS  [{f.worst}]"
      print(f"{s.name:<8} {f.field:<12} {f.max_abs:>10.3g} {f.max_rel:>10.3g}  {verdict}", file=out)
  counts = {k: sum(s.status == k for s in report.stages) for k in ("agrees", "differs", "error", "no kernel")}
  summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
  bad = report.first_bad
  if bad is None:
    print(f"no stage disagrees ({summary})", file=out)
  else:
    why = bad.message if bad.status == "error" else ", ".join(
        f"{f.field} rel {f.max_rel:.3g}" for f in bad.fields if not f.ok)
    print(f"FIRST DISAGREEING STAGE: {bad.name} ({why}); stages after it saw the reference's inputs "
          f"({summary})", file=out)


def main(argv=None, out=None, err=None) -> int:
  out = sys.stdout if out is None else out
  err = sys.stderr if err is None else err
  p = argparse.ArgumentParser(prog="python -m tools.stages", description=__doc__.split("\n")[0])
  p.add_argument("--seq-lens", default="100,50")
  p.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64))
  p.add_argument("--head-dim", type=int, default=128, help="K = V")
  p.add_argument("--heads", type=int, default=1)
  p.add_argument("--dtype", choices=tuple(TOL), default="float32")
  p.add_argument("--gate", choices=("raw", "plain"), default="raw")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tol", type=float, default=None, help="max relative difference (default per dtype)")
  p.add_argument("--impl", choices=BACKENDS, default="pallas", help="the kernels to compare")
  args = p.parse_args(argv)
  try:
    report = compare_stages(parse_lens(args.seq_lens), chunk_size=args.chunk_size, head_dim=args.head_dim,
                            heads=args.heads, dtype=args.dtype, gate=args.gate, seed=args.seed, tol=args.tol,
                            impl=args.impl)
  except ValueError as e:
    print(f"error: {e}", file=err)
    return 2
  render(report, out)
  return 0 if report.ok else 1


if __name__ == "__main__":
  sys.exit(main())
