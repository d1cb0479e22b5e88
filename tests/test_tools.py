"""tools.trace and tools.stages: they run, report what they should, and catch a broken pipeline."""
from __future__ import annotations

import csv
import io
from types import SimpleNamespace
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda import padding, stages
from kda import plan as planning
from kda import steps
from kda.stages import gate
from kda.stages.base import Stage
from tools import stages as stages_tool
from tools import trace

LENS, BT, D, EXTRA = [30, 50], 16, 32, 8
SMALL = ["--seq-lens", "30,50", "--chunk-size", "16", "--head-dim", "32", "--heads", "2",
         "--extra-tokens", str(EXTRA)]


def expected_kinds(lens, chunk_size, extra):
  """Token types of the aligned buffer, worked out from the lengths alone."""
  kinds = []
  for L in lens:
    kinds += ["real"] * L + ["pad"] * (-L % chunk_size)
  Ta = padding.aligned_length(sum(lens) + extra, len(lens), chunk_size)
  return kinds + ["tail"] * (Ta - len(kinds))


def run_main(argv):
  out, err = io.StringIO(), io.StringIO()
  rc = trace.main(argv, out=out, err=err)
  return rc, out.getvalue(), err.getvalue()


def test_trace_text_all_invariants_pass():
  rc, out, _ = run_main(SMALL + ["--format", "text", "--head", "1"])
  assert rc == 0, out
  verdicts = [l for l in out.splitlines() if l.startswith(("PASS", "FAIL"))]
  assert len(verdicts) >= 16 and all(l.startswith("PASS") for l in verdicts), "\n".join(verdicts)
  kinds = expected_kinds(LENS, BT, EXTRA)
  token_lines = [l for l in out.splitlines() if l[2:].split()[:1] and l[2:].split()[0].isdigit()]
  assert [int(l[2:].split()[0]) for l in token_lines] == list(range(len(kinds)))
  for line, kind in zip(token_lines, kinds):
    assert line[:2] == trace.MARK[kind] and line[2:].split()[4] == kind, line


def test_trace_json_tokens_and_verdicts():
  rc, out, _ = run_main(SMALL + ["--format", "json"])
  assert rc == 0
  doc = json.loads(out)
  kinds = expected_kinds(LENS, BT, EXTRA)
  assert [r["type"] for r in doc["tokens"]] == kinds
  assert doc["ok"] and all(v["ok"] for v in doc["verdicts"])
  names = {v["name"] for v in doc["verdicts"]}
  assert {"Akk rows and columns = 0 at padding", "o = 0 at padding",
          "real-token outputs = recurrence's (rel)"} <= names
  pad = [r for r in doc["tokens"] if r["type"] == "pad"]
  assert all(r["g_raw"] == padding.NEUTRAL_GATE and r["g_act"] == 0 and r["u"] == 0 and r["o"] == 0
             and r["akk_row_zero"] and r["aqk_col_zero"] for r in pad)
  real = [r for r in doc["tokens"] if r["type"] == "real"]
  assert all(r["o"] > 0 and r["k"] > 0 for r in real)
  # |h| at every chunk start, |final_state| at each sequence's last real token only
  assert [r["tok"] for r in doc["tokens"] if r["h"] is not None] == list(range(0, len(kinds), BT))
  assert [r["tok"] for r in doc["tokens"] if r["final_state"] is not None] == [29, 32 + 49]


def test_trace_csv_token_range():
  rc, out, err = run_main(SMALL + ["--format", "csv", "--tokens", "20:40"])
  assert rc == 0
  rows = list(csv.DictReader(io.StringIO(out)))
  assert [int(r["tok"]) for r in rows] == list(range(20, 40))
  assert [r["type"] for r in rows] == expected_kinds(LENS, BT, EXTRA)[20:40]
  verdicts = [l for l in err.splitlines() if l.startswith("# ")]
  assert verdicts and all(l.startswith("# PASS") for l in verdicts)


def failed(tr):
  return {v.name for v in tr.verdicts if not v.ok}


