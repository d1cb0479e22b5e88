"""kda.chunk_kda (default impl: the reference pipeline on CPU) against kda.reference.recurrent_kda.

Speed (CI budget): random inputs come from a few pools (tests.cases.make_inputs at 512 tokens and 8
initial states, one per head shape / dtype / gate kind); a case is a view of a pool, cut out inside
the jitted function (first B*T tokens or a gather, first N states), so no case pays for eager op
compiles, and each case costs one compile of chunk_kda and one of the recurrence. Run with `-s` to
see the max relative error (max |got - want| / max |want|) of o and final_state per case.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda import plan as planning
from kda.fused.packed_backward import mosaic_gpu as packed_backward_mgpu
from kda.fused.packed_forward import mosaic_gpu as packed_forward_mgpu
from kda.reference import recurrent_kda
from tests import cases


class Tol(NamedTuple):
  o_rtol: float     # elementwise, relative to |want|
  o_atol: float     # relative to max |want| of the tensor
  s_rtol: float
  s_atol: float


# float32: the chunked form reassociates the recurrence's sums (WY form, (I + Akk)^-1, chunk
# states), all in float32 with HIGHEST precision; measured max rel err <= 3.3e-6 (table below), so
# 2e-5 keeps a 6x margin. bfloat16: both paths read the same bf16-rounded inputs and compute in
# float32 (the reference gets them upcast, which is exact, so its o stays float32), while the
# pipeline rounds o to bf16 once: |bf16(x) - x| <= 2^-8 |x| (unit roundoff), plus the float32
# difference (atol); measured max rel err of o 2.7e-3 < 2^-8 = 3.9e-3. final_state never passes
# through bf16, so it keeps the float32 tolerance. (Kernels with bf16 operands need their own table.)
TOL = {
    jnp.dtype(jnp.float32): Tol(2e-5, 2e-5, 2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): Tol(2.0 ** -8, 2e-5, 2e-5, 2e-5),
}

# ---- input pools ---------------------------------------------------------------------------------

POOL_T, POOL_N = 512, 8
POOLS = {  # name -> make_inputs keywords
    "f32": dict(),
    "bf16": dict(dtype=jnp.bfloat16),
    "raw": dict(gate="raw"),
    "strong": dict(gate="strong"),
    "gva": dict(HV=4),
    "K64": dict(K=64, V=64),
    "K128": dict(H=1, K=128, V=128),
    "K96": dict(H=1, K=96, V=96),
    "K192": dict(H=1, K=192, V=192),
    "K64-V96": dict(H=1, K=64, V=96),
}


@functools.lru_cache(maxsize=None)
def pool(name):
  if name.startswith("l2-"):      # norms far from 1, so a skipped l2norm shows
    inp = pool(name[3:])
    keys = jax.random.split(jax.random.PRNGKey(77), 2)
    s = [jax.random.uniform(kk, inp.q.shape[:3] + (1,), minval=0.2, maxval=4.0) for kk in keys]
    return inp._replace(q=(inp.q * s[0]).astype(inp.q.dtype), k=(inp.k * s[1]).astype(inp.k.dtype))
  kw = dict(H=2, K=32, V=32) | POOLS[name]
  return cases.make_inputs(100 + list(POOLS).index(name), lens=[POOL_T // POOL_N] * POOL_N, **kw)


def _view(x, idx, B):
  """Pool tensor [1, POOL_T, ...] -> the tokens idx [B * T] as [B, T, ...]."""
  return x[:, idx].reshape((B, idx.shape[0] // B) + x.shape[2:])


def l2norm(x):
  """docs/api.md's definition, rounded back to x's dtype as the pipeline's inputs are."""
  xf = x.astype(jnp.float32)
  return (xf / jnp.sqrt(jnp.sum(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _chunk_fn(B, N, with_h0, gate_args, static):
  def f(p, idx, cu, seg, bad):
    q, k, v, g, beta = (_view(x, idx, B) for x in (p.q, p.k, p.v, p.g, p.beta))
    if bad is not None:            # poison what no sequence owns
      q, k, v, g, beta = (jnp.where(bad.reshape(bad.shape + (1,) * (x.ndim - 2)), jnp.nan, x).astype(x.dtype)
                          for x in (q, k, v, g, beta))
    return kda.chunk_kda(q, k, v, g, beta, initial_state=p.initial_state[:N] if with_h0 else None,
                         cu_seqlens=cu, segment_ids=seg, A_log=p.A_log if gate_args else None,
                         dt_bias=p.dt_bias if gate_args else None, **dict(static))
  return jax.jit(f)


def run_chunk(pool_name, idx, *, B=1, N=None, cu=None, seg=None, bad=None, h0=True, gate_args=False,
              **static):
  """chunk_kda on a view of a pool (idx: numpy token indices, row-major [B*T])."""
  static.setdefault("output_final_state", True)
  p = pool(pool_name)
  if not gate_args:
    p = p._replace(A_log=None, dt_bias=None)
  fn = _chunk_fn(B, N, h0, gate_args, tuple(sorted(static.items())))
  return fn(p, jnp.asarray(idx, jnp.int32), None if cu is None else jnp.asarray(cu, jnp.int32),
            None if seg is None else jnp.asarray(seg, jnp.int32), None if bad is None else jnp.asarray(bad))


@functools.lru_cache(maxsize=None)
def _recurrence_fn(with_h0, l2, gate):
  """The recurrence over a whole pool's worth of tokens (idx [POOL_T]) and POOL_N sequences: one
  compile per pool and option set; a case's trailing sequences are empty and its tokens end at cu[-1]."""
  def f(p, idx, cu):
    q, k, v, g, beta = (_view(x, idx, 1) for x in (p.q, p.k, p.v, p.g, p.beta))
    if l2:
      q, k = l2norm(q), l2norm(k)
    if gate is not None:           # (lower_bound, with_A_log, with_dt_bias)
      lb, with_A, with_b = gate
      g = cases.recurrence_gate(p._replace(g=g, A_log=p.A_log if with_A else None,
                                           dt_bias=p.dt_bias if with_b else None), lower_bound=lb)
    xs = [x.astype(jnp.float32) for x in (q, k, v, g, beta)]   # bf16 -> f32 is exact
    return recurrent_kda(*xs, initial_state=p.initial_state if with_h0 else None, output_final_state=True,
                         cu_seqlens=cu)
  return jax.jit(f)


def run_recurrence(pool_name, idx, *, B=1, N=None, cu=None, h0=True, l2=False, gate=None, p=None):
  """Ground truth for the tokens idx ([B*T]; B rows of T when cu is None) -> (o [B, T, ...], final [N, ...])."""
  idx = np.asarray(idx)
  n_tok = idx.shape[0]
  if cu is None:
    cu = np.arange(B + 1) * (n_tok // B)
  cu = np.asarray(cu)
  assert N == len(cu) - 1 <= POOL_N and n_tok <= POOL_T
  cu = np.concatenate([cu, np.full(POOL_N - N, cu[-1])])
  idx = np.concatenate([idx, np.zeros(POOL_T - n_tok, idx.dtype)])
  p = pool(pool_name) if p is None else p
  o, final = _recurrence_fn(h0, l2, gate)(p, jnp.asarray(idx, jnp.int32), jnp.asarray(cu, jnp.int32))
  o = np.asarray(o)[:, :n_tok]
  return o.reshape((B, n_tok // B) + o.shape[2:]), np.asarray(final)[:N]


def compare(name, got, want, dtype):
  """Checks o and final_state against the ground truth with TOL[dtype]; prints the figures."""
  tol = TOL[jnp.dtype(dtype)]
  (o, s), (wo, ws) = got, want
  assert o.dtype == jnp.dtype(dtype), (o.dtype, dtype)
  assert np.isfinite(np.asarray(o, np.float32)).all(), f"{name}: non-finite o"
  scale_o = float(np.max(np.abs(np.asarray(wo))))
  cases.report_close(f"{name} o", o, wo, atol=tol.o_atol * scale_o, rtol=tol.o_rtol)
  err_s = float("nan")
  if s is not None:
    assert s.dtype == jnp.float32 and np.isfinite(np.asarray(s)).all(), f"{name}: bad final_state"
    scale_s = float(np.max(np.abs(np.asarray(ws))))
    cases.report_close(f"{name} final_state", s, ws, atol=tol.s_atol * scale_s, rtol=tol.s_rtol)
    err_s = cases.rel_err(s, ws)
  print(f"\n[max rel err] {name}: o {cases.rel_err(o, wo):.2e}  final_state {err_s:.2e}")


def check_varlen(name, pool_name, lens, *, extra=0, h0=True, l2=False, gate=None, gate_args=False, **static):
  """The packed case lens (+ extra tokens of no sequence), chunk_kda vs the recurrence."""
  T, N = int(sum(lens)) + extra, len(lens)
  cu = np.concatenate([[0], np.cumsum(lens)])
  got = run_chunk(pool_name, np.arange(T), N=N, cu=cu, h0=h0, gate_args=gate_args,
                  use_qk_l2norm_in_kernel=l2, **static)
  want = run_recurrence(pool_name, np.arange(T), N=N, cu=cu, h0=h0, l2=l2, gate=gate)
  compare(name, got, want, pool(pool_name).v.dtype)
  return got


def boundaries(BT):
  return [1, BT - 1, BT, BT + 1, 2 * BT - 1, 2 * BT + 1]


# ---- sequence-length matrix ---------------------------------------------------------------------

# chunk sizes 16 and 32 also run in the tail, GVA and gate cases below
MATRIX = [(p, "f32", 64) for p in cases.SEQ_LENS] + [
    ("boundaries", "bf16", 64), ("with_empty", "bf16", 64), ("45_80_20", "bf16", 64),
    ("boundaries16", "f32", 16), ("boundaries32", "bf16", 32), ("100_50", "f32", 32),
]


@pytest.mark.parametrize("profile,dtype,BT", MATRIX, ids=[f"{p}-{d}-BT{b}" for p, d, b in MATRIX])
def test_seq_lens_matrix(profile, dtype, BT):
  lens = boundaries(int(profile[10:])) if profile[10:].isdigit() else cases.SEQ_LENS[profile]
  check_varlen(f"{profile}-{dtype}-BT{BT}", dtype, lens, chunk_size=BT)


# ---- tokens past cu_seqlens[-1] ------------------------------------------------------------------

TAILS = [("100_50", 37, "f32", 64), ("trailing_empty", 20, "bf16", 64), ("long_short", 13, "f32", 16)]


@pytest.mark.parametrize("profile,extra,dtype,BT", TAILS, ids=[f"{p}+{e}-{d}-BT{b}" for p, e, d, b in TAILS])
def test_poisoned_tail_is_never_read(profile, extra, dtype, BT):
  lens = cases.SEQ_LENS[profile]
  S, N = int(sum(lens)), len(lens)
  T = S + extra
  cu = np.concatenate([[0], np.cumsum(lens)])
  tail = (np.arange(T) >= S)[None]
  o, s = run_chunk(dtype, np.arange(T), N=N, cu=cu, bad=tail, chunk_size=BT)       # NaN there
  o_clean, s_clean = run_chunk(dtype, np.arange(T), N=N, cu=cu, bad=np.zeros_like(tail), chunk_size=BT)
  np.testing.assert_array_equal(np.asarray(o[0, S:], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_clean, np.float32))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s_clean))
  want = run_recurrence(dtype, np.arange(S), N=N, cu=cu)
  compare(f"{profile}+{extra}-{dtype}-BT{BT}", (o[:, :S], s), want, dt(dtype))
  # the poison is live: once the last sequence owns the tail, NaN reaches its outputs (same compile)
  o_own, _ = run_chunk(dtype, np.arange(T), N=N, cu=np.concatenate([cu[:-1], [T]]), bad=tail, chunk_size=BT)
  assert np.isnan(np.asarray(o_own[0, S:], np.float32)).all()


def dt(name):
  return {"f32": jnp.float32, "bf16": jnp.bfloat16}[name]


# ---- head dims ---------------------------------------------------------------------------------

HEAD_DIMS = [("K64", [100, 50]), ("K128", [70, 30]), ("K96", [40, 25]), ("K192", [20, 45]),
             ("K64-V96", [30, 50])]   # K != V catches a transposed state


@pytest.mark.parametrize("pool_name,lens", HEAD_DIMS, ids=[c[0] for c in HEAD_DIMS])
def test_head_dims(pool_name, lens):
  check_varlen(pool_name, pool_name, lens)


# ---- options -----------------------------------------------------------------------------------

def test_without_initial_state():
  check_varlen("no_h0", "f32", cases.SEQ_LENS["45_80_20"], h0=False)


def test_final_state_only_when_requested():
  lens = cases.SEQ_LENS["45_80_20"]
  cu = np.concatenate([[0], np.cumsum(lens)])
  idx = np.arange(sum(lens))
  o, s = run_chunk("f32", idx, N=3, cu=cu, output_final_state=False)
  assert s is None
  want_o, _ = run_recurrence("f32", idx, N=3, cu=cu)
  compare("no_final_state", (o, None), (want_o, None), jnp.float32)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_qk_l2norm_in_kernel(dtype):
  check_varlen(f"l2norm-{dtype}", f"l2-{dtype}", cases.SEQ_LENS["45_80_20"], l2=True)


def test_recurrence_gate_is_the_api_formula():
  """tests.cases.recurrence_gate (the recurrence's gate below) against docs/api.md, in numpy."""
  inp = pool("raw")
  HV, K = inp.g.shape[2:]
  g = np.asarray(inp.g, np.float64)[0]
  x = g + np.asarray(inp.dt_bias, np.float64).reshape(HV, K)
  a = np.exp(np.asarray(inp.A_log, np.float64))[:, None]
  sigmoid = lambda y: 1.0 / (1.0 + np.exp(-y))
  for lb, want in ((None, -a * np.logaddexp(0.0, x)), (-3.0, -3.0 * sigmoid(a * x))):
    got = cases.recurrence_gate(inp, lower_bound=lb)[0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  got = cases.recurrence_gate(inp._replace(A_log=None, dt_bias=None), lower_bound=-2.0)[0]
  np.testing.assert_allclose(np.asarray(got), -2.0 * sigmoid(g), rtol=1e-5, atol=1e-6)


GATES = [  # (name, lower_bound, with A_log, with dt_bias, chunk_size)
    ("softplus", None, True, True, 64),
    ("sigmoid", -3.0, True, True, 32),
    ("sigmoid_no_A_log", -2.0, False, False, 16),
]


@pytest.mark.parametrize("name,lower_bound,with_A,with_b,BT", GATES, ids=[c[0] for c in GATES])
def test_gate_in_kernel(name, lower_bound, with_A, with_b, BT):
  # partial last chunks everywhere: the padding gates must be neutralised
  lens = cases.SEQ_LENS["45_80_20"]
  T, N = sum(lens), len(lens)
  cu = np.concatenate([[0], np.cumsum(lens)])
  p = pool("raw")
  got = _gate_chunk(with_A, with_b, lower_bound, BT)(p, jnp.asarray(np.arange(T)), jnp.asarray(cu))
  want = run_recurrence("raw", np.arange(T), N=N, cu=cu, gate=(lower_bound, with_A, with_b))
  compare(f"gate-{name}-BT{BT}", got, want, jnp.float32)


@functools.lru_cache(maxsize=None)
def _gate_chunk(with_A, with_b, lower_bound, BT, safe_gate=False):
  def f(p, idx, cu):
    q, k, v, g, beta = (_view(x, idx, 1) for x in (p.q, p.k, p.v, p.g, p.beta))
    return kda.chunk_kda(q, k, v, g, beta, initial_state=p.initial_state[:cu.shape[0] - 1],
                         cu_seqlens=cu, use_gate_in_kernel=True, A_log=p.A_log if with_A else None,
                         dt_bias=p.dt_bias if with_b else None, lower_bound=lower_bound,
                         safe_gate=safe_gate, chunk_size=BT, output_final_state=True)
  return jax.jit(f)


def test_safe_gate_strong_given():
  """Gates in [-5, -4.95] per token over whole 64-token chunks (cumsum down to -320: exp underflows)."""
  o, s = check_varlen("safe_gate_strong-given", "strong", [128, 64, 100], safe_gate=True, lower_bound=-5.0)
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()


def test_safe_gate_strong_in_kernel():
  """Raw gates far on the sigmoid's flat side: g_act ~ lower_bound = -5 on every token."""
  lens = [128, 64, 100]
  T, N = sum(lens), len(lens)
  cu = np.concatenate([[0], np.cumsum(lens)])
  p = pool("raw")
  p = p._replace(g=jnp.abs(p.g) + 12.0)
  assert float(jnp.max(cases.recurrence_gate(p, lower_bound=-5.0))) < -4.9
  o, s = _gate_chunk(True, True, -5.0, 64, safe_gate=True)(p, jnp.asarray(np.arange(T)), jnp.asarray(cu))
  want = run_recurrence("raw", np.arange(T), N=N, cu=cu, gate=(-5.0, True, True), p=p)
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
  compare("safe_gate_strong-in_kernel", (o, s), want, jnp.float32)


def test_gva():
  check_varlen("gva-H2-HV4-BT32", "gva", cases.SEQ_LENS["45_80_20"], chunk_size=32)


def test_fixed_length_batch():
  B, T = 3, 70
  idx = np.arange(B * T)
  o, s = run_chunk("f32", idx, B=B, N=B)
  assert o.shape == (3, 70, 2, 32) and s.shape == (3, 2, 32, 32)
  compare("fixed_B3_T70", (o, s), run_recurrence("f32", idx, B=B, N=B), jnp.float32)


# ---- segment_ids -------------------------------------------------------------------------------

# Two rows of 96 tokens: padding between and after runs, adjacent different ids, the same id
# split by padding (two sequences), a row starting with padding.
ROWS = [[(1, 30), (0, 5), (2, 40), (0, 21)],
        [(0, 3), (3, 50), (4, 20), (0, 4), (4, 9), (0, 10)]]
SEG = np.stack([np.concatenate([np.full(n, i) for i, n in row]) for row in ROWS]).astype(np.int32)
OWNED = np.flatnonzero(SEG.reshape(-1) > 0)                 # packed position of every real token
RUN_LENS = [n for row in ROWS for i, n in row if i]          # 30, 40, 50, 20, 9
PACKED_CU = np.concatenate([[0], np.cumsum(RUN_LENS)])


def test_segment_ids_equal_cu_seqlens():
  N = len(RUN_LENS)
  o, s = run_chunk("f32", np.arange(SEG.size), B=2, N=N, seg=SEG, bad=SEG == 0, num_segments=N)
  assert o.shape == (2, 96, 2, 32) and s.shape == (N, 2, 32, 32)
  o_flat = np.asarray(o).reshape(1, SEG.size, 2, 32)
  np.testing.assert_array_equal(o_flat[0, SEG.reshape(-1) == 0], 0.0)     # padding tokens
  o_runs = o_flat[:, OWNED]
  compare("segment_ids", (o_runs, s), run_recurrence("f32", OWNED, N=N, cu=PACKED_CU), jnp.float32)
  o_cu, s_cu = run_chunk("f32", OWNED, N=N, cu=PACKED_CU)                   # the same sequences, packed
  cases.report_close("segment_ids vs cu_seqlens o", o_runs, o_cu, atol=1e-6, rtol=1e-6)
  cases.report_close("segment_ids vs cu_seqlens final_state", s, s_cu, atol=1e-6, rtol=1e-6)


def test_segment_ids_spare_slots_and_concrete_ids():
  N = len(RUN_LENS)
  # traced segment_ids and two spare slots: those get zero final states
  o, s = run_chunk("f32", np.arange(SEG.size), B=2, N=N + 2, seg=SEG, bad=SEG == 0, h0=False,
                   num_segments=N + 2)
  assert s.shape == (N + 2, 2, 32, 32)
  np.testing.assert_array_equal(np.asarray(s[N:]), 0.0)
  want_o, want_s = run_recurrence("f32", OWNED, N=N, cu=PACKED_CU, h0=False)
  compare("segment_ids_spare_slots", (np.asarray(o).reshape(1, SEG.size, 2, 32)[:, OWNED], s[:N]),
          (want_o, want_s), jnp.float32)
  # concrete segment_ids (a constant of the traced function): N is counted from the ids
  seg = jnp.asarray(SEG)
  f = jax.jit(lambda p: kda.chunk_kda(*(_view(x, jnp.arange(SEG.size), 2) for x in (p.q, p.k, p.v, p.g, p.beta)),
                                      segment_ids=seg, output_final_state=True))
  o2, s2 = f(pool("f32"))
  assert s2.shape == (N, 2, 32, 32)
  owned = SEG.reshape(-1) > 0
  np.testing.assert_allclose(np.asarray(o2).reshape(SEG.size, 2, 32)[owned],
                             np.asarray(o).reshape(SEG.size, 2, 32)[owned], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(s2), np.asarray(s[:N]), rtol=1e-6, atol=1e-6)


# ---- impl selection and jit ----------------------------------------------------------------------

@pytest.mark.skipif(jax.default_backend() != "cpu", reason="impl=None picks the kernels on a GPU")
def test_xla_impl_is_the_cpu_default():
  """impl=None on a CPU: each stage's xla implementation where it has one, else its reference (the
  same bits as impl="xla"); impl="reference" still runs every reference, and agrees with it."""
  names = kda.stages.names()
  want = {n: "xla" if kda.stages.get(n).xla is not None else "reference" for n in names}
  assert planning.default_impls(names, "cpu", "cpu") == want
  assert want["intra"] == want["bwd_intra"] == "xla"
  lens = cases.SEQ_LENS["30_50"]
  cu, idx = np.concatenate([[0], np.cumsum(lens)]), np.arange(sum(lens))
  o, s = run_chunk("f32", idx, N=2, cu=cu)
  o_xla, s_xla = run_chunk("f32", idx, N=2, cu=cu, impl="xla")
  np.testing.assert_array_equal(np.asarray(o), np.asarray(o_xla))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s_xla))
  o_ref, s_ref = run_chunk("f32", idx, N=2, cu=cu, impl="reference")
  compare("xla vs reference", (o, s), (o_ref, s_ref), jnp.float32)


def test_jit_traced_cu_seqlens_compiles_once():
  traces = []

  @jax.jit
  def f(p, cu):
    traces.append(1)                              # a python side effect: runs once per trace
    q, k, v, g, beta = (x[:, :80] for x in (p.q, p.k, p.v, p.g, p.beta))
    return kda.chunk_kda(q, k, v, g, beta, initial_state=p.initial_state[:2], cu_seqlens=cu,
                         output_final_state=True)

  for lens in ([30, 50], [71, 9]):                 # same N and T, different boundaries
    cu = np.concatenate([[0], np.cumsum(lens)])
    got = f(pool("f32"), jnp.asarray(cu, jnp.int32))
    compare(f"jit_cu_{lens[0]}_{lens[1]}", got, run_recurrence("f32", np.arange(80), N=2, cu=cu), jnp.float32)
  assert len(traces) == 1 and f._cache_size() == 1


@pytest.mark.parametrize("how", ["cu_seqlens", "segment_ids"])
def test_no_sequences_gives_zero_output_and_empty_state(how):
  inp = cases.make_inputs(3, B=1, T=40, H=1, K=16, V=16, initial_state=False)
  varlen = (dict(cu_seqlens=jnp.zeros((1,), jnp.int32)) if how == "cu_seqlens"
            else dict(segment_ids=jnp.zeros((1, 40), jnp.int32)))
  f = lambda q: kda.chunk_kda(q, inp.k, inp.v, inp.g, inp.beta, output_final_state=True, **varlen)
  o, s = f(inp.q)
  assert o.shape == inp.v.shape and s.shape == (0, 1, 16, 16)
  assert float(jnp.max(jnp.abs(o))) == 0.0
  dq = jax.grad(lambda q: jnp.sum(f(q)[0]))(inp.q)
  assert float(jnp.max(jnp.abs(dq))) == 0.0


def test_numpy_scale_is_accepted():
  inp = cases.make_inputs(4, B=1, T=40, H=1, K=16, V=16, initial_state=False)
  o_np, _ = kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=np.float32(0.3))
  o_py, _ = kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=0.3)
  np.testing.assert_array_equal(np.asarray(o_np), np.asarray(o_py))


# -- the fused group PACKED (align / unalign folded into the Mosaic GPU kernels) -----------------

def _packed_case(D=64):
  """bf16, GVA (H=1, HV=2), K = V = D, raw gates in kernel with lower_bound, l2norm, initial states,
  sequences of 37, 0, 64, 65, 1 tokens and 33 tokens after the last one holding NaN."""
  r = [np.random.default_rng(s) for s in range(8)]
  T, H, HV, K, V = 200, 1, 2, D, D
  lens = [37, 0, 64, 65, 1]
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  none = (np.arange(T) >= cu[-1])[None, :, None, None]
  bf = lambda x: jnp.asarray(np.where(none[..., :x.ndim - 2] if x.ndim == 3 else none, np.nan, x), jnp.bfloat16)
  q, k = bf(r[0].standard_normal((1, T, H, K))), bf(r[1].standard_normal((1, T, H, K)))
  v = bf(r[2].standard_normal((1, T, HV, V)))
  g = jnp.asarray(r[3].standard_normal((1, T, HV, K)), jnp.float32)
  beta = jnp.asarray(np.where(none[..., 0], np.nan, r[4].uniform(0.1, 0.9, (1, T, HV))), jnp.bfloat16)
  h0 = jnp.asarray(r[5].standard_normal((len(lens), HV, K, V)) * 0.3, jnp.float32)
  A_log = jnp.asarray(r[6].uniform(-1, 1, (HV,)), jnp.float32)
  dt_bias = jnp.asarray(r[7].standard_normal(HV * K) * 0.5, jnp.float32)
  kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=jnp.asarray(cu), use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)
  return (q, k, v, g, beta), kw


