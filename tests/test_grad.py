"""Gradients of kda.chunk_kda (its custom VJP: the staged backward S0-S5) against jax.grad of
kda.reference.recurrent_kda, over the forward tests' matrix of lengths, dtypes, head dims, chunk
sizes and options; plus the padding guarantees of the backward and jit with traced cu_seqlens.

The loss is sum(o * Wo) + sum(final_state * Wh) with random Wo, Wh, so every output element sends a
distinct cotangent. Every call runs under jax.jit with cu_seqlens traced. Run
`python -m tests.test_grad` for the table of max relative errors (max |got - want| / max |want|) per
input and dtype.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest

from kda import api, padding
from kda import plan as planning
from kda.reference import recurrent_kda
from kda.stages.gate import activate
from tests import cases


class Case(NamedTuple):
  lens: tuple
  dtype: str = "f32"
  K: int = 32
  V: int = 32
  H: int = 2
  HV: int = 2
  BT: int = 64
  h0: bool = True
  gate: str = "plain"          # make_inputs' gate: "plain", "strong" or "raw" (use_gate_in_kernel)
  lower_bound: float | None = None
  safe_gate: bool = False
  l2norm: bool = False
  extra_T: int = 0             # tokens past cu_seqlens[-1], poisoned with NaN


CASES = {
    "boundaries-f32-BT64": Case((1, 63, 64, 65, 127, 129)),
    "trailing_empty+13nan-f32-BT32-noh0": Case((30, 50, 0, 0, 0), BT=32, h0=False, extra_T=13),
    "with_empty-gva-l2norm-f32-BT32": Case((17, 0, 40), H=1, HV=2, BT=32, l2norm=True),
    "45_80_20-bf16-BT64": Case((45, 80, 20), dtype="bf16"),
    "K96-V96-f32-BT32": Case((40, 25), K=96, V=96, H=1, HV=1, BT=32),
    "K192-V192-f32-BT64": Case((20, 45), K=192, V=192, H=1, HV=1),
    "strong-safe_gate-f32-BT64": Case((128, 64, 100), gate="strong", lower_bound=-5.0, safe_gate=True),
    "softplus-in-kernel+7nan-f32-BT32": Case((100, 50), BT=32, gate="raw", extra_T=7),
    "sigmoid-lb5-safe-in-kernel-gva-f32-BT64": Case((45, 80, 20), H=2, HV=4, gate="raw", lower_bound=-5.0,
                                                    safe_gate=True),
    "softplus-in-kernel-gva-l2norm-bf16-BT32": Case((17, 0, 40), dtype="bf16", H=1, HV=2, BT=32, gate="raw",
                                                    l2norm=True),
}


class Tol(NamedTuple):
  rtol: float   # elementwise, relative to |want|
  atol: float   # relative to max |want| of the tensor


# float32: the chunked backward reassociates the recurrence's sums (WY form, (I + Akk)^-1, chunk
# states) in float32 at HIGHEST precision; measured max rel err <= 2.0e-6 (dA_log; dg with gates of
# -5 per token 1.8e-6, since bwd_wy forms the gate gradient through kg and the decay as direct sums
# and bwd_intra leaves out the diagonal, instead of a reverse cumsum of terms that cancel: 3.1e-5).
# 1e-5 is the contract (docs/api.md) and keeps 5x; a wrong or missing term is O(1).
# bfloat16: both sides read the same bf16 inputs, compute in float32 and round each gradient to
# bf16; the l2norm backward also reads the bf16 cotangent of the normalised q, k (both sides) and
# scales it by 1/|q| (up to 5 here): measured max 5.8e-3 of the tensor's max (dk, l2norm case),
# <= 1.3e-5 without l2norm. atol 2e-2 of the max and rtol 2^-7 (two bf16 roundings).
TOL = {"f32": Tol(1e-5, 1e-5), "bf16": Tol(2.0 ** -7, 2e-2)}
# custom VJP vs autodiff of the same forward stages: the same algorithm in float32, different
# summation order; measured <= 4.4e-6 (dA_log, a sum over every token), <= 4e-7 elsewhere.
SAME_TOL = Tol(3e-5, 3e-5)

ERRORS: dict[str, dict[str, float]] = {}


def dtype_of(case):
  return {"f32": jnp.float32, "bf16": jnp.bfloat16}[case.dtype]


def inputs(case, seed=0):
  """(params to differentiate: dict, cu_seqlens, Wo, Wh)."""
  inp = cases.make_inputs(seed, lens=list(case.lens), H=case.H, HV=case.HV, K=case.K, V=case.V,
                          dtype=dtype_of(case), initial_state=True, gate=case.gate, extra_T=case.extra_T)
  q, k = inp.q, inp.k
  if case.l2norm:   # norms far from 1, so a skipped or wrong l2norm backward shows
    ks = jax.random.split(jax.random.PRNGKey(seed + 1000), 2)
    q = (q * jax.random.uniform(ks[0], q.shape[:3] + (1,), minval=0.2, maxval=4.0)).astype(q.dtype)
    k = (k * jax.random.uniform(ks[1], k.shape[:3] + (1,), minval=0.2, maxval=4.0)).astype(k.dtype)
  p = dict(q=q, k=k, v=inp.v, g=inp.g, beta=inp.beta)
  if case.h0:
    p["initial_state"] = inp.initial_state
  if case.gate == "raw":
    p["A_log"], p["dt_bias"] = inp.A_log, inp.dt_bias
  ks = jax.random.split(jax.random.PRNGKey(seed + 2000), 2)
  Wo = jax.random.normal(ks[0], inp.v.shape, jnp.float32)
  Wh = jax.random.normal(ks[1], (len(case.lens), case.HV, case.K, case.V), jnp.float32)
  return p, inp.cu_seqlens, Wo, Wh


def loss_value(o, ht, Wo, Wh):
  return jnp.sum(o.astype(jnp.float32) * Wo) + jnp.sum(ht * Wh)


@functools.lru_cache(maxsize=None)
def chunk_grad(case, backward="custom_vjp"):
  """jit(grad) of the loss through kda (chunk_kda_with: chunk_kda's own path for "custom_vjp")."""
  def loss(p, cu, Wo, Wh):
    o, ht = api.chunk_kda_with(p["q"], p["k"], p["v"], p["g"], p["beta"], backward=backward,
                               initial_state=p.get("initial_state"), output_final_state=True,
                               use_qk_l2norm_in_kernel=case.l2norm, use_gate_in_kernel=case.gate == "raw",
                               A_log=p.get("A_log"), dt_bias=p.get("dt_bias"), safe_gate=case.safe_gate,
                               lower_bound=case.lower_bound, cu_seqlens=cu, chunk_size=case.BT)
    return loss_value(o, ht, Wo, Wh)
  return jax.jit(jax.grad(loss))


def l2norm(x):
  """docs/api.md's definition, rounded back to x's dtype as the pipeline's inputs are."""
  xf = x.astype(jnp.float32)
  return (xf / jnp.sqrt(jnp.sum(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def recurrence_grad(case):
  """jit(grad) of the same loss through the recurrence, on the real tokens only (tokens past
  cu_seqlens[-1] are sliced off before any arithmetic, so their gradient is exactly 0)."""
  S = sum(case.lens)

  def loss(p, cu, Wo, Wh):
    x = {n: a[:, :S] if n not in ("initial_state", "A_log", "dt_bias") else a for n, a in p.items()}
    q, k = (l2norm(x["q"]), l2norm(x["k"])) if case.l2norm else (x["q"], x["k"])
    g = x["g"]
    if case.gate == "raw":
      g = activate(g, x["A_log"], x["dt_bias"], use_gate_in_kernel=True, lower_bound=case.lower_bound)
    f32 = lambda a: a.astype(jnp.float32)
    h0 = x.get("initial_state")
    o, ht = recurrent_kda(f32(q), f32(k), f32(x["v"]), f32(g), f32(x["beta"]), initial_state=h0,
                          output_final_state=True, cu_seqlens=cu)
    return loss_value(o.astype(x["v"].dtype), ht, Wo[:, :S], Wh)
  return jax.jit(jax.grad(loss))


def compare(name, got, want, tol, *, record=True):
  errs = {}
  for n in want:
    g, w = got[n], want[n]
    assert g.dtype == w.dtype, f"{name} d{n}: dtype {g.dtype} != {w.dtype}"
    assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name} d{n}: non-finite gradient"
    scale = float(np.max(np.abs(np.asarray(w, np.float32))))
    cases.report_close(f"{name} d{n}", g, w, atol=tol.atol * scale, rtol=tol.rtol)
    errs[n] = cases.rel_err(g, w)
  if record:
    ERRORS[name] = errs
  print(f"\n[max rel err] {name}: " + "  ".join(f"d{n} {e:.1e}" for n, e in errs.items()))
  return errs


def case_grads(name, seed=0):
  case = CASES[name]
  p, cu, Wo, Wh = inputs(case, seed)
  return case, p, cu, chunk_grad(case)(p, cu, Wo, Wh), recurrence_grad(case)(p, cu, Wo, Wh)


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_grad_matches_recurrence(name):
  case, p, cu, got, want = case_grads(name)
  compare(name, got, want, TOL[case.dtype])
  S = sum(case.lens)
  for n in ("q", "k", "v", "g", "beta"):   # tokens past cu_seqlens[-1] (NaN inputs): exactly 0
    assert np.all(np.asarray(got[n][:, S:], np.float32) == 0), f"d{n} is not 0 past cu_seqlens[-1]"


@pytest.mark.parametrize("name", ["trailing_empty+13nan-f32-BT32-noh0", "softplus-in-kernel+7nan-f32-BT32"])
def test_custom_vjp_matches_autodiff_of_the_forward_stages(name):
  case = CASES[name]
  p, cu, Wo, Wh = inputs(case)
  got = chunk_grad(case)(p, cu, Wo, Wh)
  want = chunk_grad(case, "autodiff")(p, cu, Wo, Wh)
  compare(f"{name} vs autodiff", got, want, SAME_TOL, record=False)


def test_padding_sequences_and_tail_do_not_change_the_gradient():
  """The same real data, once alone and once with two empty sequences appended and a NaN tail past
  cu_seqlens[-1]: real gradients are unchanged, the tail's are exactly 0, an empty sequence's dh0
  is its final-state cotangent."""
  base = Case((30, 50), BT=32)
  padded = base._replace(lens=(30, 50, 0, 0), extra_T=13)
  p, cu, Wo, Wh = inputs(padded, seed=3)
  S = 80
  p_base = {n: (a[:, :S] if n not in ("initial_state", "A_log", "dt_bias") else a[:2]) for n, a in p.items()}
  got_base = chunk_grad(base)(p_base, cu[:3], Wo[:, :S], Wh[:2])
  got = chunk_grad(padded)(p, cu, Wo, Wh)
  for n in ("q", "k", "v", "g", "beta"):
    np.testing.assert_array_equal(np.asarray(got[n][:, S:]), 0.0, err_msg=f"d{n} past cu_seqlens[-1]")
    cases.report_close(f"d{n}", got[n][:, :S], got_base[n], atol=1e-6 * float(jnp.max(jnp.abs(got_base[n]))),
                       rtol=1e-6)
  h = got["initial_state"]
  cases.report_close("dh0", h[:2], got_base["initial_state"], atol=1e-6 * float(jnp.max(jnp.abs(h[:2]))),
                     rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(h[2:]), np.asarray(Wh[2:]), err_msg="empty sequences' dh0 != dht")


def test_forward_saves_no_state_buffer():
  """The custom VJP keeps the inputs, the layout's int arrays and Aqk, Ainv [1, Ta, HV, BT] only:
  nothing of size NTa * K * V lives from the forward to the backward (S0 recomputes h)."""
  case = Case((30, 50, 0), K=64, V=64, BT=16)
  p, cu, _, _ = inputs(case)
  T = p["q"].shape[1]
  layout = padding.layout_from_cu_seqlens(cu, T, case.BT)
  plan = planning.make_plan(scale=case.K ** -0.5, chunk_size=case.BT)
  args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["initial_state"], None, None)
  ints = (layout.starts, layout.lens, layout.aligned_cu)
  _, res = jax.eval_shape(lambda ints, *a: api._staged_fwd(plan, (T, layout.Ta, case.BT), False, ints, *a, None),
                          ints, *args)
  shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(res))
  want = [tuple(x.shape) for x in jax.tree.leaves((ints, args))] + [(1, layout.Ta, case.HV, case.BT)] * 2
  assert shapes == sorted(want), f"residuals {shapes}, expected the inputs plus Aqk, Ainv: {sorted(want)}"


def _sub_jaxprs(param):
  if isinstance(param, jcore.ClosedJaxpr):
    yield param.jaxpr
  elif isinstance(param, jcore.Jaxpr):
    yield param
  elif isinstance(param, (tuple, list)):
    for x in param:
      yield from _sub_jaxprs(x)


def state_sized(jaxpr, size):
  """(primitive, shape) of every equation, nested ones included, that computes an array of `size`
  elements. Reshapes that keep the size are views, not buffers; a call (jit, cond, while) is not
  counted itself, its body is; a scan is (its stacked outputs are built by the scan)."""
  found = []
  for e in jaxpr.eqns:
    inner = [j for v in e.params.values() for j in _sub_jaxprs(v)]
    call = bool(inner) and e.primitive.name != "scan"
    ins = {int(np.prod(getattr(x.aval, "shape", ()))) for x in e.invars}
    view = e.primitive.name in ("reshape", "squeeze", "expand_dims", "broadcast_in_dim") and size in ins
    for x in e.outvars:
      if int(np.prod(getattr(x.aval, "shape", ()))) == size and not (call or view):
        found.append((e.primitive.name, tuple(x.aval.shape)))
    for j in inner:
      found += state_sized(j, size)
  return found


def test_backward_holds_one_state_buffer():
  """The backward computes one array of NTa * HV * K * V elements, S0's h (the scan of the state
  recurrence): S2 keeps the state cotangent one chunk at a time, so neither a per-chunk dh nor any
  product of h with it exists. Through jax.grad of chunk_kda with the references there are two: the
  forward's h (the output stage reads it, nothing saves it) and S0's; with the xla stages (the CPU
  default) the forward runs state and output as one scan (kda.fused.state_output_xla) and forms no
  h. The sizes are picked so that no other tensor (N * HV * K * V, T * HV * K, the xla stages' q and
  k stacked 2 * T * HV * K, pair decays [NTa, BT, BT, HV, K]) has that many elements."""
  case = Case((30, 50, 0), K=64, V=48, BT=16)
  p, cu, Wo, Wh = inputs(case)
  T = p["q"].shape[1]
  layout = padding.layout_from_cu_seqlens(cu, T, case.BT)
  NTa = layout.Ta // case.BT
  size = NTa * case.HV * case.K * case.V
  assert NTa != len(case.lens) and case.V not in (case.BT, 2 * case.BT)
  plan = planning.make_plan(scale=case.K ** -0.5, chunk_size=case.BT)
  args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["initial_state"], None, None)
  ints = (layout.starts, layout.lens, layout.aligned_cu)
  static = (T, layout.Ta, case.BT)
  cts, res = jax.eval_shape(lambda ints, *a: api._staged_fwd(plan, static, False, ints, *a, None), ints, *args)
  bwd = jax.make_jaxpr(lambda res, cts: api._staged_bwd(plan, static, False, res, cts))(res, cts)
  one = [("scan", (NTa, case.HV, case.K, case.V))]
  assert state_sized(bwd.jaxpr, size) == one, f"backward: {state_sized(bwd.jaxpr, size)}, expected {one}"

  def loss(p, impl):
    o, ht = api.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                          output_final_state=True, cu_seqlens=cu, chunk_size=case.BT, impl=impl)
    return loss_value(o, ht, Wo, Wh)

  for impl, want in (("reference", one * 2), ("xla", one)):
    grad = jax.make_jaxpr(jax.grad(functools.partial(loss, impl=impl)))(p)
    assert state_sized(grad.jaxpr, size) == want, f"jax.grad, {impl}: {state_sized(grad.jaxpr, size)}"