def test_trace_catches_unneutralised_padding_gates(monkeypatch):
  # neither -1e4 at padding nor the gate stage's mask: softplus(0 + dt_bias) decays the state there
  def unmasked(g, valid, A_log, dt_bias, *, chunk_size, use_gate_in_kernel, lower_bound):
    g_act = gate.activate(g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
    whole, frac = gate.split(g_act)
    return gate.Out(g_act, gate.chunk_cumsum(whole, chunk_size), gate.chunk_cumsum(frac, chunk_size))

  monkeypatch.setattr(padding, "neutralize_gate", lambda g, valid: g)
  monkeypatch.setitem(stages.STAGES, "gate", Stage("gate", reference=SimpleNamespace(apply=unmasked)))
  rc, out, _ = run_main(SMALL)
  assert rc == 1
  tr = trace.run_trace(LENS, chunk_size=BT, head_dim=D, heads=2, extra_tokens=EXTRA)
  bad = failed(tr)
  assert {"raw gate = -10000 at padding (neutralize_gate)", "activated gate = 0 at padding",
          "gc flat after the last real token of its chunk",
          "final_state = recurrence's state after the last real token (rel)"} <= bad, bad
  assert "real-token outputs = recurrence's (rel)" not in bad     # padding only follows real tokens
  assert "FAIL  activated gate = 0 at padding" in out


def test_trace_catches_padding_leak_in_intra(monkeypatch):
  ref = stages.get("intra").reference.apply

  def leaky(*args, **kwargs):
    out = ref(*args, **kwargs)
    return out._replace(w=out.w + 1e-3)         # w != 0 at padding; v_new = u - w @ S follows

  monkeypatch.setitem(stages.STAGES, "intra", Stage("intra", reference=SimpleNamespace(apply=leaky)))
  tr = trace.run_trace(LENS, chunk_size=BT, head_dim=D, gate="plain", extra_tokens=EXTRA)
  bad = failed(tr)
  assert {"w = 0 at padding", "v_new = 0 at padding", "real-token outputs = recurrence's (rel)"} <= bad
  assert "u = 0 at padding" not in bad
  v = next(v for v in tr.verdicts if v.name == "w = 0 at padding")
  assert v.worst == pytest.approx(1e-3) and "pad of seq" in v.where


def test_trace_plot_writes_png(tmp_path):
  pytest.importorskip("matplotlib")
  path = tmp_path / "trace.png"
  rc, _, err = run_main(SMALL + ["--plot", str(path), "--tokens", "0:0"])
  assert rc == 0, err
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_bad_arguments():
  rc, _, err = run_main(SMALL + ["--impl", "intra"])
  assert rc == 2 and "error:" in err
  rc, _, err = run_main(SMALL + ["--head", "2"])
  assert rc == 2 and "--head" in err


STAGES_SMALL = dict(seq_lens=[20, 13], chunk_size=16, head_dim=16, heads=1)


def test_stages_tool_lists_every_forward_stage():
  out = io.StringIO()
  rc = stages_tool.main(["--seq-lens", "20,13", "--chunk-size", "16", "--head-dim", "16"], out=out)
  text = out.getvalue()
  assert rc == 0, text
  listed = [l.split()[0] for l in text.splitlines()[3:-1]]
  assert sorted(set(listed)) == sorted(stages.FORWARD)
  for name in stages.FORWARD:
    status = "no kernel" if stages.get(name).pallas is None else "ok"
    assert any(l.startswith(name) and l.rstrip().endswith(status) for l in text.splitlines()), text
  assert "no stage disagrees" in text


def test_stages_tool_compares_the_mosaic_gpu_kernels():
  """--impl mosaic_gpu: the stages with a Mosaic GPU kernel run it (the simulator here) on the
  reference's inputs, at the bfloat16 tolerance; the others are "no kernel"."""
  rep = stages_tool.compare_stages(seq_lens=[70, 1], chunk_size=64, head_dim=64, heads=2, impl="mosaic_gpu")
  want = {n: "agrees" if stages.get(n).mosaic_gpu is not None else "no kernel" for n in stages.FORWARD}
  assert {s.name: s.status for s in rep.stages} == want and want["state"] == "agrees"
  assert rep.config["tol"] == stages_tool.TOL["bfloat16"]
  with pytest.raises(ValueError, match="impl must be one of"):
    stages_tool.compare_stages(impl="triton")


def as_kernel(fn):
  """A reference used as a stand-in kernel (launcher signature: takes interpret)."""
  return lambda *a, interpret=False, **kw: fn(*a, **kw)


def test_stages_tool_flags_first_disagreeing_stage(monkeypatch):
  get = {n: stages.get(n).reference.apply for n in stages.FORWARD}

  def bad_intra(*a, interpret=False, **kw):
    out = get["intra"](*a, **kw)
    return out._replace(u=out.u * (1 + 1e-2))

  def nan_output(*a, interpret=False, **kw):
    out = get["output"](*a, **kw)
    return out._replace(o=jnp.full_like(out.o, jnp.nan))

  ns = lambda fn: SimpleNamespace(apply=fn)
  monkeypatch.setitem(stages.STAGES, "gate", Stage("gate", reference=ns(get["gate"])))          # no kernel
  monkeypatch.setitem(stages.STAGES, "intra", Stage("intra", reference=ns(get["intra"]), pallas=ns(bad_intra)))
  monkeypatch.setitem(stages.STAGES, "state", Stage("state", reference=ns(get["state"]),
                                                    pallas=ns(as_kernel(get["state"]))))
  monkeypatch.setitem(stages.STAGES, "output", Stage("output", reference=ns(get["output"]), pallas=ns(nan_output)))
  rep = stages_tool.compare_stages(**STAGES_SMALL)
  status = {s.name: s.status for s in rep.stages}
  assert status == {"gate": "no kernel", "intra": "differs", "state": "agrees", "output": "differs"}
  assert rep.first_bad.name == "intra"
  diffs = {f.field: f for f in rep.stages[1].fields}
  assert not diffs["u"].ok and diffs["u"].max_rel == pytest.approx(1e-2, rel=1e-3)
  assert all(diffs[f].ok and diffs[f].max_abs == 0 for f in ("Akk", "Aqk", "w", "qg", "kg"))
  assert "token" in diffs["u"].worst and "seq" in diffs["u"].worst
  assert not np.isfinite(rep.stages[3].fields[0].max_abs)   # NaN counts as a difference
  out = io.StringIO()
  stages_tool.render(rep, out)
  assert "FIRST DISAGREEING STAGE: intra" in out.getvalue()


def test_bench_smoke_table_and_pieces(tmp_path, capsys):
  """tools.bench end to end on a tiny CPU run: the table against both peers' JSON and the pieces."""
  from tools import bench
  fla = tmp_path / "fla.json"
  fla.write_text(json.dumps({"variants": {"B:plain": {"fwd_ms_median": 2.0, "fwdbwd_ms_median": 11.0}}}))
  jla = tmp_path / "jla.json"
  jla.write_text(json.dumps({"shapes": {"B": {"fwd": {"ms_median": 1.5}, "fwdbwd": {"ms_median": 6.0}}}}))
  out = tmp_path / "bench.json"
  assert bench.main(["--variants", "B:plain", "--impls", "auto", "--no-bwd", "--reps", "1", "--total", "96",
                     "--stages", "--peer", str(fla), "--jla", str(jla), "--out", str(out)]) == 0
  text = capsys.readouterr().out
  res = json.loads(out.read_text())
  row = res["rows"][0]
  assert "error" not in row and row["fwd_ms"] > 0
  assert res["jla"]["B:plain"]["fwd_ms_median"] == 1.5 and res["fla"]["B:plain"]["fwd_ms_median"] == 2.0
  assert f"{row['fwd_ms'] / 1.5:7.2f}" in text            # x = kda / the faster peer
  pieces = res["stages"]["B:plain"]
  assert {"prepare", "unalign"} <= set(pieces) and any(p.startswith("intra (") for p in pieces)


def test_bench_dtype_smoke(tmp_path):
  """tools.bench_dtype on a tiny CPU run: both dtypes timed, the backends recorded, a file
  tools.perf_report reads as the dtype kind."""
  import pathlib
  from tools import bench_dtype, perf_report
  out = tmp_path / "f32.json"
  bench_dtype.main(["--shape", "B", "--total", "96", "--reps", "1", "--out", str(out)])
  res = json.loads(out.read_text())
  for dtype in ("bfloat16", "float32"):
    assert res[dtype]["fwd_ms"] > 0 and res[dtype]["fwdbwd_ms"] > 0, res[dtype]
    assert "bwd_wy:reference" in res[dtype]["backends"], res[dtype]["backends"]
  assert res["ratio_fwdbwd"] == res["float32"]["fwdbwd_ms"] / res["bfloat16"]["fwdbwd_ms"]
  assert perf_report.classify(pathlib.Path(out), res) == "dtype"


def test_bench_states_profile_smoke(tmp_path):
  """tools.bench_states --profile on a tiny CPU run: with states the recurrence of the short
  sequences is its own piece (kda.short), without states there is none."""
  from tools import bench_states
  out = tmp_path / "states.json"
  bench_states.main(["--many", "40x1", "--heads", "1", "--head-dim", "64", "--reps", "1",
                     "--profile", str(tmp_path / "traces"), "--out", str(out)])
  res = json.loads(out.read_text())
  assert res["states"]["pieces_ms"].get("short", 0) > 0, res["states"]["pieces_ms"]
  assert not any(p.startswith("short") for p in res["stateless"]["pieces_ms"]), res["stateless"]["pieces_ms"]
  assert res["states"]["top_ops"] and res["ratio"] == res["states"]["fwdbwd_ms"] / res["stateless"]["fwdbwd_ms"]


def test_bench_backward_pieces():
  """tools.bench's backward pieces on a tiny CPU run: every backward stage with the implementation
  the pipeline picks (on a CPU its xla implementation where it has one, else its reference), the
  glue and the whole backward, all timed."""
  from tools import bench
  pieces = bench.backward_stage_times("A", "plain", reps=1, total=128)
  want = {f"{n} ({'xla' if stages.get(n).xla else 'reference'})" for n in stages.BACKWARD}
  want |= {"backward (whole, pipeline.backward)", "glue: prepare + its vjp", "glue: align do"}
  assert set(pieces) == want and all(ms > 0 for ms in pieces.values())


@pytest.mark.large      # ~13 s in the simulator (CI budget); the packed group itself is tested in test_pipeline
def test_bench_packed_pieces_compose_to_the_forward():
  """tools.bench's packed-group pieces (the GPU default's, simulator here) give chunk_kda's o and
  final state; a call the packed group does not take (HV * K = 64: no gate kernel) is refused."""
  import kda
  from tools import bench
  T, H, K = 200, 2, 64
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (unit(jax.random.normal(s, (1, T, H, K))).astype(jnp.bfloat16) for s in ks[:2])
  v = jax.random.normal(ks[2], (1, T, H, K)).astype(jnp.bfloat16)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (1, T, H, K))) / 8
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H))).astype(jnp.bfloat16)
  cu = jnp.array([0, 70, 150], jnp.int32)
  plan = planning.make_plan(scale=K ** -0.5, chunk_size=64, impl="mosaic_gpu")
  labels = []

  def piece(label, fn, *args):
    labels.append(label)
    return jax.jit(fn)(*args)

  o, final = bench.packed_pieces(piece, plan, lambda c: padding.layout_from_cu_seqlens(c, T, 64), cu, q, k, v, g,
                                 beta, jnp.zeros((2, H, K, K)), None, None)
  want, want_final = jax.jit(lambda *x: kda.chunk_kda(*x, cu_seqlens=cu, impl="mosaic_gpu",
                                                       output_final_state=True))(q, k, v, g, beta)
  assert len(labels) == 2
  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  assert np.abs(f32(o) - f32(want)).max() <= 2 ** -8 * np.abs(f32(want)).max()
  np.testing.assert_allclose(f32(final), f32(want_final), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="packed forward does not take"):
    bench.packed_pieces(piece, plan, lambda c: padding.layout_from_cu_seqlens(c, T, 64), cu,
                        *(x[:, :, :1] for x in (q, k, v, g, beta)), jnp.zeros((2, 1, K, K)), None, None)


