"""The composer: packed inputs -> align -> gate -> intra -> state -> output -> unalign, and back.

forward:  prepare (align, l2norm, GVA repeat, gate neutralisation) -> gate -> intra -> state -> output
          -> unalign; state and output run as one kernel where the fused group state_output takes
          the call.
backward: prepare again -> S0 bwd_recompute -> S1 bwd_dav -> S2 bwd_dh -> S3 bwd_wy -> S4 bwd_intra
          -> S5 bwd_gate -> prepare's vjp. The six stages are hand-derived; the cheap glue around them
          is differentiated with jax.vjp: unalign's transpose is align of do, prepare's vjp sums each
          GVA group, applies the l2norm backward and drops the gradients of padding positions. The
          backward's only per-chunk state buffer is S0's h: S2 keeps the state cotangent one chunk
          at a time.

Where the fused groups packed_forward / packed_backward take the call (every member selects a backend
that has them), they run the same stages with align and unalign folded into the kernels' loads and
stores; otherwise the stages run here, each through the Stage interface with the implementation the
plan chooses (kda.plan), so a single stage can be swapped between its kernels and its references.
With `record=True` every stage runs unfused and its output record is returned too (tools.trace).
"""
from __future__ import annotations

from typing import Any

import jax

from kda import fused, padding, steps
from kda.padding import Layout
from kda.padding.pieces import reset_gates
from kda.plan import FORWARD, BACKWARD, Plan, group_backend, run  # noqa: F401  (re-exported names)
from kda.steps import Grads, Kept, Saved, defer_qg_kw, keep_pairs, o_dtype, pairs_kw, prepare, s2_du_kw, scope  # noqa: F401  (the records)
from kda.steps import cleaned, from_kept, zero_bad


def saved(records) -> Saved:
  """The residuals of a forward() call (its records, with or without record=True; with keep=True
  they hold "kept" where the forward formed S0's outputs)."""
  return Saved(records["intra"].Aqk, records["intra"].Ainv, records.get("kept"))


def _group(plan, name, *args, **kwargs):
  """Fused group `name` on these arguments, or None where it does not take them."""
  impl = group_backend(plan, name, *args, **kwargs)
  if impl is None:
    return None
  with scope(name):
    return fused.GROUPS[name](impl, *args, interpret=plan.interpret, config=plan.config(name, impl), **kwargs)


def forward(plan: Plan, layout: Layout, q, k, v, g, beta, initial_state, A_log, dt_bias, *,
            record: bool = False, resets=None, clean: bool = False, keep: bool = False):
  """Packed inputs [1, T, ...] -> (o [1, T, HV, V] in v's dtype, final_state [N, HV, K, V] f32, records).

  records holds "intra" (what saved() reads) and, with `record`, every stage's output record, "valid"
  (the [1, Ta] real-token mask) and "inputs" ({stage: positional args}; the keywords are
  plan.stage_kwargs). packed_forward runs where it takes the call unless the plan's pipeline config
  says packed=False (tools.gpu_check compares the two). resets: a segmented layout's (kda.padding.pieces): the
  packed kernels take them as segment masks, the other paths as -inf gates. clean: the call on the
  inputs with their non-finite values replaced by 0, -inf gates kept (kda.confine's rerun). keep
  (the custom VJP's forward with PipelineConfig.keep_forward): records["kept"] holds gc, w, u, qg, kg
  for the backward where the forward forms them (not where a fused kernel keeps gc or w, u inside).
  """
  if clean:
    q, k, v, g, beta = cleaned(q, k, v, g, beta)
  args = (q, k, v, g, beta, initial_state, A_log, dt_bias)
  if plan.config("pipeline").packed and not record:
    out = _group(plan, "packed_forward", plan, layout, *args, resets, keep=keep)
    if out is not None:
      return out
  if resets is not None:
    g = reset_gates(g, resets)
  with scope("prepare"):
    q, k, v, g, beta, valid = prepare(plan, layout, q, k, v, g, beta)
  inputs = {}

  def stage(name, *args):
    inputs[name] = args
    with scope(name):
      return run(plan, name, *args, **plan.stage_kwargs(name))

  gi = None if record else _group(plan, "gate_intra", q, k, v, beta, g, valid, A_log, dt_bias, layout.aligned_cu,
                                  scale=plan.scale, **plan.stage_kwargs("gate"))
  if gi is not None:           # the activated gate never leaves the kernel; decay: exp of gc's last rows
    it, gc, decay = gi, (gi.gc_int, gi.gc_frac), dict(decay=gi.decay)
  else:
    gt = stage("gate", g, valid, A_log, dt_bias)
    it = stage("intra", q, k, v, beta, gt.gc_int, gt.gc_frac, layout.aligned_cu)
    gc, decay = (gt.gc_int, gt.gc_frac), {}
  state_args = (it.kg, it.w, it.u, *gc, initial_state, layout.aligned_cu)
  fused_out = None
  if not record:               # h and v_new never leave the kernel
    fused_out = _group(plan, "state_output", it.kg, it.w, it.u, it.qg, it.Aqk, *state_args[3:],
                       scale=plan.scale, chunk_size=plan.chunk_size, out_dtype=o_dtype(v),
                       **plan.state_kwargs(), **decay)
  if fused_out is not None:
    o, final_state = fused_out
  else:
    st = stage("state", *state_args)
    ot = stage("output", it.qg, st.h, it.Aqk, st.v_new)
    o, final_state = ot.o, st.final_state
  with scope("unalign"):
    o = padding.unalign_with(layout, o).astype(v.dtype)
  records: dict[str, Any] = {"intra": it}
  if keep and gi is None and it.w is not None:
    records["kept"] = Kept(gt.gc_int, gt.gc_frac, it.w, it.u, it.qg, it.kg)
  if record:
    records = {"valid": valid, "gate": gt, "intra": it, "state": st, "output": ot, "inputs": inputs}
  return o, final_state, records