def test_jit_grad_with_traced_cu_seqlens_compiles_once():
  traces = []

  def loss(p, cu, Wo, Wh):
    traces.append(1)
    o, ht = api.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                          output_final_state=True, cu_seqlens=cu, chunk_size=32)
    return loss_value(o, ht, Wo, Wh)

  case = Case((30, 50), BT=32)
  p, cu, Wo, Wh = inputs(case, seed=4)
  f = jax.jit(jax.grad(loss))
  other = jnp.asarray([0, 64, 80], jnp.int32)            # the same N = 2, other lengths
  got = [f(p, c, Wo, Wh) for c in (cu, other)]
  assert len(traces) == 1, f"traced {len(traces)} times for two cu_seqlens of the same N"
  for c, gr in zip((cu, other), got):
    want = recurrence_grad(case)(p, c, Wo, Wh)   # the same S = 80 real tokens: one compile
    compare(f"traced cu {list(np.asarray(c))}", gr, want, TOL["f32"], record=False)


def test_segment_ids_padding_tokens_get_zero_gradient():
  """Two rows with padding (id 0) tokens between and after runs: the gradient equals the recurrence's
  on the squeezed sequences and is exactly 0 at id-0 tokens."""
  rows = [[1] * 25 + [0] * 7 + [2] * 8, [0] * 3 + [3] * 30 + [0] * 7]
  seg = jnp.asarray(rows, jnp.int32)
  B, T = seg.shape
  case = Case((25, 8, 30), BT=32)
  inp = cases.make_inputs(5, B=B, T=T, H=2, K=32, V=32)
  p = dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta,
           initial_state=0.5 * jax.random.normal(jax.random.PRNGKey(55), (3, 2, 32, 32)))
  ks = jax.random.split(jax.random.PRNGKey(56), 2)
  Wo = jax.random.normal(ks[0], (B, T, 2, 32))
  Wh = jax.random.normal(ks[1], (3, 2, 32, 32))

  def loss(p):
    o, ht = api.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                          output_final_state=True, segment_ids=seg, chunk_size=32)
    return loss_value(o, ht, Wo, Wh)

  idx = np.flatnonzero(np.asarray(seg).reshape(-1) > 0)    # real tokens, in order

  def squeezed(p, cu, Wo_s, Wh):
    pack = lambda a: a.reshape((1, B * T) + a.shape[2:])[:, idx]
    x = {n: (pack(a) if n != "initial_state" else a) for n, a in p.items()}
    o, ht = recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                          output_final_state=True, cu_seqlens=cu)
    return loss_value(o, ht, Wo_s, Wh)

  got = jax.jit(jax.grad(loss))(p)
  Wo_s = Wo.reshape((1, B * T) + Wo.shape[2:])[:, idx]
  want = jax.jit(jax.grad(squeezed))(p, cases.cu_from_lens(case.lens), Wo_s, Wh)
  compare("segment_ids", got, want, TOL["f32"], record=False)
  pad = np.asarray(seg) == 0
  for n in ("q", "k", "v", "g", "beta"):
    assert np.all(np.asarray(got[n])[pad] == 0), f"d{n} is not 0 at segment id 0"


