"""python -m tools.perf_report: docs/performance.md and its chart from committed benchmark JSON.

Reads every *.json under --dir (default benchmarks/, subfolders included) and sorts each file by
what wrote it:
  kda  tools.bench --out:   {"run": {commit, device, ...}, "rows": [...], "stages": {...},
                             "fla": {...}, "jla": {...}}
  fla  fla_bench.py --out:  {"device": ..., "fla": version, "variants": {"A:plain": {...}}}
  jla  jla_bench.py --out:  {"shapes": {"A": {"fwd": {"ms_median", ...}, "fwdbwd": {...}}}}
  aot  tools.h200_aot --out: {"tool": ..., "run": {commit, jax}, "device", "config",
       "shapes": {"A": {"fwd" | "fwdbwd": {"temp_mb", ...}}}, "kernels": {...}}
  residuals  a residuals script's --out: {"tool": "residuals", "run": {...}, "shapes": {"A": {"kda" | "jla":
       {"residual_MiB": x, "leaves": [[shape, dtype, bytes], ...]}}}} (what a layer keeps for its backward)
  tpu  tools.tpu_aot / tools.tpu_program --out: {"tool": ..., "run": {...}, "rows": [{...}, ...]}
       (or any file named tpu_aot*.json with a "rows" list; its rows are shown as they are)
  fidelity  the peers' fidelity.py --out: {"kda[...]" | "fla" | "jla": {"o": {"max_rel", "rms_rel"},
       "dq": {...}, ...}} (errors against a float32 truth on identical bf16 inputs)
  profile  tools.profile --out: {"A:plain": {"fwd" | "fwdbwd": {"pieces_ms": {piece: ms}, ...}}}
  states  tools.bench_states --out: {"many": "NxL", "stateless": {...}, "states": {...}, "ratio": x}
  dtype  tools.bench_dtype --out: {"bfloat16": {...}, "float32": {...}, "ratio_fwdbwd": x}
  kernels  a peer's kernels per call, in a file named fla_profile*.json or jla_profile*.json:
       {"A:plain": {"fwd" | "fwd+bwd" | "fwdbwd": [{"kernel": name, "ms": ms per call}, ...]}}
Every kda file is one run, named by its commit and device (tools.bench records them). Its peer
figures are those tools.bench embedded (--peer, --jla: the same device call), completed by the
fla / jla files of the same folder. Runs are listed newest first; the chart shows the newest.

The page is a function of the JSON alone (no clock, no machine state), so `--check` can tell
whether the committed page is the one the committed JSON gives. Exit status: 0; with --check, 1
when the page differs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from tools.perf_sections import PEER_NAME, PEERS, cell, num, relative, table
from tools.perf_sections import aot_section, budget_section, dtype_section, fidelity_section, residuals_section
from tools.perf_sections import states_section

ROOT = pathlib.Path(__file__).resolve().parents[1]


def classify(path: pathlib.Path, data) -> str | None:
  """The kind of a benchmark file (module docstring), or None."""
  if not isinstance(data, dict):
    return None
  if data.get("tool") in ("tools.tpu_aot", "tools.tpu_program") or (path.name.startswith("tpu_aot") and "rows" in data):
    return "tpu"
  if data.get("tool") == "tools.h200_aot" and isinstance(data.get("shapes"), dict):
    return "aot"
  if data.get("tool") == "residuals" and isinstance(data.get("shapes"), dict):
    return "residuals"
  if isinstance(data.get("rows"), list):
    return "kda"
  if isinstance(data.get("states"), dict) and isinstance(data.get("stateless"), dict) and "many" in data:
    return "states"
  if isinstance(data.get("bfloat16"), dict) and isinstance(data.get("float32"), dict) and "ratio_fwdbwd" in data:
    return "dtype"
  if path.name.startswith(("fla_profile", "jla_profile")) and data and all(
      isinstance(v, dict) and all(isinstance(x, list) for x in v.values()) for v in data.values()):
    return "kernels"
  if data and all(isinstance(v, dict) and v and all(isinstance(x, dict) and "pieces_ms" in x for x in v.values())
                  for v in data.values()):
    return "profile"
  if isinstance(data.get("variants"), dict):
    return "fla"
  if isinstance(data.get("shapes"), dict):
    return "jla"
  if data and all(isinstance(v, dict) and all(isinstance(e, dict) and "max_rel" in e for e in v.values())
                  for v in data.values()):
    return "fidelity"
  return None


def load(folder: pathlib.Path):
  """[(path, kind or None, data or the error)] for every *.json under folder, in path order."""
  out = []
  for path in sorted(folder.rglob("*.json")):
    try:
      data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      out.append((path, None, f"unreadable: {e}"))
      continue
    out.append((path, classify(path, data), data))
  return out


def fla_figures(data) -> dict:
  """fla_bench.py's variants: {"A:plain": {fwd_ms_median, fwdbwd_ms_median, ...}}."""
  return {k: v for k, v in data.get("variants", {}).items() if isinstance(v, dict)}