def test_profile_attributes_device_time_to_pipeline_pieces():
  """tools.profile's parts: the kda.<piece> scopes of the compiled HLO (the innermost wins), the
  kernel names' pieces, and the per-call sums (events of no scope counted apart)."""
  from tools import profile

  def f(x):
    with steps.scope("intra"):
      y = jnp.sin(x) * 3.0
    with steps.scope("bwd_dh"):
      with steps.scope("state+output"):
        y = jnp.cos(y) @ y
    return y

  text = jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text()
  scopes = profile.hlo_scopes(text)
  assert set(scopes.values()) <= {"intra", "state+output"} and "state+output" in scopes.values(), scopes
  assert profile.scope_of("jit(f)/transpose(jvp(kda.prepare))/jit(_take)/gather") == "prepare (vjp)"
  assert profile.scope_of("jit(f)/jvp(kda.bwd_dh)/kda.state+output/dot") == "state+output"
  assert profile.scope_of("jit(f)/mul") is None
  assert profile.kernel_piece("kda_bwd_intra_mosaic_gpu_kernel") == "bwd_intra"
  assert profile.kernel_piece("kda_state_output_mosaic_gpu_kernel") == "state+output"
  assert profile.kernel_piece("kda_intra_solve_mosaic_gpu_kernel") == "intra"
  assert profile.kernel_piece("loop_add_fusion") is None
  op = next(iter(scopes))
  events = [(op, 30.0, {}), ("kda_bwd_wy_mosaic_gpu_kernel", 50.0, {"hlo_op": "command_buffer_3"}),
            ("loop_add_fusion", 10.0, {"hlo_op": "loop_add_fusion"}), ("kda_bwd_wy_mosaic_gpu_kernel", 50.0, {})]
  pieces, ops = profile.attribute(events, scopes, calls=2)
  assert pieces == {"bwd_wy": 0.05, scopes[op]: 0.015, "(no kda scope)": 0.005}, pieces
  assert ops[0][1] == "bwd_wy" and ops[0][2] == 0.025 and ops[0][3] == 0.5
  # idle time: two overlapping events, then a 5 us and a 20 us gap, over two calls
  timed = [("a", 10.0, {}, 0.0), ("b", 4.0, {}, 2.0), ("c", 5.0, {}, 15.0), ("d", 1.0, {}, 40.0)]
  span, idle_ms, gaps = profile.idle(timed, calls=2)
  assert span == 41.0 / 1e3 / 2 and idle_ms == 25.0 / 1e3 / 2
  assert gaps == [(20.0, "c", "d"), (5.0, "a", "c")]