def test_packed_group_runs_and_equals_the_aligned_kernels(monkeypatch):
  """impl="mosaic_gpu" (simulator): the forward runs as the packed group, equal to the same kernels
  on the aligned layout (packed_forward off) up to float32 rounding, with o exactly 0 at the
  tokens no sequence owns (NaN there never leaks), and close to the recurrence."""
  x, kw = _packed_case()
  calls = []
  real = packed_forward_mgpu.apply
  monkeypatch.setattr(packed_forward_mgpu, "apply", lambda *a, **k: calls.append(1) or real(*a, **k))
  o, ht = jax.jit(lambda x: kda.chunk_kda(*x, **kw, impl="mosaic_gpu"))(x)
  assert calls
  aligned = {"pipeline": planning.PipelineConfig(packed=False)}
  o_al, ht_al = jax.jit(lambda x: kda.chunk_kda(*x, **kw, impl="mosaic_gpu", config=aligned))(x)
  assert len(calls) == 1
  f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
  o, o_al, ht, ht_al = map(f32, (o, o_al, ht, ht_al))
  end = int(kw["cu_seqlens"][-1])
  assert np.isfinite(o).all() and np.all(o[:, end:] == 0)
  # o is bf16: an entry may round to the neighbouring bf16 value where float32 rounding differs
  assert np.abs(o - o_al).max() <= 2 ** -8 * np.abs(o_al).max()
  assert np.abs(ht - ht_al).max() <= 1e-5 * np.abs(ht_al).max()
  from kda.stages.gate import activate
  q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in x)
  ga = activate(g, kw["A_log"], kw["dt_bias"], use_gate_in_kernel=True, lower_bound=kw["lower_bound"])
  want, want_ht = recurrent_kda(l2norm(q), l2norm(k), v, ga, beta, initial_state=kw["initial_state"],
                                output_final_state=True, cu_seqlens=kw["cu_seqlens"])
  want, want_ht = f32(want), f32(want_ht)
  assert np.abs(o[:, :end] - want[:, :end]).max() <= 1e-2 * np.abs(want[:, :end]).max()
  assert np.abs(ht - want_ht).max() <= 1e-2 * np.abs(want_ht).max()