def jla_figures(data) -> dict:
  """jla_bench.py's shapes (plain gates) in the fla layout, with its memory and compile figures."""
  out = {}
  for name, val in data.get("shapes", {}).items():
    if not isinstance(val, dict):
      continue
    f, fb = val.get("fwd") or {}, val.get("fwdbwd") or {}
    out[f"{name}:plain"] = {"fwd_ms_median": f.get("ms_median"), "fwdbwd_ms_median": fb.get("ms_median"),
                            "fwd_temp_MiB": f.get("temp_MiB"), "fwdbwd_temp_MiB": fb.get("temp_MiB"),
                            "compile_fwd_s": f.get("compile_s"), "compile_fwdbwd_s": fb.get("compile_s"),
                            **({"error": val["error"]} if "error" in val else {})}
  return out


def peer_meta(kind, data) -> dict:
  """What identifies a peer's run: its device and version where the file records them."""
  if kind == "fla":
    return {k: data[k] for k in ("device", "fla", "torch", "triton") if k in data}
  return {k: data[k] for k in ("device", "jla", "jax") if k in data}


def runs(files) -> list[dict]:
  """One record per kda file: its run info, rows, stage pieces and peer figures; newest first."""
  peers_by_folder: dict = {}
  for path, kind, data in files:
    if kind in PEERS:
      figures = fla_figures(data) if kind == "fla" else jla_figures(data)
      peers_by_folder.setdefault(path.parent, {})[kind] = (path, figures, peer_meta(kind, data))
  out = []
  for path, kind, data in files:
    if kind != "kda":
      continue
    r = {"path": path, "run": data.get("run") or {}, "rows": data["rows"], "stages": data.get("stages") or {}}
    for p in PEERS:
      src, figures, meta = peers_by_folder.get(path.parent, {}).get(p, (None, {}, {}))
      embedded = data.get(p) or {}
      merged = {v: dict(figures.get(v, {})) for v in set(figures) | set(embedded)}
      for v, vals in embedded.items():
        merged[v].update({k: x for k, x in vals.items() if x is not None})
      sources = ([f"`{src.name}`"] if src else []) + (["embedded by tools.bench"] if embedded else [])
      r[p] = {"figures": merged, "meta": meta, "sources": sources}
    out.append(r)
  # newest first: ISO dates sort as strings; runs without a date go last, in path order
  out.sort(key=lambda r: (r["run"].get("date") is None, _neg(r["run"].get("date") or ""), str(r["path"])))
  return out


def _neg(s: str) -> tuple:
  return tuple(-ord(c) for c in s)


def run_title(r) -> str:
  info = r["run"]
  commit = (info.get("commit") or "commit not recorded")
  commit = commit[:12] + ("-dirty" if commit.endswith("-dirty") and len(commit) > 18 else "")
  return f"{commit} on {info.get('device') or 'unrecorded hardware'}"


def best_peer(r, variant, field):
  vals = [r[p]["figures"].get(variant, {}).get(field) for p in PEERS]
  vals = [x for x in vals if isinstance(x, (int, float))]
  return min(vals) if vals else None