def test_memory_peak_from_dumps():
  """tools.memory's parsers on a small live-range and buffer-assignment dump: the peak step, the
  values live there (array values named with and without '{}'), parameters left out, a value stored
  in place over another (the same allocation and offset) counted once."""
  from tools import memory
  live = """HloLiveRange (max 4):
  InstructionSequence:
    0:p.1
    1:a
    2:b
    3:c
  BufferLiveRange:
    p.1{}:0-3
    a{}:1-2
    b{0}:2-3
    b{1}:2-2
    c{}:3-3
"""
  assignment = """allocation 0: size 400, parameter 0, shape |f32[100]| at ShapeIndex {}:
 value: <1 p.1 @0> (size=400,offset=0): f32[100]{0}
allocation 1: size 900, preallocated-temp:
 value: <2 a @0> (size=100,offset=0): f32[25]{0}
 value: <3 b{0} @0> (size=300,offset=100): f32[75]{0}
 value: <4 b{1} @0> (size=200,offset=400): f32[50]{0}
 value: <5 c @0> (size=50,offset=600): f32[12]{0}
"""
  steps, ranges = memory.live_ranges(live)
  sizes = memory.value_sizes(assignment)
  assert steps[2] == "b" and ("b{1}", 2, 2) in ranges and sizes["b{0}"][0] == 300
  t, total, rows = memory.peak(steps, ranges, sizes)
  assert (t, total) == (2, 600)                         # a + b{0} + b{1}; the parameter p.1 left out
  assert [r[1] for r in rows] == ["b{0}", "b{1}", "a"]
  # c written in place over a (the same allocation and offset), both live at step 2: counted once
  ranges = [(n, s, 3 if n == "a{}" else e) for n, s, e in ranges] + [("d{}", 2, 3)]
  sizes["d"] = (100, "f32[25]{0}", "preallocated-temp", (1, 0))
  t, total, rows = memory.peak(steps, ranges, sizes)
  assert (t, total) == (2, 600) and [r[1] for r in rows] == ["b{0}", "b{1}", "a"]
  # a zero-byte value live at the peak (a token, an empty array) takes no place and is not listed
  sizes["e"] = (0, "f32[0]{0}", "preallocated-temp", (1, 800))
  t, total, rows = memory.peak(steps, ranges + [("e{}", 1, 3)], sizes)
  assert (t, total) == (2, 600) and [r[1] for r in rows] == ["b{0}", "b{1}", "a"]