def test_packed_group_declines_what_its_kernels_refuse():
  """float32 inputs (intra's predicate refuses them), a stage on another backend, or chunk 32:
  the group packed_forward does not run and the forward runs the stages."""
  from kda import padding
  (q, k, v, g, beta), kw = _packed_case()
  layout = padding.layout_from_cu_seqlens(kw["cu_seqlens"], q.shape[1], 64)
  args = (kw["initial_state"], kw["A_log"], kw["dt_bias"])
  plan = lambda **a: planning.make_plan(scale=0.125, chunk_size=64, use_gate_in_kernel=True, lower_bound=-5.0, **a)
  f32 = lambda a: a.astype(jnp.float32)
  group = lambda p, l, *x: p.group_backend("packed_forward", p, l, *x, *args)
  assert group(plan(impl="mosaic_gpu"), layout, q, k, v, g, beta) == "mosaic_gpu"
  assert group(plan(impl="mosaic_gpu"), layout, f32(q), f32(k), f32(v), g, beta) is None
  mixed = plan(impl={"gate": "mosaic_gpu", "intra": "pallas", "state": "mosaic_gpu", "output": "mosaic_gpu"})
  assert group(mixed, layout, q, k, v, g, beta) is None
  l32 = padding.layout_from_cu_seqlens(kw["cu_seqlens"], q.shape[1], 32)
  p32 = planning.make_plan(scale=0.125, chunk_size=32, use_gate_in_kernel=True, lower_bound=-5.0, impl="mosaic_gpu")
  assert group(p32, l32, q, k, v, g, beta) is None


