"""packed_backward on Hopper: S0 and S5 run their packed Mosaic GPU modes; S1-S4 run whatever the
plan chooses for them, packed where their kernel is chosen (module docstring of the group)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kda import padding, stages, steps
from kda.padding.pieces import segment_rows
from kda.stages import bwd_dh, bwd_wy
from kda.stages.bwd_dh import mosaic_gpu as bwd_dh_mgpu
from kda.stages.bwd_gate import mosaic_gpu as bwd_gate_mgpu
from kda.stages.bwd_wy.mosaic_gpu import fused as bwd_wy_terms
from kda.steps import Grads, cleaned, defer_qg_kw, from_kept, keep_pairs, pairs_kw, query_keys, s2_du_kw, scope
from kda.steps import zero_bad


def _aligned_shapes(plan, layout, q, v, g, beta, A_log, dt_bias, initial_state):
  S = jax.ShapeDtypeStruct
  Ta, HV = layout.Ta, v.shape[2]
  aligned = lambda x, d=None: S((1, Ta) + x.shape[2:], d or x.dtype)
  qs = S((1, Ta, HV, q.shape[3]), q.dtype)
  ga, valid, gc = aligned(g), S((1, Ta), jnp.bool_), aligned(g, jnp.float32)
  rc_args = (qs, qs, aligned(v), ga, aligned(beta), valid, A_log, dt_bias, None, initial_state, layout.aligned_cu)
  return rc_args, (ga, valid, A_log, dt_bias, gc, gc), gc


def supports(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, saved=None, do=None, dht=None,
             resets=None, *, config=None, **_) -> Optional[str]:
  """None if S0 and S5 select mosaic_gpu on the aligned call and their packed modes take it."""
  rc_args, gate_args, gc = _aligned_shapes(plan, layout, q, v, g, beta, A_log, dt_bias, initial_state)
  if plan.choose("bwd_recompute", *rc_args, **plan.stage_kwargs("bwd_recompute")) != "mosaic_gpu":
    return "bwd_recompute does not select mosaic_gpu"
  if plan.choose("bwd_gate", *gate_args, **plan.stage_kwargs("bwd_gate")) != "mosaic_gpu":
    return "bwd_gate does not select mosaic_gpu"
  rows = padding.chunk_rows(layout)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, plan.chunk_size)
  return bwd_gate_mgpu.packed_supports(g, rows, pieces, A_log, dt_bias, gc, gc, **plan.stage_kwargs("bwd_gate"))


def apply(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, saved, do, dht, resets=None, *,
          config=None, interpret=None, probe=False, clean=False):
  """clean (kda.confine's rerun): the gradients as of the inputs and do with their non-finite values
  replaced by 0, -inf gates kept. S3 and S4 read q, k, v raw with their clean flag, S1 and S2 do,
  and S5 reads g raw (per token, and a non-finite gate's token is the rerun's to poison), so the
  cleaned copies XLA forms for S0 die there: the rerun holds none through S1-S5."""
  interpret = plan.interpret if interpret is None else interpret
  rows = padding.chunk_rows(layout)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, plan.chunk_size)
  seg = {} if resets is None else dict(seg=segment_rows(layout, resets))
  tail = dict(tail_zeros=False)      # the tail's rows: unwritten, and nothing reads them
  kw = plan.stage_kwargs
  raw_q, raw_k, raw_v, raw_g = q, k, v, g
  if clean:
    q, k, v, g, beta = cleaned(q, k, v, g, beta)
  with scope("prepare"):
    (qp, kp), qk_vjp = jax.vjp(lambda q, k: query_keys(plan, q, k, v.shape[2]), q, k)   # per token
    # what S3 and S4 read with their clean flag: the raw inputs where query_keys passes them through
    same = not plan.use_qk_l2norm and q.shape[2] == v.shape[2]
    q3, k3, v3 = (raw_q, raw_k, raw_v) if clean and same else (qp, kp, raw_v if clean else v)
    qa, ka, va, ba = (padding.align_with(layout, x) for x in (qp, kp, v, beta))
    valid = padding.valid_mask(layout)[None]
    do_packed = do
    do = padding.align_with(layout, zero_bad(do) if clean else do)

  def kernel(name, *args, **extra):
    return plan.choose(name, *args, **kw(name), **extra) == "mosaic_gpu"

  def packed_kw(name, *args, store=False, **extra):
    """Stage `name`'s packed keywords where its kernel takes the call: the unwritten tail and, with
    `store`, its packed output store (rows, pieces, T)."""
    if not kernel(name, *args, **extra):
      return {}
    return dict(tail, **(dict(rows=rows, pieces=pieces, T=layout.T) if store else {}))

  def stage(name, *args, **extra):
    with scope(name):
      return plan.run(name, *args, **kw(name), **extra)

  # S0 reads q, k, v packed (as g): where S3 and S4 do too, no aligned copy of them is formed
  if saved.kept is not None:       # the forward's gc, w, u, qg, kg: only the state kernel runs
    rc = from_kept(plan, saved.kept, initial_state, layout.aligned_cu)
    if probe:                      # read before S1: w, u, qg, kg then need not live to the peak (S4)
      rc, finite = jax.lax.optimization_barrier((rc, steps.finite((rc.w, rc.u, rc.qg, rc.kg))))
    else:
      finite = None
  else:
    rc_args = (qp, kp, v, g, ba, valid, A_log, dt_bias, saved.Ainv, initial_state, layout.aligned_cu)
    with scope("bwd_recompute"):
      rc = stages.get("bwd_recompute")("mosaic_gpu", *rc_args, interpret=interpret, rows=rows, qkv_packed=True,
                                       config=plan.config("bwd_recompute", "mosaic_gpu"),
                                       **kw("bwd_recompute"), **tail, **seg, probe=probe)
      rc, finite = rc if probe else (rc, None)
  # S1 and S2's kernels read bf16 do packed: then no aligned copy of do is formed either
  read_do = lambda kw: (dict(kw, do_packed=do_packed, rows=rows, clean=clean)
                        if kw and do_packed.dtype == jnp.bfloat16 else kw)
  av_args = (rc.v_new, saved.Aqk, do, layout.aligned_cu)
  av = stage("bwd_dav", *av_args, **read_do(packed_kw("bwd_dav", *av_args)))
  gc = (rc.gc_int, rc.gc_frac)
  dh_args = (rc.qg, rc.kg, rc.w, *gc, rc.h, rc.v_new, do, av.dv, dht, layout.aligned_cu)
  dh_kw = read_do(packed_kw("bwd_dh", *dh_args))
  dv_dtype = dict(dv_dtype=va.dtype)
  if dh_kw:
    dh_kw.update(s2_du_kw(plan, dh_args, (qa, ka, va, ba, *gc, saved.Ainv), **dv_dtype))
  grad_dtype = dict(grad_dtype=qa.dtype) if qa.dtype == ka.dtype else {}
  if _terms_in_s3(plan, dh_kw, qa, va):
    ds, wy = _walk_then_terms(plan, dh_args, dh_kw, (q3, k3, v3, ba, *gc, saved.Ainv), rows, pieces, layout, clean,
                              interpret, **dv_dtype)
    pairs, defer, wy_kw = _slab_pairs(qa, va), {}, dict(rows=rows)     # dv left packed
  else:
    ds, wy, pairs, defer, wy_kw = _s2_s3(plan, stage, packed_kw, dh_args, dh_kw, qa, ka, va, ba, q3, k3, v3, gc, saved,
                                         av.dAqk, layout, rows, pieces, tail, clean, grad_dtype, dv_dtype)
  dq = ds.dqg if defer else wy.dq
  it_args = (qa, ka, ba, *gc, av.dAqk, wy.dAkk, dq, wy.dk, wy.dbeta, wy.dgc, layout.aligned_cu)
  pairs, it_args = keep_pairs(plan, "bwd_intra", it_args, pairs, **grad_dtype)
  it_kw = packed_kw("bwd_intra", *it_args, store=True, **grad_dtype, **pairs)
  if it_kw:
    it_args = (q3, k3) + it_args[2:]
    it_kw.update(**seg, **pairs, **defer, qk_packed=True, clean=clean)
  it = stage("bwd_intra", *it_args, **grad_dtype, **it_kw)
  with scope("bwd_gate"):          # dg packed in g's dtype, zeros at tokens of no sequence
    g5 = raw_g if clean and not plan.use_gate_in_kernel else g
    gt = bwd_gate_mgpu.packed(g5, rows, pieces, A_log, dt_bias, it.dgc, wy.dg_state, interpret=interpret,
                              config=plan.config("bwd_gate", "mosaic_gpu"), **kw("bwd_gate"), **seg)
  like = lambda d, x: None if x is None else d.astype(x.dtype)
  unalign = lambda d, stored: d if "rows" in stored else padding.unalign_with(layout, d)
  with scope("prepare_vjp"):       # what a kernel did not store packed is unaligned here
    dq, dk = qk_vjp((like(unalign(it.dq, it_kw), qp), like(unalign(it.dk, it_kw), kp)))
    if plan.use_qk_l2norm:         # its backward at tokens of no sequence (any q, k there: NaN) gives 0
      owned = padding.packed_owned_mask(layout)[None, :, None, None]
      dq, dk = (jnp.where(owned, d, jnp.zeros((), d.dtype)) for d in (dq, dk))
    dv = like(unalign(wy.dv, wy_kw), v)
    dg, dbeta = like(gt.dg, g), like(unalign(it.dbeta, {}), beta)
  return Grads(dq, dk, dv, dg, dbeta, ds.dh0, like(gt.dA_log, A_log), like(gt.ddt_bias, dt_bias), finite)


def _terms_in_s3(plan, dh_kw, qa, va) -> bool:
  """Whether S3 forms S2's terms itself (bwd_wy's mosaic_gpu Config.terms): where S2 runs its kernels
  on the packed bf16 do and hands S3's kernel a bf16 du (dh_kw from s2_du_kw: S3's one-term
  cotangents), the terms kernel takes the dims (`fused.reason`) and dq is not deferred to S4."""
  cfg = plan.config("bwd_wy", "mosaic_gpu")
  return bool(cfg is not None and cfg.terms and "du_dtype" in dh_kw and "do_packed" in dh_kw
              and bwd_wy_terms.reason(qa.shape[-1], va.shape[-1], va.shape[2]) is None
              and not plan.config("pipeline").defer_qg)


def _slab_pairs(q, v) -> dict:
  """The terms kernel's dq, dk as slab pairs over h's and dh's buffers where K == V == 128."""
  return dict(pairs="slabs") if q.shape[-1] == v.shape[-1] == 128 else {}


