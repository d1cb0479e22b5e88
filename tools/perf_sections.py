"""The tables of docs/performance.md besides the runs' own (tools.perf_report renders the page):
memory compiled without a device, what a call keeps for its backward, bf16 fidelity, many short
sequences with states, float32 inputs, and device time by stage beside the peers' kernels; and the
table helpers every section uses."""
from __future__ import annotations

import pathlib

PEERS = ("fla", "jla")
PEER_NAME = {"fla": "FLA", "jla": "jla"}


def num(x, digits=3) -> str:
  if x is None or x != x:
    return "-"
  return f"{x:.{digits}f}"


def cell(x) -> str:
  return str(x).replace("|", "\\|").replace("\n", " ")


def relative(path: pathlib.Path, folder: pathlib.Path | None) -> pathlib.Path:
  """path as named on the page: relative to the benchmark folder where it lies inside it."""
  return path.relative_to(folder) if folder is not None and path.is_relative_to(folder) else path


def table(header, rows) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
          + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows] + [""])


def fid_cell(e) -> str:
  """max_rel / rms_rel (the rms where the file has it), or - where the output is missing."""
  if e is None:
    return "-"
  return f"{e['max_rel']:.2e}" + (f" / {e['rms_rel']:.2e}" if "rms_rel" in e else "")


def fidelity_section(files, folder=None) -> list[str]:
  """One table per fidelity file: each implementation's max and rms error of every output."""
  fid = [(p, d) for p, k, d in files if k == "fidelity"]
  if not fid:
    return []
  lines = ["## bf16 fidelity", "",
           "Errors against a float32 truth on identical bf16 inputs (the peers' `fidelity.py`): "
           "max|x - truth| / max|truth|, then the rms ratio where measured; the folder's README names the shape "
           "and truth.", ""]
  for path, data in fid:
    outs = list(dict.fromkeys(o for errs in data.values() for o in errs))
    name = relative(path, folder)
    lines += [f"`{name}`", ""]
    lines += table(["implementation"] + outs,
                   [[who] + [fid_cell(errs.get(o)) for o in outs] for who, errs in data.items()])
  return lines


def aot_section(files, folder=None) -> list[str]:
  """One table per tools.h200_aot file: XLA's memory of the programs compiled for an H200 on a
  machine without one (the compiler's figures; no time is measured there)."""
  got = [(p, d) for p, k, d in files if k == "aot"]
  if not got:
    return []
  lines = ["## Memory compiled for the H200 without one", "",
           "`tools.h200_aot`: each shape of `tools.bench` (its inputs and calls) compiled for an H200 through "
           "jax's CUDA plugin on a machine without a GPU: XLA's temp memory of the forward and of the forward + "
           "backward (`jax.grad`), MiB, the bytes each Mosaic GPU call moves and ptxas's registers and spill stores "
           "per thread of each Mosaic GPU kernel where recorded. The figures are the compiler's; times need the "
           "device.", ""]
  for path, d in got:
    run = d.get("run", {})
    lines += [f"`{relative(path, folder)}` (commit {run.get('commit', '?')}, {d.get('device', '-')}"
              + (f", config `{d['config']}`" if d.get("config") else "") + ")", ""]
    rows = [[name, num(x.get("fwd", {}).get("temp_mb"), 0), num(x.get("fwdbwd", {}).get("temp_mb"), 0)]
            for name, x in d["shapes"].items()]
    lines += table(["shape", "fwd temp", "f+b temp"], rows)
    lines += _traffic_table(d["shapes"])
    kernels = d.get("kernels") or {}
    if kernels:
      lines += table(["kernel", "registers", "spill stores (bytes)"],
                     [[f"`{k}`", str(x.get("registers", "-")), str(x.get("spill_stores", "-"))]
                      for k, x in sorted(kernels.items())])
  return lines