def test_packed_backward_equals_the_aligned_one(monkeypatch):
  """impl="mosaic_gpu" (simulator), the whole gradient: with the packed backward (g kept packed: S0's
  gate kernel reads it there, S5 reads it and stores dg there; S3 stores dv, S4 dq and dk packed)
  every gradient is bit for bit the one with g aligned and the gradients unaligned in XLA
  (packed_backward_rows off); every gradient exactly 0 at tokens of no sequence, though the
  inputs and the cotangent of o (random elsewhere) are NaN there (l2norm's backward included). The
  packed forward's o (the same call) is 0 there and close to the recurrence."""
  x, kw = _packed_case()
  calls = []
  real = packed_backward_mgpu.apply
  monkeypatch.setattr(packed_backward_mgpu, "apply", lambda *a, **k: calls.append(1) or real(*a, **k))
  end = int(kw["cu_seqlens"][-1])
  wo = np.random.default_rng(9).standard_normal(x[2].shape)
  wo = jnp.asarray(np.where(np.arange(wo.shape[1])[None, :, None, None] < end, wo, np.nan), jnp.float32)

  def grads(**config):
    def loss(x):
      o, ht = kda.chunk_kda(*x, **kw, impl="mosaic_gpu", config=config or None)
      return jnp.sum(o.astype(jnp.float32) * wo) + 0.5 * jnp.sum(ht), (o, ht)
    return jax.jit(jax.grad(loss, has_aux=True))(x)

  got, (o, ht) = grads()
  assert calls
  want, _ = grads(pipeline=planning.PipelineConfig(packed=False))
  assert len(calls) == 1
  for name, a, b in zip("q k v g beta".split(), got, want):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    assert np.isfinite(a).all(), name
    np.testing.assert_array_equal(a, b, name)
    assert np.all(a[:, end:] == 0) and np.abs(a[:, :end]).max() > 0, name
  from kda.stages.gate import activate
  f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
  q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in x)
  ga = activate(g, kw["A_log"], kw["dt_bias"], use_gate_in_kernel=True, lower_bound=kw["lower_bound"])
  want_o, want_ht = recurrent_kda(l2norm(q), l2norm(k), v, ga, beta, initial_state=kw["initial_state"],
                                  output_final_state=True, cu_seqlens=kw["cu_seqlens"])
  o, want_o = f32(o), f32(want_o)
  assert np.isfinite(o).all() and np.all(o[:, end:] == 0)
  assert np.abs(o[:, :end] - want_o[:, :end]).max() <= 1e-2 * np.abs(want_o[:, :end]).max()
  assert np.abs(f32(ht) - f32(want_ht)).max() <= 1e-2 * np.abs(f32(want_ht)).max()