def _walk_then_terms(plan, dh_args, dh_kw, wy_inputs, rows, pieces, layout, clean, interpret, dv_dtype):
  """S2's walk, then S3's terms kernel on its dh and bf16 du -> (an S2 Out with dh0, S3's Out with
  dAkk as its slabs' parts for bwd_intra)."""
  qg, kg, w, gc_int, gc_frac, h, v_new, do, dv, dht, aligned_cu = dh_args
  with scope("bwd_dh"):
    dh0, dh, du, decay = bwd_dh_mgpu.walk(
        qg, kg, w, gc_int, gc_frac, v_new, do, dv, dht, aligned_cu, interpret=interpret,
        config=plan.config("bwd_dh", "mosaic_gpu"), do_packed=dh_kw["do_packed"], rows=rows, clean=clean,
        **{k: x for k, x in plan.stage_kwargs("bwd_dh").items() if k != "chunk_size"})
  q, k, v, beta, *_, Ainv = wy_inputs
  cfg = plan.config("bwd_wy", "mosaic_gpu")
  with scope("bwd_wy"):
    dq, dk, dv_, dbeta, dgc, dg_state, dAkk = bwd_wy_terms.apply(
        q, k, v, beta, gc_int, gc_frac, Ainv, h, dh, dh_kw["do_packed"], v_new, du, decay, aligned_cu,
        scale=plan.scale, dv_dtype=dv_dtype, interpret=interpret, approx_math=cfg.approx_math, rows=rows,
        pieces=pieces, T=layout.T, clean=clean, dAkk_parts=True, **_slab_pairs(q, v))
  return (bwd_dh.Out(dh0, du, None, None, None, None),
          bwd_wy.Out(dq, dk, dv_, dbeta, dgc, dg_state, dAkk))