def residuals_section(files, folder=None) -> list[str]:
  """One table per residuals file: the MiB one layer keeps between its forward and its backward
  (the leaves of jax.vjp's closure), kda beside each peer the file measured."""
  got = [(p, d) for p, k, d in files if k == "residuals"]
  if not got:
    return []
  lines = ["## What a layer keeps for its backward", "",
           "The residuals of one call (the arrays `jax.vjp` keeps between the forward and the backward, inputs "
           "included), MiB, traced for an H200 without one: a model of L layers trained without "
           "rematerialisation holds L times these at the backward's start.", ""]
  for path, d in got:
    lines += [f"`{relative(path, folder)}` (commit {d.get('run', {}).get('commit', '?')})", ""]
    who = list(dict.fromkeys(w for x in d["shapes"].values() for w in x))
    rows = [[name] + [num(x.get(w, {}).get("residual_MiB"), 0) for w in who]
            + [f"{x[w]['residual_MiB'] / x['kda']['residual_MiB']:.2f}" if w in x and "kda" in x else "-"
               for w in who if w != "kda"]
            for name, x in d["shapes"].items()]
    lines += table(["shape"] + [PEER_NAME.get(w, w) for w in who] + [f"{PEER_NAME.get(w, w)} / kda" for w in who
                                                                     if w != "kda"], rows)
  return lines


def _traffic_table(shapes: dict) -> list[str]:
  """The forward + backward's Mosaic GPU calls (h200_aot --traffic): per shape, the MiB of each
  call's operands and results and the time they take at the H200's bandwidth; a kernel called more
  than once is one row per call; calls in a branch or loop body (run when taken) are marked and
  left out of the sum."""
  per = {name: x.get("fwdbwd", {}).get("traffic") for name, x in shapes.items()}
  per = {name: t for name, t in per.items() if t}
  if not per:
    return []
  rows, seen = {}, {}
  for name, calls in per.items():
    count: dict = {}
    for c in calls:
      kind = (c["kernel"], bool(c.get("conditional")))
      count[kind] = count.get(kind, 0) + 1
      key = (*kind, count[kind])
      seen.setdefault(key, len(seen))
      rows.setdefault(key, {})[name] = c
  body = []
  for key in sorted(rows, key=seen.get):
    kernel, conditional, i = key
    cells = [f"`{kernel}`" + (f" ({i})" if i > 1 else "") + (" when taken" if conditional else "")]
    for name in per:
      c = rows[key].get(name)
      cells += [f"{c['read_mb']:.0f} / {c['write_mb']:.0f}", num(c["floor_ms"])] if c else ["-", "-"]
    body.append(cells)
  every = {name: [c for c in calls if not c.get("conditional")] for name, calls in per.items()}
  body.append(["calls every run makes"] + [x for name in per for x in (
      f"{sum(c['read_mb'] for c in every[name]):.0f} / {sum(c['write_mb'] for c in every[name]):.0f}",
      num(sum(c["floor_ms"] for c in every[name])))])
  head = ["forward + backward kernel"] + [x for name in per for x in (f"{name} MiB in / out", f"{name} ms at 4.8 TB/s")]
  return (["Each Mosaic GPU call of the forward + backward: the MiB of its operands (an upper bound of what it "
           "reads) and of its results, and the time those bytes take at the H200's 4.8 TB/s (a floor for a "
           "kernel that moves them once). A call *when taken* lies in a conditional's branch or a loop's body "
           "(the choice between intra kernels, NaN confinement's rerun) and is not in the sum.", ""]
          + table(head, body))