def _pairs_grads(monkeypatch, **config):
  """K = V = 128, impl="mosaic_gpu" (simulator): jax.grad of _packed_case(128)'s sum(o) and the
  `pairs` and `defer_qg` keywords each of S2's, S3's and S4's kernels got."""
  from kda.stages.bwd_dh import mosaic_gpu as mgd
  from kda.stages.bwd_intra import mosaic_gpu as mgi
  from kda.stages.bwd_wy import mosaic_gpu as mgw
  x, kw = _packed_case(128)
  seen = []
  for mod in (mgd, mgw, mgi):
    real = mod.apply
    monkeypatch.setattr(mod, "apply", lambda *a, _real=real, config=None, **k: seen.append(
        (k.get("pairs"), k.get("defer_qg"))) or _real(*a, config=config, **k))   # config named: the stage passes it
  loss = lambda x: jnp.sum(kda.chunk_kda(*x, **kw, impl="mosaic_gpu", config=config or None)[0].astype(jnp.float32))
  return jax.jit(jax.grad(loss))(x), seen, x, kw


def test_packed_backward_pairs_at_128(monkeypatch):
  """K = V = 128, impl="mosaic_gpu" (simulator): S2 stores dqg, dkg as pairs over h and dh and S3, S4
  take them (pairs=True reaches the three kernels); the packed backward's gradients are 0 at tokens
  of no sequence and within bf16 rounding of the reference's."""
  got, seen, x, kw = _pairs_grads(monkeypatch)
  assert seen == [(True, None)] * 3, seen
  ref = jax.jit(jax.grad(lambda x: jnp.sum(kda.chunk_kda(*x, **kw, impl="reference")[0].astype(jnp.float32))))(x)
  end = int(kw["cu_seqlens"][-1])
  for name, a, r in zip("q k v g beta".split(), got, ref):
    a, r = (np.asarray(t.astype(jnp.float32)) for t in (a, r))
    assert np.all(a[:, end:] == 0), name
    assert np.abs(a[:, :end] - r[:, :end]).max() <= 2e-2 * np.abs(r[:, :end]).max(), name


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "aligned"])
def test_defer_qg_reaches_s3_and_s4(monkeypatch, packed):
  """PipelineConfig(defer_qg=True), K = V = 128, traced only: S3's and S4's kernels get defer_qg and
  S4's dq argument is S2's dqg (pairs), in the packed and the aligned backward (the numbers:
  test_bwd_wy_mosaic's and test_bwd_intra_mosaic's defer_qg tests, and the large run's pipeline)."""
  from kda.stages.bwd_dh import mosaic_gpu as mgd
  from kda.stages.bwd_intra import mosaic_gpu as mgi
  from kda.stages.bwd_wy import mosaic_gpu as mgw
  x, kw = _packed_case(128)
  calls = {}

  def spy(name, real):
    def apply(*a, **k):
      out = real(*a, **k)
      calls[name] = (a, k, out)
      return out
    return apply
  for name, mod in (("s2", mgd), ("s3", mgw), ("s4", mgi)):
    monkeypatch.setattr(mod, "apply", spy(name, mod.apply))
  config = {"pipeline": planning.PipelineConfig(defer_qg=True, packed=packed)}
  loss = lambda x: jnp.sum(kda.chunk_kda(*x, **kw, impl="mosaic_gpu", config=config)[0].astype(jnp.float32))
  jax.jit(jax.grad(loss)).trace(x)
  assert calls["s3"][1].get("defer_qg") and calls["s4"][1].get("defer_qg"), calls.keys()
  assert calls["s3"][2].dq is None
  assert calls["s4"][0][7] is calls["s2"][2].dqg


