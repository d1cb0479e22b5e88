"""The Mosaic TPU bwd_gate kernel against the bwd_gate reference (TPU interpret mode on CPU) in every
activation mode, with extreme raw gates (-1e4, +-1e4, -1e30, +-inf, 30: floored, saturated,
overflowing softplus), its Mosaic lowering for TPU and its predicate. dgc and dg_state are random
everywhere (the stage must zero padding and floored gates itself)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kda.stages import bwd_gate
from kda.stages.bwd_gate import mosaic_tpu as M
from tests.stages import tpu_bwd_setup as S

EXTREMES = [-1e4, -np.inf, 30.0, 1e4, -200.0, -1e30, np.inf, 0.0]
MODES = {   # id: use_gate_in_kernel, lower_bound, A_log given, dt_bias given
    "plain": (False, None, False, False),
    "softplus": (True, None, True, True),
    "softplus-nobias": (True, None, True, False),
    "sigmoid-lb": (True, -5.0, True, True),
    "sigmoid-lb-noA": (True, -5.0, False, True),
}


@functools.lru_cache(maxsize=None)
def inputs(HV=2, K=64, BT=64, seed=3):
  valid, _, Ta = S.layout(S.LENS, BT)
  rng = np.random.default_rng(seed)
  g = 2.0 * rng.standard_normal((1, Ta, HV, K))
  g[0, 5, 0, :len(EXTREMES)] = EXTREMES
  g[0, 70:80, 1, :] = -1e4                                   # the neutral gate, over many tokens
  A_log = rng.uniform(-1, 1, HV)
  dt_bias = 0.5 * rng.standard_normal(HV * K)
  dgc, dgs = (rng.standard_normal((1, Ta, HV, K)) for _ in range(2))
  f = lambda x: jnp.asarray(x, S.F32)
  return valid, f(g), f(A_log), f(dt_bias), f(dgc), f(dgs)


# bf16 raw gates with each activation (without one, g's dtype only enters the floor test); the
# default run keeps one case per activation formula
DEFAULT = {("plain", "f32"), ("softplus", "f32"), ("sigmoid-lb", "bf16"), ("sigmoid-lb-noA", "f32")}
RUNS = [(m, "f32") for m in MODES] + [(m, "bf16") for m in MODES if MODES[m][0]]
PARAMS = [pytest.param(m, d, id=f"{m}-{d}", marks=() if (m, d) in DEFAULT else pytest.mark.large) for m, d in RUNS]


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_kernel_matches_reference(name, dtype):
  gate_in_kernel, lb, has_a, has_b = MODES[name]
  valid, g, A_log, dt_bias, dgc, dgs = inputs()
  args = (g.astype(S.BF16 if dtype == "bf16" else S.F32), valid, A_log if has_a else None,
          dt_bias if has_b else None, dgc, dgs)
  kw = dict(chunk_size=64, use_gate_in_kernel=gate_in_kernel, lower_bound=lb)
  want = bwd_gate.reference.apply(*args, **kw)
  got = S.run(M, args, kw)
  for f in bwd_gate.Out._fields:
    w, x = getattr(want, f), getattr(got, f)
    assert (w is None) == (x is None), f
    if w is not None:
      # float32 elementwise math either way: the cumsum's order and exp / log1p rounding
      S.close(f, x, w, S.F32_TOL)
  assert np.all(np.isfinite(np.asarray(got.dg)))


@pytest.mark.large
def test_one_head_per_program():
  valid, g, A_log, dt_bias, dgc, dgs = inputs()
  kw = dict(chunk_size=64, use_gate_in_kernel=True, lower_bound=None)
  args = (g, valid, A_log, dt_bias, dgc, dgs)
  want = bwd_gate.reference.apply(*args, **kw)
  got = S.run(M, args, kw, config=M.Config(1))
  for f in bwd_gate.Out._fields:
    S.close(f, getattr(got, f), getattr(want, f), S.F32_TOL)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("BT", [16, 64])
def test_lowers_for_tpu(dtype, BT):
  args, kw = S.specs("bwd_gate", {"f32": S.F32, "bf16": S.BF16}[dtype], HV=4, Ta=512, BT=BT)
  assert S.lower_tpu(functools.partial(M.apply, **kw), *args) == 1
  kw = dict(kw, lower_bound=-5.0)
  assert S.lower_tpu(functools.partial(M.apply, **kw), args[0], args[1], None, *args[3:]) == 1


def test_supports():
  args, kw = S.specs("bwd_gate", S.F32, HV=4, Ta=512)
  assert M.supports(*args, **kw) is None
  assert "A_log" in M.supports(args[0], args[1], None, *args[3:], **kw)
  assert "dt_bias" in M.supports(*args[:3], S.jax.ShapeDtypeStruct((7,), S.F32), *args[4:], **kw)
