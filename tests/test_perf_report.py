"""tools.perf_report: docs/performance.md from benchmark JSON (the example files in tests/data/perf)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

import pytest

from tools import perf_report

DATA = pathlib.Path(__file__).resolve().parent / "data" / "perf"


def report(tmp_path, folder, png=True):
  out, chart = tmp_path / "docs" / "performance.md", tmp_path / "docs" / "performance.png"
  argv = ["--dir", str(folder), "--out", str(out), "--png", str(chart) if png else ""]
  assert perf_report.main(argv) == 0
  return out, chart, argv


def section(page, title):
  """The lines of the table under heading `title` (up to the next heading)."""
  part = page.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]
  return [l for l in part.splitlines() if l.startswith("| ")]


def test_tables_against_the_peers(tmp_path):
  out, _, _ = report(tmp_path, DATA, png=False)
  page = out.read_text()
  assert "## Run example on NVIDIA H200" in page
  assert "- FLA: device NVIDIA H200, fla 0.6.0" in page
  # jla's ms embedded by tools.bench, its memory and compile figures from jla.json beside it
  assert "(`jla.json`; embedded by tools.bench)" in page
  fwd = section(page, "Forward, ms (median)")
  assert "| A:plain | auto | 1.601 | 1.890 | 1.630 | 0.98 |" in fwd       # 1.601 / min(1.89, 1.63)
  assert "| B:plain | auto | 1.704 | 2.110 | 2.040 | 0.84 |" in fwd
  fb = section(page, "Forward + backward, ms (median)")
  assert "| C:plain | auto | 8.423 | 9.580 | 6.240 | 1.35 |" in fb
  mem = section(page, "Memory, MiB")
  assert "| A:plain | auto | 864 | 2840 | 4410 | 3605 | 2150 |" in mem
  assert "| B:plain | auto | - | 2845 | - | 3840 | 2150 |" in mem
  assert "| A:plain | auto | 10.5 | 29.0 | 6.0 | 14.0 | - | - |" in section(page, "Compile, s")
  assert "| A:gate_safe | auto | ValueError: an example of a failed case |" in section(page, "Failed cases")
  assert "| intra (mosaic_gpu) | 1.300 |" in section(page, "Pieces of the default forward, A:plain, ms (each jitted apart)")
  assert "| bwd_intra (mosaic_gpu) | 2.490 |" in section(page, "Pieces of the default backward, A:plain, ms (each jitted apart)")
  tpu = page.split("## TPU: ahead-of-time compiles\n", 1)[1]
  assert "| state | f32 | v7x | an example of a refused compile | 2 | 70 | 57.6 | 64 | - | - | 0.4 |" in tpu
  assert "performance.png" not in page


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the [plot] extra")
def test_chart_and_check(tmp_path):
  out, chart, argv = report(tmp_path, DATA)
  assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "![forward and forward + backward of the newest run" in out.read_text()
  assert perf_report.main(argv + ["--check"]) == 0
  out.write_text(out.read_text().replace("1.601", "1.600"))
  assert perf_report.main(argv + ["--check"]) == 1


def test_newest_run_first_and_unknown_files(tmp_path):
  folder = tmp_path / "benchmarks"
  shutil.copytree(DATA, folder / "new")
  older = (DATA / "kda.json").read_text().replace("2026-12-03T00:00:00Z", "2026-11-01T00:00:00Z")
  (folder / "old").mkdir()
  (folder / "old" / "kda.json").write_text(older.replace('"commit": "example"', '"commit": "older"'))
  (folder / "notes.json").write_text('{"something": 1}')
  out, _, _ = report(tmp_path, folder, png=False)
  page = out.read_text()
  assert page.index("## Run example on") < page.index("## Run older on")
  # the older run's folder has no peer files: only what tools.bench embedded
  old = page.split("## Run older on", 1)[1]
  assert "- FLA: no figures for this run" in old and "| A:plain | auto | 1.601 | - | 1.630 | 0.98 |" in old
  assert "| `notes.json` | not a benchmark file |" in page


def test_no_benchmarks(tmp_path):
  chart = tmp_path / "docs" / "performance.png"
  chart.parent.mkdir()
  chart.write_bytes(b"stale")
  out, chart, _ = report(tmp_path, tmp_path / "benchmarks")
  assert "No benchmark JSON is committed yet" in out.read_text() and not chart.exists()


def test_committed_page_is_generated():
  """docs/performance.md is what `python -m tools.perf_report` makes of benchmarks/."""
  assert perf_report.main(["--check"]) == 0, "run python -m tools.perf_report and commit the page"


def test_fidelity_table(tmp_path):
  folder = tmp_path / "bench"
  shutil.copytree(DATA, folder)
  err = lambda m, r: {"max_rel": m, "rms_rel": r}
  (folder / "fid").mkdir()
  (folder / "fid" / "fidelity.json").write_text(json.dumps(
      {"kda[default]": {"o": err(0.0058, 0.0041), "dq": err(0.0031, 0.003)},
       "jla": {"dq": err(0.0039, 0.0037)}, "kda[other]": {"dq": {"max_rel": 0.0045}}}))
  out, _, _ = report(tmp_path, folder, png=False)
  page = out.read_text()
  assert "## bf16 fidelity" in page
  assert "| kda[default] | 5.80e-03 / 4.10e-03 | 3.10e-03 / 3.00e-03 |" in page
  assert "| jla | - | 3.90e-03 / 3.70e-03 |" in page
  assert "| kda[other] | - | 4.50e-03 |" in page                 # max_rel alone where rms is not measured
  assert "| `fid/fidelity.json` | fidelity |" in page


def test_states_table(tmp_path):
  folder = tmp_path / "bench"
  shutil.copytree(DATA, folder)
  run = lambda ms, mb: {"compile_s": 1.0, "fwdbwd_ms": ms, "mem_mb": mb, "temp_mb": mb}
  (folder / "st").mkdir()
  (folder / "st" / "states.json").write_text(json.dumps(
      {"many": "200000x1", "heads": 1, "head_dim": 64, "concrete": False, "device": "NVIDIA H200",
       "stateless": run(140.0, 900.4), "states": run(280.5, 4100.6), "ratio": 280.5 / 140.0}))
  page = report(tmp_path, folder, png=False)[0].read_text()
  assert "## Many short sequences with states" in page
  assert ("| `st/states.json` | NVIDIA H200 | 200000x1 | 1 x 64 | traced | 140.000 | 280.500 | 2.00x | 900 | 4101 |"
          in page)
  assert "| `st/states.json` | states |" in page


def test_aot_table(tmp_path):
  folder = tmp_path / "bench"
  shutil.copytree(DATA, folder)
  (folder / "aot").mkdir()
  calls = lambda ms: [{"kernel": "kda_bwd_wy_packed", "read_mb": 1908.4, "write_mb": 1318.0, "aliased": True,
                       "floor_ms": ms},
                      {"kernel": "kda_bwd_wy_packed", "read_mb": 10.0, "write_mb": 2.0, "aliased": False, "floor_ms": 0.25},
                      {"kernel": "kda_bwd_wy_packed", "read_mb": 1.0, "write_mb": 1.0, "aliased": False, "floor_ms": 0.5,
                       "conditional": True}]
  shape = lambda f, fb, ms: {"fwd": {"temp_mb": f, "lower_s": 1.0},
                             "fwdbwd": {"temp_mb": fb, "compile_s": 2.0, "traffic": calls(ms)}}
  (folder / "aot" / "h200_aot.json").write_text(json.dumps(
      {"tool": "tools.h200_aot", "run": {"commit": "abc1234", "jax": "0.11.2"}, "device": "NVIDIA H200", "config": "",
       "shapes": {"A": shape(798.2, 2050.4, 0.705), "B": shape(1258.0, 2053.6, 0.5)},
       "kernels": {"kda_bwd_wy_packed_mosaic_gpu_kernel": {"registers": 255, "spill_stores": 204}}}))
  page = report(tmp_path, folder, png=False)[0].read_text()
  assert "## Memory compiled for the H200 without one" in page
  assert "`aot/h200_aot.json` (commit abc1234, NVIDIA H200)" in page
  assert "| A | 798 | 2050 |" in page and "| B | 1258 | 2054 |" in page
  assert "| `kda_bwd_wy_packed_mosaic_gpu_kernel` | 255 | 204 |" in page
  assert "| forward + backward kernel | A MiB in / out | A ms at 4.8 TB/s | B MiB in / out | B ms at 4.8 TB/s |" in page
  assert "| `kda_bwd_wy_packed` | 1908 / 1318 | 0.705 | 1908 / 1318 | 0.500 |" in page
  assert "| `kda_bwd_wy_packed` (2) | 10 / 2 | 0.250 | 10 / 2 | 0.250 |" in page
  assert "| `kda_bwd_wy_packed` when taken | 1 / 1 | 0.500 | 1 / 1 | 0.500 |" in page
  assert "| calls every run makes | 1918 / 1320 | 0.955 | 1918 / 1320 | 0.750 |" in page
  assert "| `aot/h200_aot.json` | aot |" in page


def test_residuals_table(tmp_path):
  folder = tmp_path / "bench"
  shutil.copytree(DATA, folder)
  (folder / "res").mkdir()
  leaves = lambda mib: [[[1, 32768, 16, 128], "bfloat16", int(mib * 2**20)]]
  (folder / "res" / "residuals.json").write_text(json.dumps(
      {"tool": "residuals", "run": {"commit": "abc1234", "jax": "0.11.2"},
       "shapes": {"A": {"kda": {"residual_MiB": 800.6, "leaves": leaves(800.6)},
                        "jla": {"residual_MiB": 1446.0, "leaves": leaves(1446.0)}}}}))
  page = report(tmp_path, folder, png=False)[0].read_text()
  assert "## What a layer keeps for its backward" in page
  assert "`res/residuals.json` (commit abc1234)" in page
  assert "| shape | kda | jla | jla / kda |" in page
  assert "| A | 801 | 1446 | 1.81 |" in page
  assert "| `res/residuals.json` | residuals |" in page


def test_dtype_table(tmp_path):
  folder = tmp_path / "bench"
  shutil.copytree(DATA, folder)
  run = lambda fwd, fb, mb, ran: {"fwd_ms": fwd, "fwdbwd_ms": fb, "compile_s": 6.25, "temp_mb": mb, "backends": ran}
  (folder / "dt").mkdir()
  (folder / "dt" / "f32.json").write_text(json.dumps(
      {"shape": "A", "device": "NVIDIA H200", "bfloat16": run(1.5, 9.5, 2840.2, ["bwd_wy:mosaic_gpu"]),
       "float32": run(12.0, 76.0, 9353.4, ["bwd_wy:reference", "intra:pallas"]), "ratio_fwdbwd": 8.0}))
  page = report(tmp_path, folder, png=False)[0].read_text()
  assert "## float32 inputs" in page
  assert "`dt/f32.json` (shape A, NVIDIA H200)" in page
  assert "| bfloat16 | 1.500 | 9.500 | 6.2 | 2840 | bwd_wy:mosaic_gpu |" in page
  assert "| float32 | 12.000 | 76.000 | 6.2 | 9353 | bwd_wy:reference, intra:pallas |" in page
  assert "float32 / bf16 forward + backward: 8.00x" in page
  assert "| `dt/f32.json` | dtype |" in page


def test_stage_budget_table(tmp_path):
  """tools.profile's pieces beside FLA's kernels by stage: a kernel's launches beyond the forward's
  count to its backward stage, unknown pieces and kernels to the other row."""
  folder = tmp_path / "bench"
  (folder / "run").mkdir(parents=True)
  (folder / "run" / "profile.json").write_text(json.dumps(
      {"A:plain": {"fwdbwd": {"pieces_ms": {"intra": 0.5, "gate+intra": 0.25, "bwd_wy": 2.0, "prepare": 0.25,
                                            "(no kda scope)": 0.5},
                              "wall_ms": 9.0}}}))
  k = lambda name, ms: {"kernel": name, "ms": ms, "launches": 1}
  (folder / "run" / "fla_profile.json").write_text(json.dumps(
      {"A:plain": {"fwd": [k("recompute_w_u_fwd_kda_kernel", 0.25), k("chunk_local_cumsum_vector_kernel", 0.125)],
                   "fwd+bwd": [k("recompute_w_u_fwd_kda_kernel", 0.625), k("chunk_kda_bwd_kernel_wy_dqkg_fused", 2.5),
                               k("chunk_local_cumsum_vector_kernel", 0.25), k("void at::native::fill", 0.0625)]}}))
  (folder / "run" / "jla_profile.json").write_text(json.dumps(
      {"A:plain": {"fwd": [k("vg_wy_kernel", 0.5)],
                   "fwd+bwd": [k("vg_wy_kernel", 0.5), k("vg_bwd_wy_kernel", 1.5), k("vg_bwd_dakk", 0.25),
                               k("vg_rev_cumsum", 0.125), k("input_fusion", 0.25)]}}))
  out, _, _ = report(tmp_path, folder, png=False)
  page = out.read_text()
  assert "## Where the time goes, by stage" in page
  assert "### A:plain: `run/profile.json`, `run/fla_profile.json`, `run/jla_profile.json`" in page
  assert "| stage | kda | FLA | jla |" in page
  assert "| intra | 0.750 | 0.250 | 0.500 |" in page           # kda's fused gate+intra counts here
  assert "kda's `gate+intra` is one kernel here: its time is in the intra row." in page
  assert "| bwd_recompute | 0.000 | 0.375 | 0.000 |" in page
  assert "| gate | 0.000 | 0.125 | 0.000 |" in page and "| bwd_gate | 0.000 | 0.125 | 0.125 |" in page
  assert "| bwd_wy | 2.000 | 2.500 | 1.750 |" in page      # jla's bwd_wy and bwd_dakk: S3's work
  assert "| other (layout, XLA ops, copies) | 0.750 | 0.062 | 0.250 |" in page
  assert "| total | 3.500 | 3.438 | 2.625 |" in page
  assert "| `run/fla_profile.json` | kernels |" in page and "| `run/profile.json` | profile |" in page