def ratio(a, b) -> str:
  return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def run_section(r, heading="##") -> list[str]:
  info = r["run"]
  lines = [f"{heading} Run {run_title(r)}", ""]
  lines += table(["run", ""], [["commit", info.get("commit") or "-"], ["hardware", info.get("device") or "-"]]
                 + [[k, info[k]] for k in ("platform", "device_count", "jax", "kda", "date") if k in info]
                 + [["file", f"`{r['path'].relative_to(ROOT) if r['path'].is_relative_to(ROOT) else r['path']}`"]])
  for p in PEERS:
    meta, src = r[p]["meta"], r[p]["sources"]
    if r[p]["figures"]:
      what = ", ".join(f"{k} {v}" for k, v in meta.items()) or "device and version not recorded"
      lines.append(f"- {PEER_NAME[p]}: {what} ({'; '.join(src)})")
    else:
      lines.append(f"- {PEER_NAME[p]}: no figures for this run")
  lines.append("")
  rows = [x for x in r["rows"] if isinstance(x, dict)]
  key = lambda x: f"{x.get('shape')}:{x.get('gate')}"
  errors = [x for x in rows if "error" in x]
  ok = [x for x in rows if "error" not in x]
  for title, kf, pf in (("Forward, ms (median)", "fwd_ms", "fwd_ms_median"),
                        ("Forward + backward, ms (median)", "fwdbwd_ms", "fwdbwd_ms_median")):
    body = []
    for x in ok:
      if x.get(kf) is None:
        continue
      v = key(x)
      body.append([v, x.get("impl"), num(x.get(kf))]
                  + [num(r[p]["figures"].get(v, {}).get(pf)) for p in PEERS]
                  + [ratio(x.get(kf), best_peer(r, v, pf))])
    if body:
      lines += [f"{heading}# {title}", ""]
      lines += table(["variant", "impl", "kda", "FLA", "jla", "kda / faster peer"], body)
  body = []
  for x in ok:
    v = key(x)
    fla, jla = r["fla"]["figures"].get(v, {}), r["jla"]["figures"].get(v, {})
    body.append([v, x.get("impl"), num(x.get("fwd_temp_mb"), 0), num(x.get("fwdbwd_temp_mb"), 0),
                 num(x.get("device_peak_mb"), 0), num(fla.get("fwdbwd_peak_minus_inputs_MiB"), 0),
                 num(jla.get("fwdbwd_temp_MiB"), 0)])
  if body:
    lines += [f"{heading}# Memory, MiB", "",
              "kda and jla: XLA's temporaries of the compiled call; kda's device peak: the allocator's "
              "peak in the benchmark's process so far; FLA: the allocator's peak of one forward + "
              "backward above its inputs.", ""]
    lines += table(["variant", "impl", "kda fwd temp", "kda fwd+bwd temp", "kda device peak",
                    "FLA fwd+bwd above inputs", "jla fwd+bwd temp"], body)
  body = []
  for x in ok:
    v = key(x)
    fla, jla = r["fla"]["figures"].get(v, {}), r["jla"]["figures"].get(v, {})
    body.append([v, x.get("impl"), num(x.get("compile_fwd_s"), 1), num(x.get("compile_fwdbwd_s"), 1),
                 num(jla.get("compile_fwd_s"), 1), num(jla.get("compile_fwdbwd_s"), 1),
                 num(fla.get("fwd_first_call_s"), 1), num(fla.get("fwdbwd_first_call_s"), 1)])
  if body:
    lines += [f"{heading}# Compile, s", "",
              "kda: the first call of the jitted forward, then of the forward + backward in the same "
              "process; jla: ahead-of-time compile; FLA: its first call (Triton's autotuning restored "
              "from a cache).", ""]
    lines += table(["variant", "impl", "kda fwd", "kda fwd+bwd", "jla fwd", "jla fwd+bwd",
                    "FLA first fwd", "FLA first fwd+bwd"], body)
  if errors:
    lines += [f"{heading}# Failed cases", ""]
    lines += table(["variant", "impl", "error"], [[key(x), x.get("impl"), x["error"][:300]] for x in errors])
  for piece, times in r["stages"].items():
    if not isinstance(times, dict):
      continue
    what = "backward" if piece.endswith(" backward") else "forward"
    lines += [f"{heading}# Pieces of the default {what}, {piece.split()[0]}, ms (each jitted apart)", ""]
    if "error" in times:
      lines += [f"Failed: {cell(times['error'][:300])}", ""]
      continue
    lines += table(["piece", "ms"], [[k, num(v) if isinstance(v, (int, float)) else v] for k, v in times.items()])
  return lines


def tpu_section(files) -> list[str]:
  tpu = [(p, d) for p, k, d in files if k == "tpu"]
  if not tpu:
    return []
  lines = ["## TPU: ahead-of-time compiles", ""]
  for path, data in tpu:
    info = data.get("run") or {}
    lines += [f"### {path.name}: commit {(info.get('commit') or 'not recorded')[:12]}, "
              f"{info.get('device') or info.get('target') or 'target not recorded'}", ""]
    rows = [x for x in data.get("rows", []) if isinstance(x, dict)]
    cols = []
    for x in rows:
      cols += [c for c, v in x.items() if c not in cols and not isinstance(v, (dict, list))]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else v)
    lines += table(cols, [[fmt(x.get(c)) for c in cols] for x in rows]) if rows else ["No rows.", ""]
  return lines