def states_section(files, folder=None) -> list[str]:
  """One row per tools.bench_states file: forward + backward with and without states."""
  got = [(p, d) for p, k, d in files if k == "states"]
  if not got:
    return []
  lines = ["## Many short sequences with states", "",
           "`tools.bench_states`: N sequences of L tokens, forward + backward (`jax.grad`) with and without "
           "initial and final states (medians, ms; XLA temp memory, MiB); cu_seqlens traced unless concrete.", ""]
  rows = []
  for path, d in got:
    a, b = d["stateless"], d["states"]
    rows.append([f"`{relative(path, folder)}`", d.get("device", "-"), d["many"], f"{d.get('heads')} x {d.get('head_dim')}",
                 "concrete" if d.get("concrete") else "traced", num(a.get("fwdbwd_ms")), num(b.get("fwdbwd_ms")),
                 f"{d['ratio']:.2f}x", num(a.get("temp_mb"), 0), num(b.get("temp_mb"), 0)])
  return lines + table(["file", "device", "N x L", "H x K", "cu_seqlens", "stateless f+b", "states f+b",
                        "states / stateless", "temp stateless", "temp states"], rows)


def dtype_section(files, folder=None) -> list[str]:
  """One table per tools.bench_dtype file: the same shape with bf16 and with float32 inputs."""
  got = [(p, d) for p, k, d in files if k == "dtype"]
  if not got:
    return []
  lines = ["## float32 inputs", "",
           "`tools.bench_dtype`: one shape of `tools.bench` with bf16 inputs and with q, k, v, beta in float32 "
           "(`impl=None`; forward and `value_and_grad` medians, ms; compile of the forward + backward, s; XLA "
           "temp, MiB) and the backend each stage ran. The Mosaic GPU kernels take bf16 operands and refuse "
           "float32 inputs, so a float32 call runs the fallbacks.", ""]
  for path, d in got:
    lines += [f"`{relative(path, folder)}`" + (f" (shape {d['shape']}, {d['device']})" if "shape" in d else ""), ""]
    rows = [[dt, num(d[dt].get("fwd_ms")), num(d[dt].get("fwdbwd_ms")), num(d[dt].get("compile_s"), 1),
             num(d[dt].get("temp_mb"), 0), ", ".join(d[dt].get("backends", []))] for dt in ("bfloat16", "float32")]
    lines += table(["inputs", "fwd", "f+b", "compile f+b", "temp", "backends"], rows)
    lines += [f"float32 / bf16 forward + backward: {d['ratio_fwdbwd']:.2f}x", ""]
  return lines


# The peers' kernels by the kda stage doing the same work: name prefix -> (stage of its launches in
# the forward, stage of the launches the forward + backward adds). FLA's from fla_profile.py's names.
PEER_STAGES = {
    "fla": {"chunk_local_cumsum_vector_kernel": ("gate", "bwd_gate"),
            "chunk_kda_fwd_kernel_intra_token_parallel": ("intra", "intra"),
            "chunk_kda_fwd_kernel_inter_solve_fused": ("intra", "intra"),
            "recompute_w_u_fwd_kda_kernel": ("intra", "bwd_recompute"),
            "chunk_gated_delta_rule_fwd_kernel_h": ("state+output", "bwd_recompute"),
            "chunk_gla_fwd_kernel_o": ("state+output", "state+output"),
            "chunk_kda_bwd_kernel_dAv": ("bwd_dav", "bwd_dav"),
            "chunk_gated_delta_rule_bwd_kernel_dhu": ("bwd_dh", "bwd_dh"),
            "chunk_kda_bwd_kernel_wy_dqkg_fused": ("bwd_wy", "bwd_wy"),
            "chunk_kda_bwd_kernel_intra": ("bwd_intra", "bwd_intra")},
    # jla 0.1.0's Mosaic GPU kernel names (jla/ops/mosaic_gpu/vector_gate*.py); its backward reads
    # the forward's saved w, kg, states and v_new, so a forward kernel launched again counts to S0
    "jla": {"vg_cumsum": ("gate", "bwd_recompute"),
            "vg_intra": ("intra", "bwd_recompute"),
            "vg_solve": ("intra", "bwd_recompute"),
            "vg_wy": ("intra", "bwd_recompute"),
            "vg_state_output": ("state+output", "bwd_recompute"),
            "vg_bwd_dav": ("bwd_dav", "bwd_dav"),
            "vg_bwd_state": ("bwd_dh", "bwd_dh"),
            "vg_bwd_wy": ("bwd_wy", "bwd_wy"),
            "vg_bwd_dakk": ("bwd_wy", "bwd_wy"),
            "vg_bwd_intra": ("bwd_intra", "bwd_intra"),
            "vg_rev_cumsum": ("bwd_gate", "bwd_gate")},
}
STAGE_ROWS = ("gate", "intra", "state+output", "bwd_recompute", "bwd_dav", "bwd_dh", "bwd_wy", "bwd_intra",
              "bwd_gate")
