"""Inputs of the backward stages for the Mosaic TPU kernels' tests (TPU interpret mode on CPU).

`case(...)` builds one aligned varlen layout (lens with a 1-token sequence, a partial chunk, an empty
sequence, and a tail chunk past aligned_cu[-1]), random inputs that are zero at padding as the
padding layer leaves them, and chains the stage references S0 -> S4 on them, so every stage's kernel
is compared with its reference on the inputs the pipeline would hand it. bf16 cases round q, k, v,
do (and Aqk, as the forward kernels store it) to bf16; the references take the same values.
Gates: "ordinary" (log gates in (-1, 0)), "extreme" (-1e4, -inf, -30 and -5 sprinkled in one head:
gc floored at -128 per token, reaching about -8000 in a chunk).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from kda import padding
from kda.stages import bwd_dav, bwd_dh, bwd_intra, bwd_recompute, bwd_wy, gate, intra
from tests.lowering import lower_tpu  # noqa: F401  (the lowering tests: TPU.md section 4, no libtpu)

F32, BF16 = jnp.float32, jnp.bfloat16
LENS = (1, 70, 0, 37)        # a 1-token sequence, a partial second chunk, an empty one, a partial chunk
INTERPRET = pltpu.InterpretParams()

# The cases the stage tests share (one reference chain each per session): float32 with extreme gates
# in head 0 (head 1 ordinary) at K = V = 64, bf16 at K = V = 128; the large run adds the other
# pairings, K != V, BT 32 and 16, one head.
CASES = {
    "f32-K64-extreme": dict(dtype="f32", K=64, V=64, gates="extreme"),
    "bf16-K128": dict(dtype="bf16", K=128, V=128),
}
LARGE_CASES = {
    "f32-K128": dict(dtype="f32", K=128, V=128),
    "bf16-K64-extreme": dict(dtype="bf16", K=64, V=64, gates="extreme"),
    "f32-K64-V128-BT32": dict(dtype="f32", K=64, V=128, BT=32),
    "f32-K128-V64-BT16-HV1": dict(dtype="f32", K=128, V=64, BT=16, HV=1),
}


def all_cases():
  """pytest params: CASES, then LARGE_CASES marked large."""
  import pytest
  return ([pytest.param(v, id=k) for k, v in CASES.items()]
          + [pytest.param(v, id=k, marks=pytest.mark.large) for k, v in LARGE_CASES.items()])


# max|kernel - reference| / max|reference| per field.
# float32 inputs: HIGHEST everywhere, the dtype policy's bound; measured <= 3.2e-7 (summation order:
# 0/1 cumsum dots, the intra sub-block factorisation) on every case here.
F32_TOL = 1e-5
# bf16 inputs: bf16 MXU operands (2^-9 relative rounding each, float32 accumulation) against the
# float32 reference on the same values; measured <= 4.7e-3 (bwd_wy's dAkk: four chained dots). A
# wrong or missing term is O(1).
BF16_TOL = 2e-2


class Case(NamedTuple):
  BT: int
  scale: float
  valid: jax.Array        # [1, Ta] bool
  acu: jax.Array          # [N+1] int32
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array            # raw gates (already activated: use_gate_in_kernel=False)
  beta: jax.Array
  h0: jax.Array
  Aqk: jax.Array
  Ainv: jax.Array
  do: jax.Array
  dht: jax.Array
  rc: bwd_recompute.Out
  av: bwd_dav.Out
  ds: bwd_dh.Out
  wy: bwd_wy.Out
  it: bwd_intra.Out
  it0: bwd_intra.Out      # bwd_intra's own terms: the reference on zero accumulators


def layout(lens, BT, tail_chunks=1):
  lens = np.asarray(lens, np.int64)
  acu = np.concatenate([[0], np.cumsum(-(-lens // BT) * BT)]).astype(np.int32)
  Ta = int(acu[-1]) + tail_chunks * BT
  valid = np.zeros(Ta, bool)
  for n, L in enumerate(lens):
    valid[acu[n]:acu[n] + L] = True
  return jnp.asarray(valid)[None], jnp.asarray(acu), Ta


@functools.lru_cache(maxsize=None)
def case(HV=2, K=64, V=64, BT=64, dtype="f32", gates="ordinary", lens=LENS, seed=0) -> Case:
  dt = {"f32": F32, "bf16": BF16}[dtype]
  valid, acu, Ta = layout(lens, BT)
  rng = np.random.default_rng(seed)
  m = np.asarray(valid)[0][None, :, None, None]
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (unit(rng.standard_normal((1, Ta, HV, K))) for _ in range(2))
  v = rng.standard_normal((1, Ta, HV, V))
  g = -0.99 / (1.0 + np.exp(1.0 - rng.standard_normal((1, Ta, HV, K))))
  if gates == "extreme":
    hit = rng.random((1, Ta, 1, K))
    pick = np.asarray([-1e4, -np.inf, -30.0, -5.0], np.float32)[rng.integers(0, 4, (1, Ta, 1, K))]
    g[:, :, :1] = np.where(hit < 0.1, pick, g[:, :, :1])
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((1, Ta, HV))))
  N = len(lens)
  h0 = 0.5 * rng.standard_normal((N, HV, K, V))
  do = rng.standard_normal((1, Ta, HV, V))
  dht = rng.standard_normal((N, HV, K, V))
  z = lambda x: jnp.asarray(np.where(m, x, 0.0))
  q, k, v, do = (z(x).astype(dt) for x in (q, k, v, do))
  g = jnp.where(valid[:, :, None, None], jnp.asarray(g, F32), padding.NEUTRAL_GATE)
  beta = jnp.asarray(np.where(m[..., 0], beta, 0.0), F32)
  h0, dht = jnp.asarray(h0, F32), jnp.asarray(dht, F32)
  scale = K ** -0.5
  return _chain(BT, scale, valid, acu, q, k, v, g, beta, h0, do, dht)


def _chain(BT, scale, valid, acu, q, k, v, g, beta, h0, do, dht):
  @jax.jit
  def run(valid, acu, q, k, v, g, beta, h0, do, dht):
    gt = gate.reference.apply(g, valid, None, None, chunk_size=BT, use_gate_in_kernel=False, lower_bound=None)
    fw = intra.reference.apply(q, k, v, beta, gt.gc_int, gt.gc_frac, scale=scale, chunk_size=BT)
    Aqk = fw.Aqk.astype(q.dtype)           # bf16 from the forward kernels with bf16 inputs
    rc = bwd_recompute.reference.apply(q, k, v, g, beta, valid, None, None, fw.Ainv, h0, acu, chunk_size=BT,
                                       use_gate_in_kernel=False, lower_bound=None)
    av = bwd_dav.reference.apply(rc.v_new, Aqk, do, acu, chunk_size=BT)
    gc = (rc.gc_int, rc.gc_frac)
    ds = bwd_dh.reference.apply(rc.qg, rc.kg, rc.w, *gc, rc.h, rc.v_new, do, av.dv, dht, acu, scale=scale,
                                chunk_size=BT)
    wy = bwd_wy.reference.apply(q, k, v, beta, *gc, fw.Ainv, ds.dqg, ds.dkg, ds.dw, ds.du, ds.dgc_last, acu,
                                chunk_size=BT)
    acc = (wy.dq, wy.dk, wy.dbeta, wy.dgc)
    it, it0 = (bwd_intra.reference.apply(q, k, beta, *gc, av.dAqk, wy.dAkk, *a, acu, scale=scale, chunk_size=BT)
               for a in (acc, [jnp.zeros_like(x) for x in acc]))
    return Aqk, fw.Ainv, rc, av, ds, wy, it, it0
  out = run(valid, acu, q, k, v, g, beta, h0, do, dht)
  return Case(BT, scale, valid, acu, q, k, v, g, beta, h0, *out[:2], do, dht, *out[2:])


def tol(c):
  return BF16_TOL if c.q.dtype == BF16 else F32_TOL


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
  return float(np.max(np.abs(got - want))) / scale if want.size else 0.0


def close(name, got, want, tol):
  """max|got - want| <= tol * max|want| (gradients span magnitudes), and finite where want is."""
  got = np.asarray(jnp.asarray(got, F32))
  want = np.asarray(jnp.asarray(want, F32))
  assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
  assert np.all(np.isfinite(got) == np.isfinite(want)), f"{name}: non-finite where the reference is finite"
  err = rel_err(got, want)
  assert err <= tol, f"{name}: max|d| / max|ref| = {err:.2e} > {tol}"
  return err


# ---- each stage's arguments from a Case, and its kernel run in the TPU interpreter ---------------

def stage_args(stage, c: Case, zero_acc=False):
  """(positional args, keyword args, the reference's Out) of `stage` on case c."""
  r, BT = c.rc, c.BT
  gc = (r.gc_int, r.gc_frac)
  if stage == "bwd_dav":
    return (r.v_new, c.Aqk, c.do, c.acu), dict(chunk_size=BT), c.av
  if stage == "bwd_dh":
    return ((r.qg, r.kg, r.w, *gc, r.h, r.v_new, c.do, c.av.dv, c.dht, c.acu),
            dict(scale=c.scale, chunk_size=BT), c.ds)
  if stage == "bwd_wy":
    d = c.ds
    return ((c.q, c.k, c.v, c.beta, *gc, c.Ainv, d.dqg, d.dkg, d.dw, d.du, d.dgc_last, c.acu),
            dict(chunk_size=BT), c.wy)
  if stage == "bwd_intra":
    w = c.wy
    acc = (w.dq, w.dk, w.dbeta, w.dgc)
    if zero_acc:
      acc = tuple(jnp.zeros_like(x) for x in acc)
    args = (c.q, c.k, c.beta, *gc, c.av.dAqk, w.dAkk, *acc, c.acu)
    return args, dict(scale=c.scale, chunk_size=BT), c.it0 if zero_acc else c.it
  raise ValueError(stage)


def run(module, args, kw, interpret=INTERPRET, **extra):
  """module.apply(*args, **kw, **extra) in the TPU interpreter, jitted once per keyword set."""
  return _jitted(module, interpret, tuple(sorted({**kw, **extra}.items())))(*args)


@functools.lru_cache(maxsize=None)
def _jitted(module, interpret, kw):
  return jax.jit(functools.partial(module.apply, interpret=interpret, **dict(kw)))


def specs(stage, dt, HV=16, Ta=8192, K=128, V=128, BT=64, N=4):
  """(ShapeDtypeStructs of `stage`'s positional arguments, its keyword arguments); the defaults are
  the production shapes of the AOT compile (tools/tpu_bwd_aot.py)."""
  S = jax.ShapeDtypeStruct
  I32 = jnp.int32
  NTa = Ta // BT
  tok = lambda D, d=F32: S((1, Ta, HV, D), d)
  acu = S((N + 1,), I32)
  st = S((N, HV, K, V), F32)
  if stage == "bwd_dav":
    return (tok(V, dt), tok(BT, dt), tok(V, dt), acu), dict(chunk_size=BT)
  if stage == "bwd_dh":
    return ((tok(K), tok(K), tok(K), tok(K), tok(K), S((1, NTa, HV, K, V), F32), tok(V), tok(V, dt),
             tok(V), st, acu), dict(scale=K ** -0.5, chunk_size=BT))
  if stage == "bwd_wy":
    return ((tok(K, dt), tok(K, dt), tok(V, dt), S((1, Ta, HV), F32), tok(K), tok(K), tok(BT), tok(K),
             tok(K), tok(K), tok(V), S((1, NTa, HV, K), F32), acu), dict(chunk_size=BT, dv_dtype=dt))
  if stage == "bwd_intra":
    return ((tok(K, dt), tok(K, dt), S((1, Ta, HV), F32), tok(K), tok(K), tok(BT), tok(BT), tok(K),
             tok(K), S((1, Ta, HV), F32), tok(K), acu), dict(scale=K ** -0.5, chunk_size=BT, grad_dtype=dt))
  if stage == "bwd_gate":
    return ((tok(K, dt), S((1, Ta), jnp.bool_), S((HV,), F32), S((HV * K,), F32), tok(K), tok(K)),
            dict(chunk_size=BT, use_gate_in_kernel=True, lower_bound=None))
  if stage == "bwd_fused":      # kda.fused.bwd_walk.mosaic_tpu; S0's outputs in the dot dtype as it stores them
    rc = bwd_recompute.Out(tok(K), tok(K), tok(K, dt), tok(V, dt), tok(K, dt), tok(K, dt),
                           S((1, NTa, HV, K, V), dt), tok(V, dt))
    return ((tok(K, dt), tok(K, dt), tok(V, dt), tok(K, dt), S((1, Ta, HV), dt), S((1, Ta), jnp.bool_),
             S((HV,), F32), S((HV * K,), F32), tok(BT), rc, tok(BT), tok(V), tok(V, dt), st, acu),
            dict(scale=K ** -0.5, chunk_size=BT, use_gate_in_kernel=True, lower_bound=None, dv_dtype=dt,
                 grad_dtype=dt))
  if stage == "bwd_recompute":
    return ((tok(K, dt), tok(K, dt), tok(V, dt), tok(K, dt), S((1, Ta, HV), dt), S((1, Ta), jnp.bool_),
             S((HV,), F32), S((HV * K,), F32), tok(BT), st, acu),
            dict(chunk_size=BT, use_gate_in_kernel=True, lower_bound=None))
  raise ValueError(stage)
