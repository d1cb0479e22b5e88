"""python -m tools.trace: what every forward stage computes at every token, real or padding, and
whether the padding invariants hold.

The trace makes a varlen example: random sequences of the --seq-lens lengths packed into one row
(B = 1, chunk size --chunk-size, K = V = --head-dim), followed by --extra-tokens tokens that belong
to no sequence and hold NaN, so a read of them would show. It runs kda's forward pipeline on it
(align, then the stages gate, intra, state, output, then unalign) with every stage's output
recorded, and the token-by-token recurrence (kda.reference.recurrent_kda) on the same inputs.

The table has one line per token of the aligned buffer, where every sequence starts on a chunk
boundary, for value head --head. A line is a real token, padding ('* ': the rest of a sequence's
last chunk) or tail ('. ': the chunks after the last sequence). Columns: token, chunk, sequence and
position in it; g_raw (the gate as the gate stage received it), g_act (activated) and gc (the
chunk-local cumsum), each a mean over K; the L2 norms of q, k, v and the value of beta as the stages
received them; whether the token's row / column of the chunk's Akk and Aqk is all zero (0) or not
(#); the L2 norms of u, w, qg, kg (intra), v_new (state) and o (output); |h|, the state entering
each chunk, on the chunk's first line; |S_fin|, a sequence's final state, on its last real token.

Then one PASS / FAIL line per invariant, with the worst value found, the tolerance and where:
  - the valid mask marks exactly the real tokens;
  - at padding: q = k = v = beta = 0; the raw gate is the neutral -1e4 (--gate raw) or 0 (--gate
    plain); the activated gate is 0; gc is flat after the last real token of its chunk; the rows
    and columns of Akk and Aqk are 0; u = w = qg = kg = v_new = o = 0 (all exactly);
  - against the recurrence: each final state (the state leaving a sequence's last chunk) and the
    real tokens' outputs within 1e-4 relative (max |diff| / max |recurrence|);
  - the outputs of the tokens of no sequence are exactly 0.

Exit status: 0 if every invariant holds, 1 if any fails, 2 for bad arguments.

Run it from the repository root. --impl is "reference", "pallas" or stage=impl pairs
("intra=pallas,state=reference"); by default each stage runs what chunk_kda's impl=None picks (on
a CPU the jnp references; kernels there run in interpret mode). docs/api.md describes the padding
layer and this tool in full.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda import padding, pipeline, stages
from kda import plan as planning
from kda.reference import recurrent_kda
from kda.stages.gate import activate
from tests import cases
from tests.cases import Inputs

ZERO_FIELDS = ("u", "w", "qg", "kg", "v_new", "o")
# float32 chunked vs token-by-token: the same terms summed in another order (chunk matmuls, the
# triangular solve) differ by ~1e-6 of the largest value; 1e-4 leaves room for long sequences.
REL_TOL = 1e-4
# gc flatness: a kernel's blocked cumsum may add the same gates in another order (<= BT * eps).
GC_REL_TOL = 1e-5


def make_inputs(seed, lens, *, H=1, K=128, V=128, gate="raw", extra_tokens=0, dtype=jnp.float32) -> Inputs:
  """Seeded random varlen inputs from the case catalogue (tests/cases.py), B = 1,
  T = sum(lens) + extra_tokens. gate "plain": log-space gates with a few strong ones, "raw":
  pre-activation gates with A_log and dt_bias (use_gate_in_kernel). The extra tokens belong to no
  sequence and are NaN, so a read of them shows."""
  if gate not in ("plain", "raw"):
    raise ValueError(f"gate must be 'plain' or 'raw', got {gate!r}")
  return cases.make_inputs(seed, lens=[int(n) for n in lens], H=H, K=K, V=V, dtype=dtype, gate=gate,
                           extra_T=int(extra_tokens))


_JIT_CACHE: dict = {}


def _recorded_forward(plan, T):
  """jit(inputs -> numpy-able dict of every recorded stage tensor and the recurrence's results).

  Cached on everything a monkeypatched stage or neutralize_gate changes, so a patched pipeline
  (tests) is traced afresh."""
  key = (plan, T, tuple(stages.get(n) for n in stages.FORWARD), padding.neutralize_gate)
  if key in _JIT_CACHE:
    return _JIT_CACHE[key]

  def fn(inp: Inputs):
    layout = padding.layout_from_cu_seqlens(inp.cu_seqlens, T, plan.chunk_size)
    o, final, rec = pipeline.forward(plan, layout, inp.q, inp.k, inp.v, inp.g, inp.beta,
                                     inp.initial_state, inp.A_log, inp.dt_bias, record=True)
    g_act = activate(inp.g, inp.A_log, inp.dt_bias, use_gate_in_kernel=plan.use_gate_in_kernel,
                     lower_bound=plan.lower_bound)
    o_ref, final_ref = recurrent_kda(inp.q, inp.k, inp.v, g_act, inp.beta, scale=plan.scale,
                                     initial_state=inp.initial_state, output_final_state=True,
                                     cu_seqlens=inp.cu_seqlens)
    g_in, valid = rec["inputs"]["gate"][:2]
    q, k, v, beta = rec["inputs"]["intra"][:4]
    it, st = rec["intra"], rec["state"]
    return dict(aligned_cu=layout.aligned_cu, valid=valid[0], g_raw=g_in[0], g_act=rec["gate"].g[0],
                gc=rec["gate"].gc_int[0] + rec["gate"].gc_frac[0], q=q[0], k=k[0], v=v[0], beta=beta[0], Akk=it.Akk[0],
                Aqk=it.Aqk[0], u=it.u[0], w=it.w[0], qg=it.qg[0], kg=it.kg[0], v_new=st.v_new[0],
                o=rec["output"].o[0], h=st.h[0], final_state=final, o_packed=o[0],
                o_ref=o_ref[0], final_ref=final_ref)

  _JIT_CACHE[key] = jax.jit(fn)
  return _JIT_CACHE[key]


class Verdict(NamedTuple):
  name: str
  ok: bool
  worst: float
  tol: float
  where: str


@dataclasses.dataclass
class Trace:
  config: dict
  a: dict          # numpy arrays: aligned tensors [Ta, HV, ...], h [NTa, HV, K, V], final [N, HV, K, V]
  seq: np.ndarray  # [Ta] sequence of each aligned token, -1 in the tail
  pos: np.ndarray  # [Ta] position inside its sequence (>= len for padding), -1 in the tail
  kind: np.ndarray  # [Ta] "real" | "pad" | "tail"
  verdicts: list

  @property
  def ok(self) -> bool:
    return all(v.ok for v in self.verdicts)

  def rows(self, head=0, tokens=slice(None)) -> list[dict]:
    """One dict per aligned token in `tokens`, for value head `head`."""
    return _rows(self, head)[tokens]


def _where(t, tr_seq, tr_kind, head):
  if tr_kind[t] == "tail":
    return f"token {t} (tail), head {head}"
  return f"token {t} ({tr_kind[t]} of seq {tr_seq[t]}), head {head}"


def _worst_over(m, mask, seq, kind):
  """m [Ta, HV] per-token magnitudes; -> (worst over masked tokens, where). NaN counts as worst."""
  m = np.where(mask[:, None], m, 0.0)
  if not mask.any():
    return 0.0, "no such tokens"
  key = np.where(mask[:, None], np.where(np.isnan(m), np.inf, m), -1.0)
  t, h = np.unravel_index(int(np.argmax(key)), m.shape)
  return float(m[t, h]), _where(t, seq, kind, h)


def _absmax(x):
  """[Ta, HV, ...] -> [Ta, HV] max |x| over the rest (NaN propagates)."""
  x = np.abs(x)
  return x.reshape(x.shape[:2] + (-1,)).max(-1) if x.ndim > 2 else x


def _matrix_absmax(A, BT):
  """A [Ta, HV, BT] (row of token t) -> max |row| and max |column| of each token [Ta, HV]."""
  Ta, HV, _ = A.shape
  rows = np.abs(A).max(-1)
  cols = np.abs(A).reshape(Ta // BT, BT, HV, BT).max(1)          # [NTa, HV, BT(j)]
  cols = np.transpose(cols, (0, 2, 1)).reshape(Ta, HV)
  return rows, cols


def _rel(got, want):
  """max |got - want| / max |want| and the flat index of the worst element."""
  err = np.abs(got.astype(np.float64) - want)
  key = np.where(np.isnan(err), np.inf, err)
  i = int(np.argmax(key)) if err.size else 0
  scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)
  return (float(err.flat[i]) / scale if err.size else 0.0), i


def check(tr: Trace) -> list:
  """The padding invariants (docs/api.md, kda.padding) and the checks against the recurrence, one
  Verdict each."""
  a, cfg = tr.a, tr.config
  BT, seq, kind = cfg["chunk_size"], tr.seq, tr.kind
  real = kind == "real"
  pad = ~real
  out = []

  def zero(name, m, mask=pad, tol=0.0):
    worst, where = _worst_over(m, mask, seq, kind)
    out.append(Verdict(name, bool(worst <= tol), worst, tol, where))

  mism = np.asarray(a["valid"]) != real
  out.append(Verdict("valid mask marks exactly the real tokens", not mism.any(), float(mism.sum()), 0.0,
                     f"first at token {int(np.argmax(mism))}" if mism.any() else ""))
  zero("align: q = k = v = beta = 0 at padding",
       np.maximum.reduce([_absmax(a[f]) for f in ("q", "k", "v", "beta")]))
  if cfg["gate"] == "raw":
    zero(f"raw gate = {padding.NEUTRAL_GATE:g} at padding (neutralize_gate)",
         _absmax(a["g_raw"] - padding.NEUTRAL_GATE))
  else:
    zero("raw gate = 0 at padding (align)", _absmax(a["g_raw"]))
  zero("activated gate = 0 at padding", _absmax(a["g_act"]))
  gc = a["gc"]
  chunks = gc.reshape((-1, BT) + gc.shape[1:])
  prev = np.concatenate([np.zeros_like(chunks[:, :1]), chunks[:, :-1]], axis=1).reshape(gc.shape)
  zero("gc flat after the last real token of its chunk", _absmax(gc - prev),
       tol=GC_REL_TOL * max(1.0, float(np.nanmax(np.abs(gc)))))
  for name in ("Akk", "Aqk"):
    rows, cols = _matrix_absmax(a[name], BT)
    zero(f"{name} rows and columns = 0 at padding", np.maximum(rows, cols))
  for f in ZERO_FIELDS:
    zero(f"{f} = 0 at padding", _absmax(a[f]))

  rel, i = _rel(a["final_state"], a["final_ref"])
  n, h = np.unravel_index(i, a["final_ref"].shape)[:2] if a["final_ref"].size else (0, 0)
  out.append(Verdict("final_state = recurrence's state after the last real token (rel)",
                     bool(rel <= REL_TOL), rel, REL_TOL, f"worst in seq {n}, head {h}"))
  T_real = cfg["T_real"]
  got, want = a["o_packed"][:T_real], a["o_ref"][:T_real]
  rel, i = _rel(got, want)
  t, h = np.unravel_index(i, want.shape)[:2] if want.size else (0, 0)
  out.append(Verdict("real-token outputs = recurrence's (rel)", bool(rel <= REL_TOL), rel, REL_TOL,
                     f"worst at packed token {t}, head {h}"))
  tail = a["o_packed"][T_real:]
  if tail.size:
    m = _absmax(tail)
    key = np.where(np.isnan(m), np.inf, m)
    t, h = np.unravel_index(int(np.argmax(key)), m.shape)
    worst, where = float(m[t, h]), f"packed token {T_real + t}, head {h}"
  else:
    worst, where = 0.0, "no such tokens"
  out.append(Verdict("outputs of tokens of no sequence = 0", bool(worst <= 0.0), worst, 0.0, where))
  return out


def run_trace(seq_lens=(100, 50), *, chunk_size=64, head_dim=128, heads=1, gate="raw", impl=None,
              seed=0, extra_tokens=8, lower_bound=None) -> Trace:
  """Run the recorded forward and the recurrence on the built-in example; check the invariants."""
  lens = [int(n) for n in seq_lens]
  inp = make_inputs(seed, lens, H=heads, K=head_dim, V=head_dim, gate=gate, extra_tokens=extra_tokens)
  plan = planning.make_plan(scale=head_dim ** -0.5, chunk_size=chunk_size,
                            use_gate_in_kernel=gate == "raw",
                            lower_bound=lower_bound if gate == "raw" else None, impl=impl)
  T = inp.q.shape[1]
  a = {k: np.asarray(x) for k, x in _recorded_forward(plan, T)(inp).items()}
  acu = a["aligned_cu"]
  Ta = a["g_act"].shape[0]
  seq, pos = np.full(Ta, -1), np.full(Ta, -1)
  kind = np.full(Ta, "tail", dtype=object)
  for n, L in enumerate(lens):
    s, e = int(acu[n]), int(acu[n + 1])
    seq[s:e], pos[s:e] = n, np.arange(e - s)
    kind[s:e] = "pad"
    kind[s:s + L] = "real"
  config = dict(seq_lens=lens, chunk_size=chunk_size, head_dim=head_dim, heads=heads, gate=gate,
                lower_bound=lower_bound, seed=seed, impl=dict(plan.impls), interpret=plan.interpret,
                T=T, T_real=sum(lens), Ta=Ta, aligned_cu=[int(x) for x in acu])
  tr = Trace(config, a, seq, pos, kind, [])
  tr.verdicts = check(tr)
  return tr


def _norm(x):
  return np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=-1))


def _rows(tr: Trace, head: int) -> list:
  a, BT = tr.a, tr.config["chunk_size"]
  Ta = len(tr.kind)
  akk_r, akk_c = (x[:, head] == 0 for x in _matrix_absmax(a["Akk"], BT))
  aqk_r, aqk_c = (x[:, head] == 0 for x in _matrix_absmax(a["Aqk"], BT))
  mean = lambda f: a[f][:, head].mean(-1)
  norm = lambda f: _norm(a[f][:, head])
  num = lambda x: float(f"{x:.7g}")                 # float32's digits, not float64 noise
  cols = dict(g_raw=mean("g_raw"), g_act=mean("g_act"), gc=mean("gc"), q=norm("q"), k=norm("k"),
              v=norm("v"), beta=a["beta"][:, head],
              **{f: norm(f) for f in ZERO_FIELDS})
  h_norm = np.sqrt(np.sum(np.square(a["h"][:, head].astype(np.float64)), axis=(-2, -1)))
  fin_norm = np.sqrt(np.sum(np.square(a["final_state"][:, head].astype(np.float64)), axis=(-2, -1)))
  last = {}
  for n, L in enumerate(tr.config["seq_lens"]):
    if L:
      last[int(tr.config["aligned_cu"][n]) + L - 1] = n
  rows = []
  for t in range(Ta):
    real_seq = tr.kind[t] != "tail"
    r = dict(tok=t, chunk=t // BT, seq=int(tr.seq[t]) if real_seq else None,
             pos=int(tr.pos[t]) if real_seq else None, type=str(tr.kind[t]))
    r.update({c: num(cols[c][t]) for c in ("g_raw", "g_act", "gc", "q", "k", "v", "beta")})
    r.update(akk_row_zero=bool(akk_r[t]), akk_col_zero=bool(akk_c[t]), aqk_row_zero=bool(aqk_r[t]),
             aqk_col_zero=bool(aqk_c[t]))
    r.update({f: num(cols[f][t]) for f in ZERO_FIELDS})
    r["h"] = num(h_norm[t // BT]) if t % BT == 0 else None
    r["final_state"] = num(fin_norm[last[t]]) if t in last else None
    rows.append(r)
  return rows


# ---- rendering

FIELDS = ["tok", "chunk", "seq", "pos", "type", "g_raw", "g_act", "gc", "q", "k", "v", "beta",
          "akk_row_zero", "akk_col_zero", "aqk_row_zero", "aqk_col_zero", "u", "w", "qg", "kg",
          "v_new", "o", "h", "final_state"]
TEXT_COLUMNS = [("tok", 4), ("ch", 3), ("seq", 3), ("pos", 4), ("type", 4), ("g_raw", 8), ("g_act", 8),
                ("gc", 8), ("|q|", 6), ("|k|", 6), ("|v|", 6), ("beta", 6), ("Akk", 4), ("Aqk", 4),
                ("|u|", 7), ("|w|", 7), ("|qg|", 7), ("|kg|", 7), ("|v_new|", 7), ("|o|", 7),
                ("|h|", 7), ("|S_fin|", 7)]
MARK = {"real": "  ", "pad": "* ", "tail": ". "}


def _num(x):
  if x is None:
    return ""
  if x == 0:
    return "0"
  return f"{x:.3g}"


def _rc(row_zero, col_zero):
  return ("0" if row_zero else "#") + "/" + ("0" if col_zero else "#")


def _verdict_line(v: Verdict) -> str:
  where = f"  [{v.where}]" if v.where and (v.worst != 0 or not v.ok or v.where == "no such tokens") else ""
  return f"{'PASS' if v.ok else 'FAIL'}  {v.name:<66} worst {v.worst:.3g} (tol {v.tol:g}){where}"


def render_text(tr: Trace, head, tokens, out):
  c = tr.config
  print(f"kda trace: seq_lens {c['seq_lens']}, chunk {c['chunk_size']}, K = V = {c['head_dim']}, "
        f"H = {c['heads']}, gate {c['gate']}{' (in kernel)' if c['gate'] == 'raw' else ''}, seed {c['seed']}",
        file=out)
  impls = ", ".join(f"{k}={c['impl'][k]}" for k in stages.FORWARD)
  print(f"impl: {impls}{' (interpret)' if c['interpret'] else ''}", file=out)
  print(f"packed T = {c['T']} ({c['T_real']} real, {c['T'] - c['T_real']} of no sequence, NaN); "
        f"aligned Ta = {c['Ta']}, aligned_cu {c['aligned_cu']}, {c['Ta'] // c['chunk_size']} chunks",
        file=out)
  print(f"head {head}. '* ' marks padding, '. ' the tail after aligned_cu[-1]. g_raw (as the gate "
        f"stage saw it), g_act, gc: means over K; |x|: L2 norm over the feature dim;", file=out)
  print("Akk/Aqk r/c: the token's row/column in its chunk's matrix, 0 = all zero, # = not; "
        "|h|: state entering the chunk; |S_fin|: final_state after the sequence.", file=out)
  print("  " + " ".join(f"{name:>{w}}" for name, w in TEXT_COLUMNS), file=out)
  for r in tr.rows(head, tokens):
    vals = [str(r["tok"]), str(r["chunk"]), "-" if r["seq"] is None else str(r["seq"]),
            "-" if r["pos"] is None else str(r["pos"]), r["type"],
            *(_num(r[f]) for f in ("g_raw", "g_act", "gc", "q", "k", "v", "beta")),
            _rc(r["akk_row_zero"], r["akk_col_zero"]), _rc(r["aqk_row_zero"], r["aqk_col_zero"]),
            *(_num(r[f]) for f in ZERO_FIELDS), _num(r["h"]), _num(r["final_state"])]
    line = MARK[r["type"]] + " ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, TEXT_COLUMNS))
    print(line.rstrip(), file=out)
  print("", file=out)
  for v in tr.verdicts:
    print(_verdict_line(v), file=out)
  failed = sum(not v.ok for v in tr.verdicts)
  print(f"{len(tr.verdicts) - failed} of {len(tr.verdicts)} invariants hold"
        + (f"; {failed} FAILED" if failed else ""), file=out)


def render_csv(tr: Trace, head, tokens, out, err):
  w = csv.DictWriter(out, fieldnames=FIELDS, lineterminator="\n")
  w.writeheader()
  for r in tr.rows(head, tokens):
    w.writerow({k: ("" if v is None else v) for k, v in r.items()})
  for v in tr.verdicts:
    print("# " + _verdict_line(v), file=err)


def render_json(tr: Trace, head, tokens, out):
  doc = dict(config=tr.config, head=head, tokens=tr.rows(head, tokens),
             verdicts=[v._asdict() for v in tr.verdicts], ok=tr.ok)
  json.dump(doc, out, indent=1)
  print("", file=out)


def plot(tr: Trace, head, path):
  """|Akk| and |Aqk| of every chunk for one head, lines after each chunk's last real token."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or the kda[plot] extra)") from e
  BT = tr.config["chunk_size"]
  NTa = len(tr.kind) // BT
  per_row = min(NTa, 3)
  nrows = math.ceil(NTa / per_row)
  fig, axes = plt.subplots(nrows, 2 * per_row, figsize=(4.2 * per_row * 2, 3.8 * nrows), squeeze=False)
  for ax in axes.flat:
    ax.set_axis_off()
  for c in range(NTa):
    sl = slice(c * BT, (c + 1) * BT)
    kinds = tr.kind[sl]
    n_real = int(np.sum(kinds == "real"))
    owner = "tail" if kinds[0] == "tail" else f"seq {tr.seq[c * BT]}"
    for m, name in enumerate(("Akk", "Aqk")):
      ax = axes[c // per_row, 2 * (c % per_row) + m]
      ax.set_axis_on()
      A = np.abs(tr.a[name][sl, head, :])
      im = ax.imshow(A, cmap="viridis", interpolation="nearest", vmin=0.0,
                     vmax=max(float(np.nanmax(A)), 1e-30))      # all-zero chunks draw dark
      if 0 < n_real < BT:
        ax.axhline(n_real - 0.5, color="red", lw=0.8)
        ax.axvline(n_real - 0.5, color="red", lw=0.8)
      ax.set_title(f"chunk {c} ({owner}, {n_real} real): |{name}|", fontsize=9)
      ax.set_xlabel("j (column)", fontsize=8)
      ax.set_ylabel("i (row)", fontsize=8)
      fig.colorbar(im, ax=ax, fraction=0.046)
  fig.suptitle(f"kda trace: seq_lens {tr.config['seq_lens']}, BT = {BT}, head {head}; "
               "red lines after the last real token")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


# ---- command line

def parse_impl(spec):
  """None | "reference" | "pallas" | "stage=impl,stage=impl" -> make_plan's impl argument."""
  if spec is None:
    return None
  if "=" not in spec:
    return spec
  out = {}
  for part in spec.split(","):
    name, sep, impl = part.partition("=")
    if not sep or not name or not impl:
      raise ValueError(f"--impl pairs must look like stage=impl, got {part!r}")
    out[name.strip()] = impl.strip()
  return out


def parse_tokens(spec):
  if spec is None:
    return slice(None)
  lo, sep, hi = spec.partition(":")
  if not sep:
    raise ValueError(f"--tokens must be a:b (either side may be empty), got {spec!r}")
  return slice(int(lo) if lo else None, int(hi) if hi else None)


def parse_lens(spec):
  lens = [int(x) for x in spec.split(",") if x.strip()]
  if not lens or any(n < 0 for n in lens):
    raise ValueError(f"--seq-lens must be non-negative integers like 100,50, got {spec!r}")
  return lens


def build_parser():
  p = argparse.ArgumentParser(prog="python -m tools.trace", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq-lens", default="100,50",
                 help="sequence lengths, comma separated; 0 is an empty sequence (default %(default)s)")
  p.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64),
                 help="chunk size BT (default %(default)s)")
  p.add_argument("--head-dim", type=int, default=128, help="K = V, the head dims (default %(default)s)")
  p.add_argument("--heads", type=int, default=1, help="number of heads, H = HV (default %(default)s)")
  p.add_argument("--head", type=int, default=0, help="value head to print and plot (default %(default)s)")
  p.add_argument("--gate", choices=("raw", "plain"), default="raw",
                 help="raw: raw gates activated in the pipeline (use_gate_in_kernel, A_log, dt_bias; "
                      "padding gates neutralised to -1e4); plain: log-space gates used as given "
                      "(default %(default)s)")
  p.add_argument("--lower-bound", type=float, default=None,
                 help="with --gate raw: the bounded activation lower_bound * sigmoid(...), a finite "
                      "negative number (default: the softplus activation)")
  p.add_argument("--tokens", default=None,
                 help="print only aligned tokens a to b (a:b, either side may be empty; default all)")
  p.add_argument("--format", choices=("text", "csv", "json"), default="text",
                 help="text: the table and the verdicts; csv: one row per token, verdicts on stderr; "
                      "json: config, tokens, verdicts and ok (default %(default)s)")
  p.add_argument("--impl", default=None,
                 help="reference | pallas | stage=impl[,stage=impl] (default: as chunk_kda's impl=None)")
  p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default %(default)s)")
  p.add_argument("--extra-tokens", type=int, default=8,
                 help="tokens of no sequence after the last one, filled with NaN (default %(default)s)")
  p.add_argument("--plot", default=None, metavar="FILE.png",
                 help="also draw |Akk| and |Aqk| of every chunk to FILE.png (needs matplotlib: the "
                      "[plot] extra)")
  return p