def test_compile_report_lowers_the_program_and_each_kernel(tmp_path):
  """tools.compile_report --lower-only (a CPU, the platform taken as an H200): the forward's phases
  and each Mosaic GPU kernel it calls, lowered alone for CUDA (the unfused gate and intra kernels:
  the gate -> intra group's lowering is tests/test_fused_gate_intra.py's, and takes 15 s more)."""
  from tools import compile_report
  out = tmp_path / "c.json"
  assert compile_report.main(["--variants", "C:plain", "--total", "1024", "--no-bwd", "--kernels",
                              "--lower-only", "--config", "packed_forward.fuse_gate_intra=0",
                              "--out", str(out)]) == 0
  (row,) = json.loads(out.read_text())
  names = [k["kernel"] for k in row["kernels"]]
  assert row["program"] == "fwd" and row["lower_s"] > 0 and row["kernel_calls"] == len(names)
  # w, u left to the state kernel (packed_forward's inverse_in_state): the deferred solve
  assert {"kda_gate", "kda_intra_scores", "kda_intra_solve_x", "kda_state_output"} <= set(names)
  assert all(k["lower_s"] > 0 for k in row["kernels"]) and row["kernels_lower_s"] > 0


def test_compile_report_reads_ptxas_logs():
  """--ptxas's parser: registers and spills per entry function, from ptxas -v style logs (one per
  kernel module), a function's numbers not taken by the next."""
  from tools import compile_report
  logs = [
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function 'kda_intra_solve_mosaic_gpu_kernel' for 'sm_90a'\n"
      "ptxas info    : Function properties for kda_intra_solve_mosaic_gpu_kernel\n"
      "    0 bytes stack frame, 24 bytes spill stores, 32 bytes spill loads\n"
      "ptxas info    : Used 168 registers, used 1 barriers, 384 bytes cmem[0]\n",
      "ptxas info    : Compiling entry function 'kda_gate_mosaic_gpu_kernel' for 'sm_90a'\n"
      "ptxas info    : Function properties for kda_gate_mosaic_gpu_kernel\n"
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 40 registers, 384 bytes cmem[0]\n",
  ]
  got = compile_report.ptxas_summary(logs)
  assert got == {
      "kda_intra_solve_mosaic_gpu_kernel": dict(registers=168, stack=0, spill_stores=24, spill_loads=32),
      "kda_gate_mosaic_gpu_kernel": dict(registers=40, stack=0, spill_stores=0, spill_loads=0)}


