"""bwd_gate (S5): the Mosaic TPU kernel; the math is in kda.stages.bwd_gate.

Grid (HV / MB, NTa). Per chunk and head of the program, on [BT, K] tiles:

    dg_act = U @ dgc + dg_state        U[t, s] = 1 for s >= t: the reverse chunk-local cumsum as a 0/1
                                       dot at HIGHEST (no cumsum on the TPU, and exact products)
    live   = valid & (g_act >= GATE_FLOOR)      g_act recomputed from the raw gate
    dg_act = where(live, dg_act, 0),  then the activation's backward (dx, and dA_log's term)

dA_log and ddt_bias are sums over every token: each program adds its chunk's row sums [1, K] to
output blocks (MB, K) that stay resident over the chunk axis (grid step c == 0 zeroes them), so that
axis is "arbitrary" when they are asked for ("parallel" otherwise); XLA sums dA_log's K lanes.

Blocks: g, dgc, dg_state, dg (MB, BT, K) head-first; valid (1, BT) per chunk (a 0/1 row, turned
into a column in VMEM); exp(A_log) (MB, 1) and dt_bias (MB, K) per head group. Every operation but
the cumsum dot is elementwise float32. VMEM at K = 128, BT = 64, MB = 16: 3.9 MiB (bf16 g) / 4.4 MiB.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kda import _mosaic_tpu_bwd as T
from kda.stages.bwd_gate import Out
from kda.stages.gate import GATE_FLOOR


@dataclasses.dataclass(frozen=True)
class Config:
  heads_per_program: int = 1   # MB: value heads per program (a divisor of HV)


def vmem_need(MB, K, BT, g_dtype) -> int:
  b = T.block_bytes
  ins = b((MB, BT, K), g_dtype) + b((1, BT), T.F32) + b((MB, 1), T.F32) + b((MB, K), T.F32) + 2 * b((MB, BT, K), T.F32)
  outs = b((MB, BT, K), T.F32) + 2 * b((MB, K), T.F32)
  return 2 * (ins + outs) + 10 * b((BT, max(K, BT)), T.F32)


def default_config(HV, K, BT, g_dtype=T.F32) -> Config:
  per = vmem_need(1, K, BT, g_dtype)
  return Config(max(T.heads_per_program(HV, per), 1))


def supports(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound,
             config=None, **_) -> Optional[str]:
  if g.ndim != 4 or g.shape[0] != 1:
    return f"g must be [1, Ta, HV, K], got {g.shape}"
  _, Ta, HV, K = g.shape
  if (r := T.chunk_reason(Ta, chunk_size)) is not None:
    return r
  if valid.shape != (1, Ta) or dgc.shape != g.shape or dg_state.shape != g.shape:
    return f"valid must be [1, Ta] and dgc, dg_state {g.shape}, got {valid.shape}, {dgc.shape}, {dg_state.shape}"
  if use_gate_in_kernel and lower_bound is None and A_log is None:
    return "the softplus activation (lower_bound unset) needs A_log"
  if A_log is not None and A_log.shape != (HV,):
    return f"A_log must be [HV] = [{HV}], got {A_log.shape}"
  if dt_bias is not None and dt_bias.shape != (HV * K,):
    return f"dt_bias must be [HV * K] = [{HV * K}], got {dt_bias.shape}"
  named = (("g", g), ("A_log", A_log), ("dt_bias", dt_bias), ("dgc", dgc), ("dg_state", dg_state))
  if (r := T.dtype_reason(named)) is not None:
    return r
  cfg = config or default_config(HV, K, chunk_size, g.dtype)
  if HV % cfg.heads_per_program:
    return f"heads_per_program {cfg.heads_per_program} must divide HV {HV}"
  need = vmem_need(cfg.heads_per_program, K, chunk_size, g.dtype)
  return T.budget_reason("bwd_gate", need)


def _softplus(x):
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def gate_step(g, vcol, a, bias, dgc, dg_state, *, use_gate_in_kernel, lower_bound):
  """One chunk of one head: g, dgc, dg_state [BT, K]; vcol [BT, 1] 0/1; a [1, 1] = exp(A_log) or
  None; bias [1, K] or None. Returns (dx [BT, K], dA [BT, K] or None): the raw gate's cotangent and
  the terms whose sum is dA_log."""
  BT = g.shape[0]
  dg = T.exact(T.tri(BT, lambda r, c: c >= r), dgc, T.NN) + dg_state
  x = g.astype(T.F32)
  if not use_gate_in_kernel:
    live = (vcol > 0) & (x >= GATE_FLOOR)
    return jnp.where(live, dg, 0.0), None
  if bias is not None:
    x = x + bias
  if lower_bound is None:
    g_act = -a * _softplus(x)
    live = (vcol > 0) & (g_act >= GATE_FLOOR)
    dg = jnp.where(live, dg, 0.0)
    return jnp.where(live, -a * _sigmoid(x) * dg, 0.0), jnp.where(live, g_act * dg, 0.0)
  z = x if a is None else a * x
  s = _sigmoid(z)
  live = (vcol > 0) & (lower_bound * s >= GATE_FLOOR)
  dg = jnp.where(live, dg, 0.0)
  dz = jnp.where(live, lower_bound * s * (1.0 - s) * dg, 0.0)
  dx = dz if a is None else a * dz
  dA = None if a is None else jnp.where(live & (dz != 0.0), z * dz, 0.0)
  return dx, dA


def _kernel(*refs, MB, has_a, has_bias, want_dA, want_db, mode):
  refs = list(refs)
  g_r, v_r = refs[:2]
  a_r = refs[2] if has_a else None
  bias_r = refs[2 + has_a] if has_bias else None
  dgc_r, dgs_r = refs[2 + has_a + has_bias:4 + has_a + has_bias]
  outs = refs[4 + has_a + has_bias:]
  dg_o = outs[0]
  dA_o = outs[1] if want_dA else None
  db_o = outs[1 + want_dA] if want_db else None
  c = pl.program_id(1)
  vcol = T.to_col(v_r[...])

  if want_dA or want_db:
    @pl.when(c == 0)
    def _():
      for o in (dA_o, db_o):
        if o is not None:
          o[...] = jnp.zeros(o.shape, o.dtype)

  def head(m):
    a = T.head_row(a_r, m) if has_a else None
    bias = T.head_row(bias_r, m) if has_bias else None
    dx, dA = gate_step(g_r[m], vcol, a, bias, dgc_r[m], dgs_r[m], **mode)
    dg_o[m] = dx
    if want_dA:
      dA_o[pl.ds(m, 1), :] += jnp.sum(dA, axis=0, keepdims=True)
    if want_db:
      db_o[pl.ds(m, 1), :] += jnp.sum(dx, axis=0, keepdims=True)
  T.head_loop(MB, head)


def apply(g, valid, A_log, dt_bias, dgc, dg_state, *, chunk_size, use_gate_in_kernel, lower_bound,
          interpret=False, config=None) -> Out:
  T.refuse("bwd_gate", supports(g, valid, A_log, dt_bias, dgc, dg_state, chunk_size=chunk_size,
                                use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, config=config))
  BT = chunk_size
  _, Ta, HV, K = g.shape
  NTa = Ta // BT
  cfg = config or default_config(HV, K, BT, g.dtype)
  MB = cfg.heads_per_program
  G = HV // MB
  has_a = use_gate_in_kernel and A_log is not None
  has_bias = use_gate_in_kernel and dt_bias is not None
  want_dA, want_db = has_a, has_bias
  tok = lambda D: T.token_block(MB, BT, D)
  per_head = lambda D: pl.BlockSpec((None, MB, D), lambda h, c: (h, 0, 0))
  args = [T.head_first(g), valid.astype(T.F32).reshape(NTa, 1, BT)]
  in_specs = [tok(K), pl.BlockSpec((None, 1, BT), lambda h, c: (c, 0, 0))]
  if has_a:
    args.append(jnp.exp(A_log.astype(T.F32)).reshape(G, MB, 1))
    in_specs.append(per_head(1))
  if has_bias:
    args.append(dt_bias.astype(T.F32).reshape(G, MB, K))
    in_specs.append(per_head(K))
  args += [T.head_first(dgc.astype(T.F32)), T.head_first(dg_state.astype(T.F32))]
  in_specs += [tok(K), tok(K)]
  S = jax.ShapeDtypeStruct
  out_shape = [S((HV, Ta, K), T.F32)] + [S((G, MB, K), T.F32)] * (want_dA + want_db)
  out_specs = [tok(K)] + [per_head(K)] * (want_dA + want_db)
  reduce = want_dA or want_db
  mode = dict(use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  nbytes = (sum(x.size * x.dtype.itemsize for x in args) + 4 * HV * Ta * K)
  outs = pl.pallas_call(
      functools.partial(_kernel, MB=MB, has_a=has_a, has_bias=has_bias, want_dA=want_dA, want_db=want_db,
                        mode=mode),
      grid=(G, NTa), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=T.compiler_params(("parallel", "arbitrary" if reduce else "parallel"),
                                        vmem_need(MB, K, BT, g.dtype)),
      cost_estimate=pl.CostEstimate(flops=2 * HV * Ta * BT * K + 12 * HV * Ta * K,
                                    transcendentals=3 * HV * Ta * K * use_gate_in_kernel, bytes_accessed=nbytes),
      interpret=T.interpret_params(interpret),
      name="kda_bwd_gate",
  )(*args)
  dg = T.token_major(outs[0])
  dA_log = jnp.sum(outs[1], axis=-1).reshape(HV) if want_dA else None
  ddt_bias = outs[1 + want_dA].reshape(HV * K) if want_db else None
  return Out(dg, dA_log, ddt_bias)
