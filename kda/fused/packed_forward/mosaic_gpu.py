"""packed_forward on Hopper: gate -> intra (or the fused gate_intra kernels) -> the fused state +
output kernel, each reading and writing packed rows.

With `inverse_in_state` the solve forms no w = Ainv kd, u = Ainv beta v: it stores Ainv's bf16
split and beta v, and the state + output kernel forms v_new = Ainv (beta v - kd S) per chunk, so the
solve reads no kd and fits three CTAs per SM. With `fuse_gate_intra` the gate's chunk cumsum runs
inside intra's scores kernel (kda.fused.gate_intra) and gc never reaches HBM; where no chunk is
bounded (gates far below -1 everywhere) its persistent redo kernel makes the unfused pair faster.
A segmented layout's resets (kda.padding.pieces) reach the gate and intra kernels as segment masks.
With `keep` (the custom VJP's forward under PipelineConfig.keep_forward) it runs the unfused gate
and the w, u solve, writes the tail chunks' zeros and returns gc, w, u, qg, kg as records["kept"],
so that the backward's S0 runs only its state kernel.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from kda import padding
from kda.fused.packed_forward import gate_intra
from kda.fused.state_output import mosaic_gpu as state_output
from kda.padding.pieces import segment_rows
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import mosaic_gpu as intra_mgpu
from kda.steps import Kept, o_dtype, query_keys, scope


@dataclasses.dataclass(frozen=True)
class Config:
  """Variants of the packed forward (module docstring)."""
  fuse_gate_intra: bool = True
  inverse_in_state: bool = True


def _shapes(plan, layout, q, k, v, g, beta):
  """ShapeDtypeStructs of what the aligned stages would take (their predicates decide)."""
  S = jax.ShapeDtypeStruct
  HV, Ta = v.shape[2], layout.Ta
  aligned = lambda x, d=None: S((1, Ta) + x.shape[2:], d or x.dtype)
  qs = S((1, Ta, HV, q.shape[3]), q.dtype)
  gi = S((1, Ta, HV, k.shape[3]), jnp.float32)
  bf = lambda d: S((1, Ta, HV, d), jnp.bfloat16)
  return aligned, qs, gi, bf


def supports(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, resets=None, *,
             config=None, **_) -> Optional[str]:
  """None if the packed forward takes this call: gate and intra select mosaic_gpu on it, the fused
  state + output kernel takes it, and the packed kernels take the packed inputs."""
  aligned, qs, gi, bf = _shapes(plan, layout, q, k, v, g, beta)
  HV, BT, K, V = v.shape[2], plan.chunk_size, k.shape[3], v.shape[3]
  gkw, ikw = plan.stage_kwargs("gate"), plan.stage_kwargs("intra")
  if plan.choose("gate", aligned(g), jax.ShapeDtypeStruct((1, layout.Ta), jnp.bool_), A_log, dt_bias,
                  **gkw) != "mosaic_gpu":
    return "the gate stage does not select mosaic_gpu"
  if plan.choose("intra", qs, qs, aligned(v), aligned(beta), gi, gi, layout.aligned_cu, **ikw) != "mosaic_gpu":
    return "the intra stage does not select mosaic_gpu"
  so_args = (bf(K), bf(K), bf(V), bf(K), bf(BT), gi, gi, initial_state, layout.aligned_cu)
  if plan.group_backend("state_output", *so_args, chunk_size=BT) != "mosaic_gpu":
    return "the fused state + output kernel does not take the call"
  rows = padding.chunk_rows(layout)
  why = gate_mgpu.packed_takes(g, rows, A_log, dt_bias, **gkw)
  if why is None:
    qp = jax.ShapeDtypeStruct(q.shape[:2] + (HV, K), q.dtype)
    why = intra_mgpu.packed_supports(qp, qp, v, beta, gi, gi, layout.aligned_cu, rows, **ikw)
  return why


def apply(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, resets=None, *, config=None,
          interpret=None, keep=False):
  config = config or Config()
  if keep:
    config = dataclasses.replace(config, fuse_gate_intra=False, inverse_in_state=False)
  interpret = plan.interpret if interpret is None else interpret
  BT, HV = plan.chunk_size, v.shape[2]
  rows = padding.chunk_rows(layout)
  gkw, ikw = plan.stage_kwargs("gate"), plan.stage_kwargs("intra")
  tail = {} if keep else dict(tail_zeros=False)   # only these kernels read the tail's rows, and they skip them
  with scope("prepare"):
    q, k = query_keys(plan, q, k, HV)
  gc_int = gc_frac = decay = None
  seg = {} if resets is None else dict(seg=segment_rows(layout, resets))
  defer = dict(defer=True) if config.inverse_in_state else {}
  if (config.fuse_gate_intra and not seg
      and gate_intra.supports(q, k, v, beta, g, layout.aligned_cu, rows, **{**ikw, **gkw}) is None):
    with scope("gate+intra"):
      it, decay = gate_intra.apply(q, k, v, beta, g, layout.aligned_cu, rows, interpret=interpret,
                                        **ikw, **tail, **defer)
  else:
    with scope("gate"):
      gc_int, gc_frac, bounded, two_part = gate_mgpu.packed(g, rows, A_log, dt_bias, interpret=interpret,
                                                            **gkw, **tail, **seg)
    with scope("intra"):
      it = intra_mgpu.packed(q, k, v, beta, gc_int, gc_frac, layout.aligned_cu, rows, bounded=bounded,
                             two_part=two_part, interpret=interpret, **ikw, **tail, **seg, **defer)
  if defer:       # the state + output kernel applies Ainv: kd and beta v in place of w, u
    it, dfr = it
    w, u, inv = dfr.kd, dfr.bv, dict(inverse=(it.Ainv, dfr.ainv_lo))
  else:
    w, u, inv = it.w, it.u, {}
  with scope("state+output"):
    o, final_state = state_output.apply(
        it.kg, w, u, it.qg, it.Aqk, gc_int, gc_frac, initial_state, layout.aligned_cu, scale=plan.scale,
        chunk_size=BT, interpret=interpret, config=plan.config("state_output", "mosaic_gpu"),
        out_dtype=o_dtype(v), rows=rows, T=layout.T, decay=decay, **inv, **plan.state_kwargs())
  records = {"intra": it}
  if keep:
    records["kept"] = Kept(gc_int, gc_frac, it.w, it.u, it.qg, it.kg)
  return o.astype(v.dtype), final_state, records