def test_compile_report_mosaic_traffic():
  """h200_aot --traffic's parser: each Mosaic GPU call of an optimized HLO module, its operands'
  bytes (operand_layout_constraints), its results' bytes, aliasing, its kernel scope and whether it
  lies in a branch or a loop body (also through a computation such a body calls); other custom
  calls are not counted."""
  from tools import compile_report
  call = lambda n, scope, alias="": (
      f'  %m.{n} = f32[64,16,64]{{2,1,0}} custom-call(%d), custom_call_target="mosaic_gpu_v2", '
      f'operand_layout_constraints={{f32[64,16,64]{{2,1,0}}, bf16[64,16,64]{{2,1,0}}}}, {alias}'
      f'api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(loss)/kda.{scope}/kda_{scope}/mpmd_map"}}')
  hlo = "\n".join([
      "%inner.1 (p: f32[2]) -> f32[2] {", call(1, "bwd_dav"), "}",
      "%branch.2 (p: f32[2]) -> f32[2] {", "  %c = f32[2] call(%p), to_apply=%inner.1", "}",
      "%other.3 (p: f32[2]) -> f32[2] {", "  %n = f32[2] negate(%p)", "}",
      "ENTRY %main.4 (p: f32[2]) -> f32[2] {",
      '  %mpmd_map.1 = (bf16[64,16,128]{2,1,0}, f32[2,16]{1,0}) custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", '
      'operand_layout_constraints={s32[3]{0}, bf16[64,16,128]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, '
      'metadata={op_name="jit(loss)/jvp(kda.packed_forward)/kda.gate+intra/kda_gate_intra_scores/mpmd_map"}',
      '  %cublas.2 = f32[8,8]{1,0} custom-call(%c), custom_call_target="__cublas$gemm", '
      'operand_layout_constraints={f32[8,8]{1,0}}, api_version=API_VERSION_TYPED_FFI',
      call(3, "bwd_wy", "output_to_operand_aliasing={{}: (0, {})}, "),
      "  %k = f32[2] conditional(%q, %p, %p), branch_computations={%branch.2, %other.3}",
      "}",
  ])
  got = compile_report.mosaic_traffic(hlo, bandwidth=2.0**20 * 1e3)      # 1 MiB per ms
  mib = 2.0 ** -20
  assert [(g["kernel"], g["conditional"]) for g in got] == [
      ("kda_gate_intra_scores", False), ("kda_bwd_wy", False), ("kda_bwd_dav", True)]
  assert got[0]["read_mb"] == (3 * 4 + 64 * 16 * 128 * 2) * mib
  assert got[0]["write_mb"] == (64 * 16 * 128 * 2 + 2 * 16 * 4) * mib and not got[0]["aliased"]
  assert got[1]["read_mb"] == 64 * 16 * 64 * 6 * mib and got[1]["write_mb"] == 64 * 16 * 64 * 4 * mib
  assert got[1]["aliased"] and not got[2]["aliased"]
  assert abs(got[1]["floor_ms"] - 64 * 16 * 64 * 10 * mib) < 1e-12