def _s2_s3(plan, stage, packed_kw, dh_args, dh_kw, qa, ka, va, ba, q3, k3, v3, gc, saved, dAqk, layout, rows,
           pieces, tail, clean, grad_dtype, dv_dtype):
  """S2 and S3 as the plan chooses them, packed where their kernels run -> (ds, wy, pairs, defer, wy_kw)."""
  pairs = pairs_kw(plan, dh_kw, qa, va)
  ds = stage("bwd_dh", *dh_args, **dh_kw, **pairs)
  wy_args = (qa, ka, va, ba, *gc, saved.Ainv, ds.dqg, ds.dkg, ds.dw, ds.du, ds.dgc_last, layout.aligned_cu)
  pairs, wy_args = keep_pairs(plan, "bwd_wy", wy_args, pairs, **dv_dtype)
  wy_kw = packed_kw("bwd_wy", *wy_args, store=True, **dv_dtype, **pairs)
  if wy_kw:                        # the kernel reads q, k, v packed: their aligned copies die in S0
    wy_args = (q3, k3, v3) + wy_args[3:]
    wy_kw.update(pairs, qkv_packed=True, clean=clean, dAkk_parts=True)   # bwd_intra sums them
  # S4's packed call as packed_kw will make it
  defer = defer_qg_kw(plan, bool(wy_kw), qa, ka, ba, gc, dAqk, ds, layout.aligned_cu, **grad_dtype, **pairs,
                      **tail, rows=rows, pieces=pieces, T=layout.T)
  wy = stage("bwd_wy", *wy_args, **dv_dtype, **wy_kw, **defer)
  return ds, wy, pairs, defer, wy_kw
