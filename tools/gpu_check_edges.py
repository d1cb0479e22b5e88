"""python -m tools.gpu_check_edges: head dims up to 256, float16, NaN confinement, states (device).

Three parts (--parts; default dims,nan):
  dims  chunk_kda forward + backward (impl=None) against the token recurrence for K, V in
        {(256, 256), (128, 256), (256, 128)}, bf16 and f16, varlen (cu_seqlens [0, 100, 300, 1200,
        3000, 4096]) and fixed length (B = 2), raw gates with safe_gate and lower_bound -5 (the varlen
        case flash-linear-attention's tests run at K = V = 256): each output's error ratio
        sqrt(mean(d^2)) / sqrt(mean(ref^2)) (FLA's measure) against --tol, and which backend each
        stage ran.
  nan   one non-finite value in one input (q, k, v, g, beta, do) at a token of one short sequence
        among many (sequences of 1-3 tokens: the segmented mode, sequences sharing chunks; and of
        40-299 tokens: one sequence per chunk):
        every other sequence's o and gradients must stay finite and equal to the run with that
        value replaced by 0; the bad sequence must stay non-finite somewhere.
  states a call with initial and final states over many short sequences (1-4 tokens, the stage
        `short`) and a few long ones, traced cu_seqlens, bf16: o, the final states and every
        gradient against the token recurrence (--tol), then a NaN in one short sequence's v and one
        in another's initial state: every other sequence's o, final state and gradients must equal
        the run with those values replaced by 0.
Prints one JSON line per case and writes them to --out; exit status 1 if a check fails.
CPU smoke run (kernels interpreted, small): --total 300 --parts nan --impl xla.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kda
from kda.reference import recurrent_kda
from kda.stages import gate as gate_stage

CU = (0, 100, 300, 1200, 3000, 4096)


def ratio(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want ** 2)), 1e-30))


def _inputs(key, B, T, H, K, V, dtype):
  ks = jax.random.split(key, 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, H, V)).astype(dtype)
  g = jax.random.normal(ks[3], (B, T, H, K), jnp.float32)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(dtype)
  A_log = jax.random.uniform(ks[5], (H,), minval=-1.0, maxval=1.0)
  dt_bias = 0.5 * jax.random.normal(ks[6], (H * K,))
  do = jax.random.normal(ks[7], (B, T, H, V), jnp.float32)
  return (q, k, v, g, beta), A_log, dt_bias, do


def _config(text, impl, dtype, K, V):
  """tools.configs' text (--config) as chunk_kda's config for a plan of these dims, or None."""
  if not text:
    return None
  from tools import configs
  return configs.parse(text, kda.plan.make_plan(scale=K ** -0.5, chunk_size=64, impl=impl, dtype=dtype, K=K, V=V))


def dims_case(K, V, dtype, varlen, tol, impl=None, config=""):
  H = 4
  B, T = (1, CU[-1]) if varlen else (2, CU[-1] // 2)
  x, A_log, dt_bias, do = _inputs(jax.random.PRNGKey(K + 7 * V), B, T, H, K, V, dtype)
  N = len(CU) - 1 if varlen else B
  h0 = jax.random.normal(jax.random.PRNGKey(3), (N, H, K, V)) * 0.1
  cu = jnp.asarray(CU, jnp.int32) if varlen else None
  gkw = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)

  def loss(fn, x, A_log, dt_bias, h0):
    o, ht = fn(x, A_log, dt_bias, h0)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht), (o, ht)

  def ours(x, A_log, dt_bias, h0):
    return kda.chunk_kda(*x, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                         cu_seqlens=cu, impl=impl, config=_config(config, impl, dtype, K, V), **gkw)

  def truth(x, A_log, dt_bias, h0):
    q, k, v, g, beta = (a.astype(jnp.float32) for a in x)
    ga = gate_stage.activate(g, A_log, dt_bias, use_gate_in_kernel=True, lower_bound=-5.0)
    if cu is None:
      outs = [recurrent_kda(q[b:b + 1], k[b:b + 1], v[b:b + 1], ga[b:b + 1], beta[b:b + 1], initial_state=h0[b:b + 1],
                            output_final_state=True) for b in range(B)]
      return jnp.concatenate([o for o, _ in outs]), jnp.concatenate([s for _, s in outs])
    return recurrent_kda(q, k, v, ga, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)

  grad = lambda fn: jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3), has_aux=True))
  (g_got, (o, ht)) = grad(ours)(x, A_log, dt_bias, h0)
  (g_want, (o_r, ht_r)) = grad(truth)(x, A_log, dt_bias, h0)
  errs = {"o": ratio(o, o_r), "ht": ratio(ht, ht_r)}
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), g_got[0], g_want[0]):
    errs[name] = ratio(a, b)
  errs.update(dA_log=ratio(g_got[1], g_want[1]), ddt_bias=ratio(g_got[2], g_want[2]), dh0=ratio(g_got[3], g_want[3]))
  plan = kda.plan.make_plan(scale=K ** -0.5, chunk_size=64, use_gate_in_kernel=True, lower_bound=-5.0, impl=impl,
                            dtype=dtype, K=K, V=V)
  ok = all(np.isfinite(e) and e <= tol for e in errs.values())
  return {"case": f"dims K{K} V{V} {jnp.dtype(dtype).name} {'varlen' if varlen else 'fixed'}", "ok": ok,
          "errors": errs, "impls": dict(plan.impls)}


@functools.lru_cache(maxsize=None)
def _nan_setup(total, impl, lengths, config=""):
  """(lens, cu, inputs, do, run) of the NaN part for one length range, run(x, do) -> (o, gradients)
  from two programs, the forward and jax.grad of a loss linear in o, compiled once for every input
  the part spoils."""
  rng = np.random.default_rng(0)
  lens = []
  while sum(lens) < total:
    lens.append(int(rng.integers(*lengths)))
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  T, H, K = int(cu[-1]), 4, 128
  x, _, _, do = _inputs(jax.random.PRNGKey(1), 1, T, H, K, K, jnp.bfloat16)
  x = list(x)
  x[3] = jax.nn.log_sigmoid(x[3]) / 16                  # log-space gates (the segmented mode takes them)
  cuj = jnp.asarray(cu)
  cfg = _config(config, impl, jnp.bfloat16, K, K)

  forward = jax.jit(lambda x: kda.chunk_kda(*x, cu_seqlens=cuj, impl=impl, config=cfg)[0])
  # the gradients of a loss linear in o (o is dead there: the backward decides on its own probe)
  grad = jax.jit(jax.grad(lambda x, do: jnp.sum(kda.chunk_kda(*x, cu_seqlens=cuj, impl=impl, config=cfg)[0].astype(
      jnp.float32) * do)))
  return lens, cu, x, do, lambda x, do: (forward(x), grad(x, do))


def nan_case(where, total, impl=None, lengths=(1, 4), config=""):
  lens, cu, x, do, run = _nan_setup(total, impl, tuple(lengths), config)
  T = int(cu[-1])
  bad_seq = len(lens) // 3
  tok = int(cu[bad_seq])
  seq_of = np.searchsorted(cu, np.arange(T), side="right") - 1

  def put(value):
    xs, d = list(x), do
    if where == "do":
      d = do.at[0, tok].set(value)
    else:
      i = ("q", "k", "v", "g", "beta").index(where)
      xs[i] = xs[i].at[0, tok].set(jnp.asarray(value, xs[i].dtype))
    return run(xs, d)

  bad, zero = put(jnp.nan), put(0.0)
  other = seq_of != bad_seq
  res = {"case": f"nan in {where}, lengths {lengths[0]}-{lengths[1] - 1}", "sequences": len(lens), "T": T}
  ok = True
  for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (bad[0], *bad[1]), (zero[0], *zero[1])):
    a, b = np.asarray(a, np.float32)[0], np.asarray(b, np.float32)[0]
    finite = np.isfinite(a.reshape(T, -1)).all(axis=1)
    leaked = sorted(set(seq_of[~finite & other].tolist()))
    same = bool(np.array_equal(a[other], b[other]))
    res[name] = {"other_sequences_nonfinite": len(leaked), "others_equal_zero_run": same,
                 "bad_sequence_nonfinite": bool((~finite[~other]).any())}
    ok &= not leaked and same
  res["bad_sequence_nonfinite"] = any(res[n]["bad_sequence_nonfinite"] for n in ("o", "dq", "dk", "dv", "dg", "dbeta"))
  res["ok"] = bool(ok and res["bad_sequence_nonfinite"])
  return res


def states_case(total, tol, impl=None, config=""):
  rng = np.random.default_rng(5)
  lens = []
  while sum(lens) < total:
    lens.append(int(rng.integers(70, 200)) if len(lens) % 50 == 7 else int(rng.integers(1, 5)))
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  T, H, K, N = int(cu[-1]), 4, 128, len(lens)
  x, _, _, do = _inputs(jax.random.PRNGKey(2), 1, T, H, K, K, jnp.bfloat16)
  x = list(x)
  x[3] = jax.nn.log_sigmoid(x[3]) / 16
  h0 = jax.random.normal(jax.random.PRNGKey(4), (N, H, K, K)) * 0.1
  cfg = _config(config, impl, jnp.bfloat16, K, K)

  def loss(fn, x, h0, cu):
    o, ht = fn(x, h0, cu)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * 0.5), (o, ht)

  ours = lambda x, h0, cu: kda.chunk_kda(*x, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl=impl,
                                         config=cfg)
  truth = lambda x, h0, cu: recurrent_kda(*(a.astype(jnp.float32) for a in x), initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu)
  grad = lambda fn: jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1), has_aux=True))
  cuj = jnp.asarray(cu)
  with kda.plan.recording() as choices:
    run = grad(ours)
    (gx, gh), (o, ht) = run(x, h0, cuj)
  (wx, wh), (o_r, ht_r) = grad(truth)(x, h0, cuj)
  errs = {"o": ratio(o, o_r), "ht": ratio(ht, ht_r), "dh0": ratio(gh, wh)}
  errs.update({n: ratio(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), gx, wx)})
  res = {"case": f"states: {N} sequences, {T} tokens", "errors": errs,
         "short": sorted({c.backend for c in choices if c.name == "short"})}
  ok = all(np.isfinite(e) and e <= tol for e in errs.values())
  seq_of = np.searchsorted(cu, np.arange(T), side="right") - 1
  bad = [i for i, n in enumerate(lens) if n <= 4][3:5]             # v spoiled in one, h0 in the other
  spoil = lambda val: ([*x[:2], x[2].at[0, cu[bad[0]]].set(val), *x[3:]], h0.at[bad[1], 1, 2, 3].set(val))
  (bx, bh), (bo, bht) = run(*spoil(jnp.nan), cuj)
  (zx, zh), (zo, zht) = run(*spoil(0.0), cuj)
  tok, seq = ~np.isin(seq_of, bad), ~np.isin(np.arange(N), bad)
  same = {n: bool(np.array_equal(np.asarray(a, np.float32)[0, tok], np.asarray(b, np.float32)[0, tok]))
          for n, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (bo, *bx), (zo, *zx))}
  same.update(ht=bool(np.array_equal(np.asarray(bht)[seq], np.asarray(zht)[seq])),
              dh0=bool(np.array_equal(np.asarray(bh)[seq], np.asarray(zh)[seq])))
  spoilt = bool(np.isnan(np.asarray(bht)[bad]).any())
  res.update(nan_others_equal_zero_run=same, bad_sequences_nonfinite=spoilt)
  res["ok"] = bool(ok and all(same.values()) and spoilt)
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--parts", default="dims,nan")
  p.add_argument("--dtypes", default="bfloat16,float16")
  p.add_argument("--tol", type=float, default=0.008, help="max error ratio (FLA's varlen test: 0.005-0.015)")
  p.add_argument("--total", type=int, default=7000, help="tokens of the NaN case")
  p.add_argument("--impl", default=None, help="chunk_kda's impl (default: None, the platform's choice)")
  p.add_argument("--dims", default="256x256,128x256,256x128", help="KxV pairs of the dims part")
  p.add_argument("--layouts", default="varlen,fixed", help="the dims part's layouts")
  p.add_argument("--where", default="q,k,v,g,beta,do", help="the inputs the nan part spoils")
  p.add_argument("--lengths", default="1-3,40-299", help="sequence length ranges of the nan part")
  p.add_argument("--config", default="", help="chunk_kda's configs, name.field=value,... (tools.configs)")
  p.add_argument("--out")
  a = p.parse_args(argv)
  rows = []
  if "dims" in a.parts:
    for dt in a.dtypes.split(","):
      for K, V in (tuple(map(int, d.split("x"))) for d in a.dims.split(",")):
        for varlen in (lay == "varlen" for lay in a.layouts.split(",")):
          try:
            rows.append(dims_case(K, V, jnp.dtype(dt), varlen, a.tol, a.impl, a.config))
          except Exception as e:  # noqa: BLE001 - report and go on
            rows.append({"case": f"dims K{K} V{V} {dt} {'varlen' if varlen else 'fixed'}", "ok": False,
                         "error": f"{type(e).__name__}: {e}"[:400]})
          print(json.dumps(rows[-1]), flush=True)
  if "nan" in a.parts:
    for lengths in (tuple(int(x) + i for i, x in enumerate(r.split("-"))) for r in a.lengths.split(",")):
      for where in a.where.split(","):
        try:
          rows.append(nan_case(where, a.total, a.impl, lengths, a.config))
        except Exception as e:  # noqa: BLE001
          rows.append({"case": f"nan in {where}, lengths {lengths}", "ok": False,
                       "error": f"{type(e).__name__}: {e}"[:400]})
        print(json.dumps(rows[-1]), flush=True)
  if "states" in a.parts:
    try:
      rows.append(states_case(a.total, a.tol, a.impl, a.config))
    except Exception as e:  # noqa: BLE001
      rows.append({"case": "states", "ok": False, "error": f"{type(e).__name__}: {e}"[:400]})
    print(json.dumps(rows[-1]), flush=True)
  if a.out:
    with open(a.out, "w") as fh:
      json.dump(rows, fh, indent=1)
  return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