def test_compile_report_mosaic_traffic_call_reached_both_ways():
  """A computation a branch calls and the entry calls too (through another computation: the branch's
  path is the shorter) runs in every call of the program: its Mosaic GPU call is not `conditional`,
  whichever call site comes first."""
  from tools import compile_report
  call = ('  %m.1 = f32[4]{0} custom-call(%p), custom_call_target="mosaic_gpu_v2", '
          'operand_layout_constraints={f32[4]{0}}, api_version=API_VERSION_TYPED_FFI, '
          'metadata={op_name="jit(loss)/kda.bwd_wy/kda_bwd_wy/mpmd_map"}')
  for first, second in (("branch", "entry"), ("entry", "branch")):
    site = {"branch": "  %k = f32[4] conditional(%q, %p), branch_computations={%branch.2}",
            "entry": "  %c = f32[4] call(%p), to_apply=%mid.4"}
    hlo = "\n".join(["%inner.1 (p: f32[4]) -> f32[4] {", call, "}",
                     "%branch.2 (p: f32[4]) -> f32[4] {", "  %c = f32[4] call(%p), to_apply=%inner.1", "}",
                     "%mid.4 (p: f32[4]) -> f32[4] {", "  %c = f32[4] call(%p), to_apply=%branch.2", "}",
                     "ENTRY %main.3 (p: f32[4]) -> f32[4] {", site[first], site[second], "}"])
    got = compile_report.mosaic_traffic(hlo, bandwidth=1.0)
    assert [(g["kernel"], g["conditional"]) for g in got] == [("kda_bwd_wy", False)], (first, got)