OTHER = "other (layout, XLA ops, copies)"
# kda pieces that are one kernel doing the work of two stage rows: their time goes to this row
MERGED = {"gate+intra": "intra"}


def peer_stages(peer, kernels) -> dict:
  """{stage: ms} of a peer's forward + backward: each kernel's launches beyond its forward's time go
  to the backward stage of PEER_STAGES (the longest known name the kernel's name holds); others to
  OTHER."""
  fwd = {}
  for x in kernels.get("fwd", []):
    fwd[x["kernel"]] = fwd.get(x["kernel"], 0.0) + x["ms"]
  both = kernels.get("fwd+bwd", kernels.get("fwdbwd", []))
  out = dict.fromkeys(STAGE_ROWS + (OTHER,), 0.0)
  known = sorted(PEER_STAGES.get(peer, {}).items(), key=lambda kv: -len(kv[0]))
  for x in both:
    stage = next((st for name, st in known if name in x["kernel"]), (OTHER, OTHER))   # any decoration around
    in_fwd = min(fwd.get(x["kernel"], 0.0), x["ms"])
    out[stage[0]] += in_fwd
    out[stage[1]] += x["ms"] - in_fwd
  return out


def budget_section(files, folder=None) -> list[str]:
  """Per folder with a tools.profile file: device ms per call of one forward + backward by stage,
  kda's pieces beside the peers' kernels of the same folder."""
  profiles = [(p, d) for p, k, d in files if k == "profile"]
  if not profiles:
    return []
  lines = ["## Where the time goes, by stage", "",
           "Device busy time per call (ms) of one forward + backward, by stage: kda's from `tools.profile` "
           "(`value_and_grad`, kernels and XLA ops attributed to the stage's name scope), the peers' "
           "kernels by the stage doing the same work (a kernel launched in the forward and again in "
           "the backward counts its extra launches to the backward's stage: FLA's forward intra and "
           "state kernels rerun as S0). kda's `state+output` is one kernel; FLA's state and output "
           "kernels are summed there.", ""]
  rel = lambda p: relative(p, folder)
  for path, data in profiles:
    peers = {p.name.split("_")[0]: (p, d) for p, k, d in files if k == "kernels" and p.parent == path.parent}
    for variant, labels in data.items():
      both = labels.get("fwdbwd")
      if not both:
        continue
      ours = dict.fromkeys(STAGE_ROWS + (OTHER,), 0.0)
      merged = sorted(p for p in both["pieces_ms"] if p in MERGED)
      for piece, ms in both["pieces_ms"].items():
        ours[MERGED.get(piece, piece) if MERGED.get(piece, piece) in ours else OTHER] += ms
      have = [p for p in PEERS if variant in peers.get(p, (None, {}))[1]]
      cols = [(PEER_NAME[p], peer_stages(p, peers[p][1][variant])) for p in have]
      lines += [f"### {variant}: " + ", ".join(f"`{rel(x)}`" for x in [path] + [peers[p][0] for p in have]), ""]
      rows = [[st, num(ours[st])] + [num(c[st]) for _, c in cols] for st in STAGE_ROWS + (OTHER,)]
      rows.append(["total", num(sum(ours.values()))] + [num(sum(c.values())) for _, c in cols])
      lines += table(["stage", "kda"] + [n for n, _ in cols], rows)
      if merged:
        lines += [f"kda's `{p}` is one kernel here: its time is in the {MERGED[p]} row." for p in merged] + [""]
  return lines