def test_keep_pairs_turns_them_back_where_the_kernel_does_not_run():
  """kda.steps.keep_pairs: S4 on the reference gets S3's pairs (or slab pairs) back in float32 (hi +
  lo) and no `pairs` keyword; S3 on its kernel keeps them."""
  from kda._mosaic_gpu import from_pairs, to_pairs
  from kda.steps import keep_pairs
  Ta, HV, K, BT = 128, 1, 128, 64
  r = np.random.default_rng(0)
  f32 = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  bf = lambda *s: f32(*s).astype(jnp.bfloat16)
  cu = jnp.asarray([0, Ta], jnp.int32)
  plan = planning.make_plan(scale=K ** -0.5, chunk_size=BT, impl={"bwd_wy": "mosaic_gpu", "bwd_intra": "reference"},
                            dtype="bfloat16")
  pq, pk = to_pairs(f32(1, Ta, HV, K)), to_pairs(f32(1, Ta, HV, K))
  it = (bf(1, Ta, HV, K), bf(1, Ta, HV, K), f32(1, Ta, HV), f32(1, Ta, HV, K), f32(1, Ta, HV, K),
        f32(1, Ta, HV, BT), f32(1, Ta, HV, BT), pq, pk, f32(1, Ta, HV), f32(1, Ta, HV, K), cu)
  pairs, args = keep_pairs(plan, "bwd_intra", it, dict(pairs=True))
  assert pairs == {} and args[:7] == it[:7] and args[9:] == it[9:]
  np.testing.assert_array_equal(np.asarray(args[7]), np.asarray(from_pairs(pq)))
  np.testing.assert_array_equal(np.asarray(args[8]), np.asarray(from_pairs(pk)))
  _, args = keep_pairs(plan, "bwd_intra", it, dict(pairs="slabs"))     # bwd_wy's terms kernel's slab pairs
  np.testing.assert_array_equal(np.asarray(args[7]), np.asarray(from_pairs(pq, slabs=True)))
  wy = (bf(1, Ta, HV, K), bf(1, Ta, HV, K), bf(1, Ta, HV, K), f32(1, Ta, HV), f32(1, Ta, HV, K), f32(1, Ta, HV, K),
        bf(1, Ta, HV, BT), pq, pk, f32(1, Ta, HV, K), bf(1, Ta, HV, K), f32(1, Ta // BT, HV, K), cu)
  assert keep_pairs(plan, "bwd_wy", wy, dict(pairs=True), dv_dtype=jnp.bfloat16) == (dict(pairs=True), wy)


def test_defer_qg_where_both_kernels_run():
  """kda.steps.defer_qg_kw with PipelineConfig's defer_qg on: S3's kernel running and S4's taking
  the call (dq given as S2's dqg pairs) -> defer_qg; not where S3 runs elsewhere or S4 runs the
  reference; nothing with defer_qg off (the default)."""
  from kda.stages.bwd_dh import Out as Terms
  from kda.steps import defer_qg_kw
  S = jax.ShapeDtypeStruct
  Ta, HV, K, BT = 128, 2, 128, 64
  f32, bf = (lambda *s: S(s, jnp.float32)), (lambda *s: S(s, jnp.bfloat16))
  pair = bf(1, Ta // BT, HV, 2 * BT, K)
  terms = Terms(None, bf(1, Ta, HV, K), pair, pair, f32(1, Ta, HV, K), f32(1, Ta // BT, HV, K))
  it = (bf(1, Ta, HV, K), bf(1, Ta, HV, K), f32(1, Ta, HV), (f32(1, Ta, HV, K), f32(1, Ta, HV, K)),
        f32(1, Ta, HV, BT), terms, S((3,), jnp.int32))
  plan = lambda impl="mosaic_gpu", **pc: planning.make_plan(
      scale=K ** -0.5, chunk_size=BT, impl=impl, dtype="bfloat16",
      config={"pipeline": planning.PipelineConfig(**pc)} if pc else None)
  assert defer_qg_kw(plan(defer_qg=True), True, *it, pairs=True) == dict(defer_qg=True)
  assert defer_qg_kw(plan(defer_qg=True), False, *it, pairs=True) == {}
  assert defer_qg_kw(plan({"bwd_intra": "reference", "bwd_wy": "mosaic_gpu"}, defer_qg=True), True, *it,
                     pairs=True) == {}
  assert defer_qg_kw(plan(), True, *it, pairs=True) == {}                  # off by default


@pytest.mark.parametrize("packed", [True, pytest.param(False, marks=pytest.mark.large)], ids=["packed", "aligned"])
def test_keep_forward_leaves_s0_only_the_state(monkeypatch, packed):
  """PipelineConfig(keep_forward=True), impl="mosaic_gpu" (simulator), K = V = 64: the backward forms
  h and v_new from the forward's gc, w, u, qg, kg (S0's gate and wy kernels are not called), its
  gradients are 0 at tokens of no sequence and within bf16 rounding of the reference's."""
  from kda.stages.bwd_recompute import mosaic_gpu as mgr
  from kda.stages.state import mosaic_gpu as mgs
  calls = []
  for name, mod in (("s0", mgr), ("state", mgs)):
    real = mod.apply
    monkeypatch.setattr(mod, "apply", lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
  x, kw = _packed_case()
  config = {"pipeline": planning.PipelineConfig(keep_forward=True, packed=packed)}

  def loss(x, impl, config=None):
    o, ht = kda.chunk_kda(*x, **kw, impl=impl, config=config)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht) / 8
  got = jax.jit(jax.grad(lambda x: loss(x, "mosaic_gpu", config)))(x)
  assert calls == ["state"], calls
  ref = jax.jit(jax.grad(lambda x: loss(x, "reference")))(x)
  end = int(kw["cu_seqlens"][-1])
  for name, a, r in zip("q k v g beta".split(), got, ref):
    a, r = (np.asarray(t.astype(jnp.float32)) for t in (a, r))
    assert np.all(a[:, end:] == 0), name
    assert np.abs(a[:, :end] - r[:, :end]).max() <= 2e-2 * np.abs(r[:, :end]).max(), name


@pytest.mark.large
def test_packed_backward_pairs_equal_the_aligned_ones(monkeypatch):
  """K = V = 128 (simulator): the aligned pipeline pairs S2-S4's terms too, and its gradients are
  the packed backward's bit for bit."""
  got, seen, _, _ = _pairs_grads(monkeypatch)
  assert seen == [(True, None), (True, None), (True, None)], seen       # defer_qg off by default
  want, seen, _, _ = _pairs_grads(monkeypatch, pipeline=planning.PipelineConfig(packed=False))
  assert seen == [(True, None), (True, None), (True, None)], seen
  for name, a, b in zip("q k v g beta".split(), got, want):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), name)
  got, _, _, _ = _pairs_grads(monkeypatch, pipeline=planning.PipelineConfig(defer_qg=True))
  want, seen, _, _ = _pairs_grads(monkeypatch, pipeline=planning.PipelineConfig(packed=False, defer_qg=True))
  assert seen == [(True, None), (True, True), (True, True)], seen
  for name, a, b in zip("q k v g beta".split(), got, want):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), name)


@pytest.mark.large
def test_split_s3_hands_s4_its_parts(monkeypatch):
  """K = V = 128 with S3's split kernel (simulator): the packed backward hands S4 dAkk's two slab
  parts (S4 adds them as it loads them: no summed copy), the aligned pipeline their XLA sum, and
  the gradients are bit for bit the same."""
  from kda.stages.bwd_intra import mosaic_gpu as mgi
  from kda.stages.bwd_wy import mosaic_gpu as mgw
  shapes = []
  real = mgi.apply
  monkeypatch.setattr(mgi, "apply", lambda *a, config=None, **k: shapes.append(a[6].shape)
                      or real(*a, config=config, **k))
  split = {"bwd_wy": mgw.Config(split=True)}
  got, _, _, _ = _pairs_grads(monkeypatch, **split)
  want, _, _, _ = _pairs_grads(monkeypatch, **split, pipeline=planning.PipelineConfig(packed=False))
  Ta = 256
  assert shapes == [(2, Ta, 2, 64), (1, Ta, 2, 64)], shapes
  for name, a, b in zip("q k v g beta".split(), got, want):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), name)