def test_narrow_heads_run_the_s0_kernels_with_the_xla_gate():
  """impl="mosaic_gpu" (simulator), H = 1, K = V = 64, bf16: the gate kernels refuse HV * K = 64, so
  S0 takes gc from the XLA gate and still runs its wy and state kernels, and S1, S2 theirs on its
  bf16 record; the gradient matches the recurrence's within the bf16 tolerance."""
  case = Case((3, 70, 1), dtype="bf16", K=64, V=64, H=1, HV=1)
  p, cu, Wo, Wh = inputs(case, seed=5)

  def loss(p, cu, Wo, Wh):
    o, ht = api.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                          output_final_state=True, cu_seqlens=cu, impl="mosaic_gpu")
    return loss_value(o, ht, Wo, Wh)

  with planning.recording() as log:
    got = jax.jit(jax.grad(loss))(p, cu, Wo, Wh)
  runs = {c.name: c.backend for c in log}
  assert runs["gate"] == "xla" and runs["bwd_recompute"] == runs["bwd_dav"] == runs["bwd_dh"] == "mosaic_gpu", runs
  compare("narrow S0, K64 bf16", got, recurrence_grad(case)(p, cu, Wo, Wh), TOL["bf16"], record=False)


if __name__ == "__main__":
  for name in CASES:
    case, p, cu, got, want = case_grads(name)
    compare(name, got, want, TOL[case.dtype])
  names = ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"]
  print("\nmax relative error (max |got - want| / max |want|) of each gradient vs the recurrence\n")
  print(f"{'case':44s}" + "".join(f"{'d' + n[:7]:>10s}" for n in names))
  for name, errs in ERRORS.items():
    print(f"{name:44s}" + "".join(f"{errs[n]:10.1e}" if n in errs else f"{'-':>10s}" for n in names))
  for dt in ("f32", "bf16"):
    worst = {n: max((e[n] for c, e in ERRORS.items() if CASES[c].dtype == dt and n in e), default=None)
             for n in names}
    print(f"{'worst ' + dt:44s}" + "".join(f"{w:10.1e}" if w is not None else f"{'-':>10s}"
                                          for w in worst.values()))
