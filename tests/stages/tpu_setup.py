"""What the Mosaic TPU kernel tests share (tests/stages/test_*_tpu.py, tests/test_fused_tpu.py).

The TPU interpreter's compiles dominate these tests' time (an intra kernel ~3 s of CPU), so every
jitted function comes from one cache (`jitted`, keyed by function and keywords) and the stage tests
and the fused tests run on the same two input configurations: each kernel compiles once per
configuration in a session, whichever test comes first.

A: float32, K = V = 64 (lanes padded to 128), BT = 16;  B: bf16, K = V = 128, BT = 32. Both varlen
with an empty sequence, a 1-token one and partial chunks, HV = 2, raw gates through the softplus
activation (A_log, dt_bias), the inputs of tests/stages/test_gate.pooled_inputs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda import padding
from kda.stages import gate, intra, output, state
from tests.stages.test_gate import pooled_inputs

GATE = dict(use_gate_in_kernel=True, lower_bound=None)   # softplus with A_log and dt_bias


class Case(NamedTuple):
  lens: tuple
  K: int
  V: int
  BT: int
  dtype: object

  @property
  def scale(self):
    return self.K ** -0.5


CASES = {
    "A": Case((30, 0, 1, 50), 64, 64, 16, jnp.float32),
    "B": Case((17, 1, 0, 40), 128, 128, 32, jnp.bfloat16),
}


def jitted(fn, **kw):
  """jax.jit(partial(fn, **kw)), one per (fn, kw) in the session."""
  return _jitted(fn, tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=None)
def _jitted(fn, kw):
  return jax.jit(functools.partial(fn, **dict(kw)))


def kernel(fn, **kw):
  """A TPU kernel's launcher in the TPU interpreter (pltpu.InterpretParams())."""
  return jitted(fn, interpret=True, **kw)


class Forward(NamedTuple):
  ins: tuple      # q, k, v, beta, g (raw), valid, A_log, dt_bias: aligned, in the case's dtype
  h0: jax.Array   # [N, HV, K, V] float32
  acu: jax.Array  # aligned_cu [N+1] int32
  ref: dict       # the reference stages' outputs on ins (float32): gate, intra, state, output


@functools.lru_cache(maxsize=None)
def forward(name) -> Forward:
  c = CASES[name]
  q, k, v, g, beta, valid, A_log, dt_bias = pooled_inputs(lens=list(c.lens), HV=2, K=c.K, V=c.V, BT=c.BT,
                                                          dtype=c.dtype, gate_kind="raw")
  acu = padding.aligned_cu_seqlens(jnp.asarray(c.lens, jnp.int32), c.BT)
  h0 = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (len(c.lens), 2, c.K, c.V))
  gt = jitted(gate.reference.apply, chunk_size=c.BT, **GATE)(g, valid, A_log, dt_bias)
  it = jitted(intra.reference.apply, scale=c.scale, chunk_size=c.BT)(q, k, v, beta, gt.gc_int, gt.gc_frac)
  st = jitted(state.reference.apply, chunk_size=c.BT)(it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, h0, acu)
  ot = jitted(output.reference.apply, scale=c.scale, chunk_size=c.BT)(it.qg, st.h, it.Aqk, st.v_new)
  return Forward((q, k, v, beta, g, valid, A_log, dt_bias), h0, acu, dict(gate=gt, intra=it, state=st, output=ot))


def state_inputs(name):
  """The state stage's inputs from the reference gate and intra, kg, w, u in the case's dtype (as
  the intra kernel stores them)."""
  f, dt = forward(name), CASES[name].dtype
  gt, it = f.ref["gate"], f.ref["intra"]
  return (it.kg.astype(dt), it.w.astype(dt), it.u.astype(dt), gt.gc_int, gt.gc_frac, f.h0, f.acu)


def output_inputs(name):
  """The output stage's inputs from the reference stages, all in the case's dtype (as the intra and
  state kernels store them)."""
  f, dt = forward(name), CASES[name].dtype
  it, st = f.ref["intra"], f.ref["state"]
  return tuple(x.astype(dt) for x in (it.qg, st.h, it.Aqk, st.v_new))