@pytest.mark.parametrize("K", [64, pytest.param(128, marks=pytest.mark.large)])   # 128: pairs (CI time)
def test_packed_backward_lowers_for_cuda(K):
  """The whole jax.grad with impl=None as on an H200 (the platform mocked), lowered for CUDA from the
  CPU: the packed backward's kernels (bwd_gate, bwd_wy and bwd_intra in their packed modes) are
  the ones called (at K = V = 128 with S2's pairs)."""
  import re
  from unittest import mock
  S = jax.ShapeDtypeStruct
  T, H = 256, 2
  bf = lambda *s: S(s, jnp.bfloat16)
  args = (bf(1, T, H, K), bf(1, T, H, K), bf(1, T, H, K), S((1, T, H, K), jnp.float32), bf(1, T, H))
  loss = lambda q, k, v, g, beta, cu: jnp.sum(kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)[0].astype(jnp.float32))
  with mock.patch("kda.plan.platform_of", lambda device=None: ("gpu", "sm90")):
    txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args, S((4,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
  names = set(re.findall(r"kda_[a-z_]+", txt))
  for want in ("kda_bwd_gate_packed", "kda_bwd_wy_packed", "kda_bwd_intra_packed", "kda_bwd_recompute_wy"):
    assert any(n.startswith(want) for n in names), (want, sorted(names))
  assert not any(n.startswith(("kda_bwd_gate_mosaic", "kda_bwd_wy_mosaic")) for n in names), sorted(names)


@pytest.mark.large
def test_packed_backward_with_segment_gaps_equals_the_aligned_one():
  """As test_packed_backward_equals_the_aligned_one with segment_ids: padding (id 0, NaN inputs)
  before the first sequence, between sequences and after the last, so the kernels zero interior
  gap pieces of the packed gradients too."""
  x, kw = _packed_case()
  ids = np.concatenate([np.zeros(3), np.full(34, 1), np.zeros(6), np.full(64, 2), np.full(65, 3), np.full(1, 4),
                        np.zeros(27)]).astype(np.int32)[None]
  pad = jnp.asarray(ids == 0)[..., None, None]
  x = tuple(jnp.where(pad if a.ndim == 4 else pad[..., 0], jnp.asarray(jnp.nan, a.dtype), jnp.nan_to_num(a, nan=0.5))
            for a in x)    # _packed_case's NaN tail holds real tokens here
  kw = dict(kw, segment_ids=jnp.asarray(ids))
  del kw["cu_seqlens"]

  def grads(config=None):
    loss = lambda x: jnp.sum(kda.chunk_kda(*x, **kw, impl="mosaic_gpu", config=config)[0].astype(jnp.float32))
    return jax.jit(jax.grad(loss))(x)

  got = grads()
  want = grads({"pipeline": planning.PipelineConfig(packed=False)})
  for name, a, b in zip("q k v g beta".split(), got, want):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    assert np.isfinite(a).all(), name
    np.testing.assert_array_equal(a, b, name)
    assert np.all(a[ids == 0] == 0) and np.abs(a[ids != 0]).max() > 0, name


@pytest.mark.parametrize("D", [64, pytest.param(128, marks=pytest.mark.large)])
def test_terms_in_s3(monkeypatch, D):
  """bwd_wy's Config(terms=True), K = V = D (simulator): the packed backward runs S2's walk alone and
  S3's terms kernel (S2's apply is not called), and the gradients (initial state's included) are 0
  at tokens of no sequence and within bf16 rounding of the default's (and, at 128, of the
  reference's)."""
  from kda.stages.bwd_dh import mosaic_gpu as mgd
  from kda.stages.bwd_wy import mosaic_gpu as mgw
  from kda.stages.bwd_wy.mosaic_gpu import fused
  x, kw = _packed_case(D)
  called = []
  for mod, name in ((mgd, "apply"), (mgd, "walk"), (fused, "apply")):
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=f"{mod.__name__}.{name}", **k: called.append(_n)
                        or _real(*a, **k))
  grads = lambda impl, config=None: jax.jit(jax.grad(lambda x, h0: jnp.sum(kda.chunk_kda(
      *x, **{**kw, "initial_state": h0}, impl=impl, config=config)[0].astype(jnp.float32)), argnums=(0, 1)))(
          x, kw["initial_state"])
  got = grads("mosaic_gpu", {"bwd_wy": mgw.Config(terms=True)})
  assert called == ["kda.stages.bwd_dh.mosaic_gpu.walk", "kda.stages.bwd_wy.mosaic_gpu.fused.apply"], called
  want = grads("mosaic_gpu")
  ref = grads("reference") if D == 128 else want            # the default's own check: test_grad (CI time)
  end = int(kw["cu_seqlens"][-1])
  for name, a, b, r in zip("q k v g beta h0".split(), (*got[0], got[1]), (*want[0], want[1]), (*ref[0], ref[1])):
    a, b, r = (np.asarray(t.astype(jnp.float32)) for t in (a, b, r))
    if name != "h0":
      assert np.all(a[:, end:] == 0), name
      a, b, r = a[:, :end], b[:, :end], r[:, :end]
    assert np.abs(a - r).max() <= 2e-2 * np.abs(r).max(), name
    assert np.abs(a - b).max() <= 2e-3 * np.abs(b).max(), name