def test_cpu_check_smoke():
  """tools.cpu_check at a tiny size: the recurrence, the forward and forward + backward each report a
  time and a memory growth, and the summary its ratio."""
  import json
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "tools.cpu_check", "--T", "128", "--H", "1", "--K", "16",
                        "--reps", "1"], capture_output=True, text=True, timeout=600, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  assert [r.get("measure") for r in rows[:3]] == ["recurrence", "forward", "fwdbwd"], out.stdout + out.stderr
  assert all("error" not in r and r["median_s"] > 0 for r in rows[:3]), rows
  assert rows[1]["impls"] == ["reference", "xla"] and rows[-1]["forward_over_recurrence"] > 0


def test_backends_records_each_choice_and_the_refusals():
  """tools.backends (kda.plan.recording): with Mosaic GPU asked for on a CPU, HV * K = 64 is refused
  by the gate kernels with their reason and the next backend runs; HV * K = 128 takes them."""
  from tools import backends
  kw = dict(heads=1, dtype=jnp.bfloat16, states=True, raw_gate=False, chunk_size=64, impl="mosaic_gpu",
            backward=True)
  by_name = lambda log: {c.name: c for c in log}
  small = by_name(backends.choices([3, 70, 1], K=64, V=64, **kw))
  assert small["bwd_recompute"] == planning.Choice("bwd_recompute", "mosaic_gpu", ())   # with the XLA gate
  for name in ("gate", "bwd_gate"):
    assert small[name].backend != "mosaic_gpu", name
    (backend, why), = small[name].refused
    assert backend == "mosaic_gpu" and "multiple of 128" in why, (name, why)
  assert small["intra"] == planning.Choice("intra", "mosaic_gpu", ())
  assert small["packed_forward"].backend is None            # a member refused: the group does not run
  wide = by_name(backends.choices([3, 70, 1], K=128, V=128, **kw))
  assert wide["gate"] == planning.Choice("gate", "mosaic_gpu", ())
  lines = backends.summary(backends.choices([3, 70, 1], K=64, V=64, **kw))
  assert "gate             xla" in lines and any("refused mosaic_gpu: mosaic_gpu gate" in l for l in lines)


def test_recording_sees_only_what_traces_inside_it():
  import kda
  x = jnp.ones((1, 8, 1, 16), jnp.float32)
  call = lambda x: kda.chunk_kda(x, x, x, -jnp.abs(x), x[..., 0], chunk_size=16)[0]
  with planning.recording() as log:
    pass
  jax.make_jaxpr(call)(x)
  assert log == []
  with planning.recording() as outer:
    with planning.recording() as inner:
      jax.make_jaxpr(call)(x[:, :5])             # another shape: a call traced before is cached
  assert outer == [] and [c.name for c in inner][:2] == ["gate", "intra"]   # the innermost block records


def test_backends_main_prints_the_layout_and_the_choices(capsys):
  from tools import backends
  assert backends.main(["--many", "20x5", "--heads", "1", "--head-dim", "64", "--states", "--no-bwd"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("20 sequences, 100 tokens, H = 1, K = 64")
  assert "1280 rows for 100 tokens" in out[1]                # 20 chunks of 64 rows
  assert any(l.startswith("gate ") for l in out[2:])
  assert backends.main(["--many", "20x3", "--heads", "1", "--head-dim", "64", "--states", "--no-bwd"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[1] == "20 sequences of at most 4 tokens run the recurrence (kda.short), 0 the chunks"
  assert out[2:] == ["short            reference"]                 # the stage short alone, jnp on a CPU
  with pytest.raises(SystemExit):
    backends.main(["--many", "20by3"])