def backward(plan: Plan, layout: Layout, q, k, v, g, beta, initial_state, A_log, dt_bias, saved: Saved,
             do, dht, *, record: bool = False, resets=None, probe: bool = False, clean: bool = False):
  """Cotangents of forward's (o [1, T, HV, V], final_state [N, HV, K, V]) -> (Grads, records).

  Takes forward's inputs and `saved` (Aqk, Ainv, and where kept gc, w, u, qg, kg: then S0 runs only
  the state stage); S0 recomputes the rest. Memory: the
  [NTa, HV, K, V] buffers of the backward are S0's h (the state entering each chunk) and, in S2's
  kernels, the state cotangent per chunk in bf16 (the reference S2 carries it in its scan instead).
  S2 hands S3 everything that needs h or that cotangent as O(T * K) terms (dqg, dkg, dw, du) and
  O(NTa * K) ones (dgc_last). `do` may hold anything (even NaN) at tokens of no sequence: they are
  never read. records as in forward (stage outputs and "inputs") with `record`, else empty.
  packed_backward runs where it takes the call unless the pipeline config says packed=False.
  probe: Grads.finite is set (kda.confine), from S0's kernel where packed_backward runs, else from
  S0's outputs. clean: forward(clean=True)'s backward, the gradients as of the inputs and do with
  their non-finite values replaced by 0 (packed_backward cleans only what its kernels do not read
  cleaning: S1-S4 take a clean flag).
  """
  args = (q, k, v, g, beta, initial_state, A_log, dt_bias, saved, do, dht)
  if plan.config("pipeline").packed and not record:
    out = _group(plan, "packed_backward", plan, layout, *args, resets, probe=probe, clean=clean)
    if out is not None:
      return out, {}
  if clean:
    q, k, v, g, beta = cleaned(q, k, v, g, beta)
    do = zero_bad(do)
  if resets is not None:
    g = reset_gates(g, resets)
  with scope("prepare"):
    (qa, ka, va, ga, ba), prepare_vjp = jax.vjp(lambda *x: prepare(plan, layout, *x)[:5], q, k, v, g, beta)
    valid = padding.valid_mask(layout)[None]
    do = padding.align_with(layout, do)       # the transpose of unalign_with; in o's dtype (stages upcast)
  inputs = {}

  def stage(name, *args, **extra):
    inputs[name] = args
    with scope(name):
      return run(plan, name, *args, **plan.stage_kwargs(name), **extra)

  if saved.kept is not None:
    rc = from_kept(plan, saved.kept, initial_state, layout.aligned_cu)
  else:
    rc = stage("bwd_recompute", qa, ka, va, ga, ba, valid, A_log, dt_bias, saved.Ainv, initial_state,
               layout.aligned_cu)
  av = stage("bwd_dav", rc.v_new, saved.Aqk, do, layout.aligned_cu)
  gc = (rc.gc_int, rc.gc_frac)
  finite = None
  if probe:                    # padding and tail rows hold zeros: only the inputs can make them non-finite
    with scope("confine"):
      finite = steps.finite((rc.w, rc.u, rc.qg, rc.kg))
  # S3's dv and S4's dq, dk are the final gradients of the aligned inputs: stored in their dtypes
  # (prepare_vjp rounds them there anyway). Record mode keeps float32 stage outputs (what
  # tools.stages and the checks compare).
  dv_dtype = {} if record else dict(dv_dtype=va.dtype)
  grad_dtype = {} if record or qa.dtype != ka.dtype else dict(grad_dtype=qa.dtype)
  walk = None if record else _group(
      plan, "bwd_walk", qa, ka, va, ga, ba, valid, A_log, dt_bias, saved.Ainv, rc, av.dAqk, av.dv, do, dht,
      layout.aligned_cu, **{**plan.stage_kwargs("bwd_gate"), **plan.stage_kwargs("bwd_dh")}, **dv_dtype,
      **grad_dtype)
  if walk is not None:         # the state cotangent and S2-S4's terms never leave the kernel
    dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = (walk.dq, walk.dk, walk.dv, walk.dbeta, walk.dg, walk.dh0,
                                                    walk.dA_log, walk.ddt_bias)
  else:
    dh_args = (rc.qg, rc.kg, rc.w, *gc, rc.h, rc.v_new, do, av.dv, dht, layout.aligned_cu)
    du_kw = {} if record else s2_du_kw(plan, dh_args, (qa, ka, va, ba, *gc, saved.Ainv), **dv_dtype)
    pairs = pairs_kw(plan, du_kw, qa, va)
    ds = stage("bwd_dh", *dh_args, **du_kw, **pairs)
    pairs, wy_args = keep_pairs(plan, "bwd_wy", (qa, ka, va, ba, *gc, saved.Ainv, ds.dqg, ds.dkg, ds.dw, ds.du,
                                                 ds.dgc_last, layout.aligned_cu), pairs, **dv_dtype)
    s3_kernel = not record and plan.choose("bwd_wy", *wy_args, **plan.stage_kwargs("bwd_wy"), **dv_dtype,
                                           **pairs) == "mosaic_gpu"
    defer = defer_qg_kw(plan, s3_kernel, qa, ka, ba, gc, av.dAqk, ds, layout.aligned_cu, **grad_dtype, **pairs)
    wy = stage("bwd_wy", *wy_args, **dv_dtype, **pairs, **defer)
    pairs, it_args = keep_pairs(plan, "bwd_intra", (qa, ka, ba, *gc, av.dAqk, wy.dAkk, ds.dqg if defer else wy.dq,
                                                    wy.dk, wy.dbeta, wy.dgc, layout.aligned_cu), pairs, **grad_dtype)
    it = stage("bwd_intra", *it_args, **grad_dtype, **pairs, **defer)
    gt = stage("bwd_gate", ga, valid, A_log, dt_bias, it.dgc, wy.dg_state)
    dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = (it.dq, it.dk, wy.dv, it.dbeta, gt.dg, ds.dh0, gt.dA_log,
                                                    gt.ddt_bias)
  like = lambda d, x: None if x is None else d.astype(x.dtype)
  with scope("prepare_vjp"):
    dq, dk, dv, dg, dbeta = prepare_vjp(tuple(like(d, x) for d, x in zip((dq, dk, dv, dg, dbeta),
                                                                         (qa, ka, va, ga, ba))))
  grads = Grads(dq, dk, dv, dg, dbeta, dh0, like(dA_log, A_log), like(ddt_bias, dt_bias), finite)
  records: dict[str, Any] = {}
  if record:
    records = {"valid": valid, "bwd_recompute": rc, "bwd_dav": av, "bwd_dh": ds, "bwd_wy": wy,
               "bwd_intra": it, "bwd_gate": gt, "inputs": inputs}
  return grads, records