def main(argv=None, out=None, err=None) -> int:
  out = sys.stdout if out is None else out
  err = sys.stderr if err is None else err
  args = build_parser().parse_args(argv)
  try:
    lens = parse_lens(args.seq_lens)
    tokens = parse_tokens(args.tokens)
    impl = parse_impl(args.impl)
    if args.lower_bound is not None and args.gate != "raw":
      raise ValueError("--lower-bound applies to the gate in kernel: use it with --gate raw")
    if not 0 <= args.head < args.heads:
      raise ValueError(f"--head must be in [0, {args.heads}), got {args.head}")
    tr = run_trace(lens, chunk_size=args.chunk_size, head_dim=args.head_dim, heads=args.heads,
                   gate=args.gate, impl=impl, seed=args.seed, extra_tokens=args.extra_tokens,
                   lower_bound=args.lower_bound)
  except (ValueError, NotImplementedError) as e:
    print(f"error: {e}", file=err)
    return 2
  if args.format == "text":
    render_text(tr, args.head, tokens, out)
  elif args.format == "csv":
    render_csv(tr, args.head, tokens, out, err)
  else:
    render_json(tr, args.head, tokens, out)
  if args.plot:
    try:
      plot(tr, args.head, args.plot)
    except RuntimeError as e:
      print(f"error: {e}", file=err)
      return 2
    print(f"wrote {args.plot}", file=err)
  return 0 if tr.ok else 1


if __name__ == "__main__":
  sys.exit(main())