INTRO = """\
# Performance

Generated by `python -m tools.perf_report` from the benchmark JSON committed under `benchmarks/`
(kda's `python -m tools.bench --out`, the peers' `fla.json` and `jla.json`, `tools.tpu_program`'s
output); do not edit it by hand. Every figure belongs to a run named by its commit and hardware.

Shapes (`tools.bench`): `A` one packed row of 32768 tokens, lengths uniform in [64, 4096]; `B` the
same with lengths in [1, 128]; `C` 4 rows of 8192 tokens, no `cu_seqlens`; `L` one sequence. All
bf16, `H = 16`, `K = V = 128`, chunk 64, `cu_seqlens` traced. Gates `plain` (log space) or
`gate_safe` (raw, `use_gate_in_kernel`, `safe_gate`, `lower_bound=-5`). Times are host-timed
medians of waited calls. Peers: flash-linear-attention (FLA, Triton, PyTorch) and
jax-linear-attention (jla, Mosaic GPU) on the same shapes; `kda / faster peer` below 1 means kda is
faster.
"""


def render(files, png_name: str | None, folder: pathlib.Path | None = None) -> str:
  rs = runs(files)
  lines = INTRO.splitlines() + [""]
  if not rs and not any(k == "tpu" for _, k, _ in files):
    lines += ["No benchmark JSON is committed yet: `benchmarks/` holds no kda run. Run "
              "`python -m tools.bench --out benchmarks/<name>/kda.json` on the GPU (with the peers' "
              "`fla.json` and `jla.json` beside it) and regenerate this page.", ""]
  if rs and png_name:
    lines += [f"![forward and forward + backward of the newest run, kda against the peers]({png_name})", ""]
  for r in rs:
    lines += run_section(r)
  lines += tpu_section(files)
  lines += aot_section(files, folder)
  lines += residuals_section(files, folder)
  lines += fidelity_section(files, folder)
  lines += states_section(files, folder)
  lines += dtype_section(files, folder)
  lines += budget_section(files, folder)
  if files:
    lines += ["## Files read", ""]
    rel = lambda p: relative(p, folder)
    lines += table(["file", "kind"], [[f"`{rel(p)}`", k or "not a benchmark file"] for p, k, _ in files])
  return "\n".join(lines).rstrip() + "\n"


def chart(run, path: pathlib.Path) -> bool:
  """Bars of kda against the peers (forward, forward + backward) for one run; False without
  matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  rows = [x for x in run["rows"] if isinstance(x, dict) and "error" not in x]
  impls = sorted({x.get("impl") for x in rows}, key=lambda i: (i != "auto", str(i)))
  rows = [x for x in rows if x.get("impl") == (impls[0] if impls else None)]
  variants = [f"{x.get('shape')}:{x.get('gate')}" for x in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, (title, kf, pf) in zip(axes, (("forward", "fwd_ms", "fwd_ms_median"),
                                        ("forward + backward", "fwdbwd_ms", "fwdbwd_ms_median"))):
    series = [(f"kda ({impls[0] if impls else '-'})", [x.get(kf) for x in rows])]
    series += [(PEER_NAME[p], [run[p]["figures"].get(v, {}).get(pf) for v in variants]) for p in PEERS]
    width = 0.8 / len(series)
    for j, (label, vals) in enumerate(series):
      xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(variants))]
      ax.bar(xs, [v if isinstance(v, (int, float)) else float("nan") for v in vals], width, label=label)
    ax.set_xticks(range(len(variants)), variants)
    ax.set_ylabel("ms (median)")
    ax.set_title(title)
  fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(series), frameon=False)
  fig.suptitle(run_title(run))
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100, metadata={"Software": None})
  plt.close(fig)
  return True


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dir", default=str(ROOT / "benchmarks"), help="folder of benchmark JSON")
  p.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
  p.add_argument("--png", default=str(ROOT / "docs" / "performance.png"), help="the chart ('' for none)")
  p.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs")
  a = p.parse_args(argv)
  folder, out = pathlib.Path(a.dir), pathlib.Path(a.out)
  files = load(folder) if folder.is_dir() else []
  rs = runs(files)
  png = pathlib.Path(a.png) if a.png else None
  png_name = os.path.relpath(png, out.parent) if png and rs else None
  if png_name and not a.check:
    if not chart(rs[0], png):
      print("matplotlib is not installed (the [plot] extra): no chart", file=sys.stderr)
      png_name = None
  page = render(files, png_name, folder)
  if a.check:
    same = out.is_file() and out.read_text() == page
    print(f"{out}: {'up to date' if same else 'differs from what the JSON gives'}")
    return 0 if same else 1
  if png and not rs and png.is_file():
    png.unlink()          # no run: no chart left from an earlier one
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(page)
  print(f"wrote {out}" + (f" and {png}" if png_name else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
