"""kda.chunk_kda: argument checks, varlen normalisation, the differentiable entry point.

chunk_kda's gradient is the staged backward (S0-S5 in kda.pipeline.backward) behind a jax.custom_vjp.
The autodiff path through the forward stages stays available for checking it:
`kda.api.chunk_kda_with(q, k, v, g, beta, backward="autodiff", **same_keywords)`
(backward="custom_vjp" is what chunk_kda does).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from kda import confine, padding, pipeline, plan as planning, shapes, sharding, short, validate as runtime_checks
from kda.padding import pieces
from kda._vma import unchecked, vary_like
from kda.shapes import (CHUNK_SIZES, check_fits_int32, check_float, check_head_sizes, check_int, check_rank,
                        check_shape, is_concrete)
from kda.steps import clean_cotangent, scope


def _as_jax(x):
  """numpy (or other array-like) input -> a jax array; jax arrays and tracers pass through; None stays None.

  Done after the checks (so their messages show the dtype the user passed), before any computation:
  a numpy array indexed by a traced index (inside a scan) would raise TracerArrayConversionError.
  """
  return x if x is None or isinstance(x, jax.Array) else jnp.asarray(x)


def _check_inputs(q, k, v, g, beta):
  """-> (B, T, H, K, HV, V). A wrong shape is reported against the layout the other arguments agree
  on: B and T are the leading dims most arguments share, H and K come from q or k (whichever has that
  B, T), so a transposed q alone is named as q."""
  args = (("q", q, 4, "[B, T, H, K]"), ("k", k, 4, "[B, T, H, K]"), ("v", v, 4, "[B, T, HV, V]"),
          ("g", g, 4, "[B, T, HV, K]"), ("beta", beta, 3, "[B, T, HV]"))
  for name, x, rank, layout in args:
    check_rank(name, x, rank, layout)
  for name, x, *_ in args:
    check_float(name, x)
  lead = [tuple(x.shape[:2]) for _, x, *_ in args]
  B, T = max(lead, key=lambda bt: (lead.count(bt), -lead.index(bt)))   # most agree; ties: first
  agree = ", ".join(n for (n, *_), bt in zip(args, lead) if bt == (B, T))
  qk = q if tuple(q.shape[:2]) == (B, T) or tuple(k.shape[:2]) != (B, T) else k
  H, K = qk.shape[2:]
  HV, V = v.shape[2:]
  check_head_sizes("q" if qk is q else "k", qk, {2: "H", 3: "K"})
  want = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V), "g": (B, T, HV, K), "beta": (B, T, HV)}
  for name, x, _, layout in args:
    if name == "v":
      if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B={B}, T={T}, HV, V] (B, T as {agree}), got {tuple(v.shape)}")
      check_head_sizes("v", v, {2: "HV", 3: "V"})
      if HV % H:
        raise ValueError(f"v's head count HV must be a multiple of q's H={H}, got HV={HV}")
      continue
    if tuple(x.shape) != want[name]:
      raise ValueError(f"{name} must have shape {want[name]} ({layout}; B={B}, T={T} as {agree}), "
                       f"got {tuple(x.shape)}")
  return B, T, H, K, HV, V


def _layout(B, T, chunk_size, cu_seqlens, segment_ids, num_segments, initial_state):
  """-> Layout of the sequences in the packed [1, B*T] buffer."""
  if cu_seqlens is not None and segment_ids is not None:
    raise ValueError("pass either cu_seqlens or segment_ids, got both")
  if cu_seqlens is not None:
    if not isinstance(cu_seqlens, jax.Array):
      cu_seqlens = np.asarray(cu_seqlens)   # numpy / list: its own dtype, so a too-large value shows
    check_rank("cu_seqlens", cu_seqlens, 1, "[N+1]")
    check_int("cu_seqlens", cu_seqlens)
    check_fits_int32("cu_seqlens", cu_seqlens)
    if B != 1:
      raise ValueError(f"cu_seqlens requires B == 1 (packed sequences), got B={B}")
    if cu_seqlens.shape[0] < 1:
      raise ValueError("cu_seqlens must have at least one entry [0], got an empty array")
    shapes.check_cu_seqlens_values(cu_seqlens, T)
    return padding.layout_from_cu_seqlens(jnp.asarray(cu_seqlens).astype(jnp.int32), T, chunk_size)
  if segment_ids is not None:
    if not isinstance(segment_ids, jax.Array):
      segment_ids = np.asarray(segment_ids)
    check_rank("segment_ids", segment_ids, 2, "[B, T]")
    check_int("segment_ids", segment_ids)
    check_fits_int32("segment_ids", segment_ids)
    check_shape("segment_ids", segment_ids, (B, T), "[B, T]")
    if num_segments is not None:
      if not isinstance(num_segments, (int, np.integer)) or isinstance(num_segments, bool) or num_segments < 0:
        raise ValueError(f"num_segments must be a non-negative Python int (static N), got {num_segments!r}")
      if initial_state is not None and initial_state.shape[0] != num_segments:
        raise ValueError(f"num_segments must equal initial_state.shape[0]={initial_state.shape[0]} when "
                         f"both are given, got {num_segments}")
    N = initial_state.shape[0] if initial_state is not None else num_segments
    if is_concrete(segment_ids):
      if np.any(np.asarray(segment_ids) < 0):
        raise ValueError(f"segment_ids must be >= 0 (0 marks padding), got min {int(np.min(segment_ids))}")
      runs = padding.count_segments(segment_ids)
      if N is None:
        N = runs
      elif runs > N:
        src = "initial_state.shape[0]" if initial_state is not None else "num_segments"
        raise ValueError(f"{src} must be >= the number of sequences in segment_ids ({runs}), got {N}")
    elif N is None:
      raise ValueError("with traced segment_ids the number of sequences N must be static: pass "
                       "num_segments=N (or initial_state), got neither")
    starts, lens = padding.segment_ids_to_seqs(jnp.asarray(segment_ids).astype(jnp.int32), int(N))
    return padding.make_layout(starts, lens, B * T, chunk_size)
  starts = np.arange(B, dtype=np.int32) * T               # numpy: concrete even under jit
  return padding.make_layout(starts, np.full((B,), T, np.int32), B * T, chunk_size)


def _check_gate_args(HV, K, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound):
  """-> lower_bound as a Python float (or None)."""
  if lower_bound is not None:
    lower_bound = _real("lower_bound", lower_bound, "a float")
    if not math.isfinite(lower_bound):
      raise ValueError("lower_bound must be a finite negative number (at -inf every gate is -inf and the "
                       f"gradients of A_log and dt_bias are undefined), got {lower_bound}")
    if safe_gate and not -5.0 <= lower_bound < 0:
      raise ValueError(f"lower_bound must be in [-5.0, 0) with safe_gate, got {lower_bound}")
    if not lower_bound < 0:
      raise ValueError(f"lower_bound must be in (-inf, 0) (a finite negative number), got {lower_bound}")
  elif safe_gate:
    raise ValueError("safe_gate=True requires lower_bound in [-5, 0), got lower_bound=None")
  if use_gate_in_kernel:
    if A_log is None and lower_bound is None:
      raise ValueError("use_gate_in_kernel=True without lower_bound requires A_log [HV], got None")
  if A_log is not None:
    check_rank("A_log", A_log, 1, "[HV]")
    check_float("A_log", A_log)
    check_shape("A_log", A_log, (HV,), "[HV]")
  if dt_bias is not None:
    check_rank("dt_bias", dt_bias, 1, "[HV * K]")
    check_float("dt_bias", dt_bias)
    check_shape("dt_bias", dt_bias, (HV * K,), "[HV * K]")
  return lower_bound


def _real(name, x, what):
  """A static real number (Python or numpy int/float, not bool) -> float; else TypeError."""
  if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)):
    return float(x)
  raise TypeError(f"{name} must be {what}, got {type(x).__name__}")


BACKWARDS = ("custom_vjp", "autodiff")


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              safe_gate=False, lower_bound=None, cu_seqlens=None, segment_ids=None, num_segments=None,
              chunk_size=64, impl=None, config=None, validate=False):
  """Varlen chunked Kimi Delta Attention. See docs/api.md for the contract.

  q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV] -> (o [B,T,HV,V] in v.dtype,
  final_state [N,HV,K,V] float32 or None). Every array may be a jax or a numpy array, `scale` and
  `lower_bound` Python or numpy real numbers. `T == 0`, `N == 0` and empty sequences are valid: `o`
  is empty or zero there and the final state of an empty sequence is its initial state (or zeros).

  Under `jax.jit` the values of traced `cu_seqlens` / `segment_ids` and of the float inputs are not
  checked unless `validate=True` (kda.validate: reductions on the device and one host callback that
  raises a ValueError naming the argument, index and value; jax reports it as a JaxRuntimeError at
  the first blocking use). Shapes and dtypes are always checked, and concrete values (including
  numpy arrays closed over by the jitted function) are checked in full. Without validation, bad
  traced values give meaningless numbers, never an out-of-bounds memory access (the layout's
  gathers and scatters are clamped, filled or dropped at the buffer's edge), and positive gates
  (outside the contract: exp(g) > 1 grows the state) may overflow.

  Gradients come from the staged backward (S0-S5, `kda.pipeline.backward`) through a jax.custom_vjp.
  To check it, `kda.api.chunk_kda_with(..., backward="autodiff")` takes the same arguments and
  differentiates the forward stages with JAX autodiff instead.
  """
  return chunk_kda_with(q, k, v, g, beta, backward="custom_vjp", scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                        safe_gate=safe_gate, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                        segment_ids=segment_ids, num_segments=num_segments, chunk_size=chunk_size, impl=impl,
                        config=config, validate=validate)


def chunk_kda_with(q, k, v, g, beta, *, backward, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                   safe_gate=False, lower_bound=None, cu_seqlens=None, segment_ids=None, num_segments=None,
                   chunk_size=64, impl=None, config=None, validate=False):
  """chunk_kda with a chosen gradient: backward="custom_vjp" (what chunk_kda uses: the staged
  backward S0-S5) or "autodiff" (JAX autodiff through the forward stages; it needs differentiable
  stage implementations, i.e. the jnp references: the check path for the staged backward).
  """
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  B, T, H, K, HV, V = _check_inputs(q, k, v, g, beta)
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
  if scale is None:
    scale = K ** -0.5
  else:
    scale = _real("scale", scale, "a (static) real number or None")
    if not math.isfinite(scale):
      raise ValueError(f"scale must be a finite real number, got {scale}")
  if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
    raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True, got "
                     f"use_gate_in_kernel=False with A_log={'set' if A_log is not None else None}, "
                     f"dt_bias={'set' if dt_bias is not None else None}")
  lower_bound = _check_gate_args(HV, K, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound)
  if initial_state is not None:
    check_rank("initial_state", initial_state, 4, "[N, HV, K, V]")
    check_float("initial_state", initial_state)
  mesh = sharding.explicit_mesh(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, segment_ids)
  # the whole call's layout: its checks and N (on an explicit mesh, only those: each device then
  # lays out its own part, and the integer arrays are read whole here)
  layout = _layout(B, T, chunk_size, *sharding.whole(mesh, cu_seqlens, segment_ids), num_segments, initial_state)
  N = layout.N
  if initial_state is not None:
    check_shape("initial_state", initial_state, (N, HV, K, V), f"[N={N}, HV, K, V]")
  if validate:
    runtime_checks.checks(*map(_as_jax, (q, k, v, g, beta)), cu_seqlens=cu_seqlens, segment_ids=segment_ids, N=N,
                          initial_state=_as_jax(initial_state), A_log=_as_jax(A_log), dt_bias=_as_jax(dt_bias),
                          use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
  if mesh is not None:         # sharded over an explicit mesh: one shard_map over it (kda.sharding)
    call = functools.partial(
        chunk_kda_with, backward=backward, scale=scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        safe_gate=safe_gate, lower_bound=lower_bound, chunk_size=chunk_size, impl=impl, config=config)
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias,
                  cu_seqlens=cu_seqlens, segment_ids=segment_ids)
    return sharding.chunk_kda(call, mesh, arrays, N=N, num_segments=num_segments,
                              output_final_state=output_final_state)
  # h0 made of zeros here, a final state dropped here: the kernels skip reading and storing them
  plan = planning.make_plan(scale=scale, chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm_in_kernel,
                            use_gate_in_kernel=use_gate_in_kernel,
                            lower_bound=lower_bound if use_gate_in_kernel else None, impl=impl, config=config,
                            zero_initial_state=initial_state is None, final_state_unused=not output_final_state,
                            dtype=q.dtype, K=K, V=V)
  kernels = [n for n in planning.FORWARD if plan.impl(n) not in ("reference", "xla")]
  if backward == "autodiff" and kernels:
    raise ValueError("backward='autodiff' differentiates through the forward stages, which needs their "
                     f"jnp implementations (impl='reference' or 'xla'); got kernels for stages {kernels}")
  q, k, v, g, beta, initial_state, A_log, dt_bias = map(_as_jax, (q, k, v, g, beta, initial_state, A_log, dt_bias))
  h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  if N == 0 or B * T == 0:         # no sequence or no token (e.g. a batch of padding, T == 0): nothing
    # to compute; every sequence is empty, so its final state is its initial state. Pure jnp, so the
    # gradient of initial_state is the final_state cotangent and every other gradient is zero.
    return jnp.zeros_like(v), (h0 if output_final_state else None)
  pack = lambda x: x.reshape((1, B * T) + x.shape[2:])
  g = pack(g)
  pc = plan.config("pipeline")
  P = pieces.count(HV, pc.segment_pieces, pc.segment_walks) if pc.segment_pieces else 0
  if pieces.takes(P, contiguous=segment_ids is None, initial_state=initial_state,
                 output_final_state=output_final_state, N=N, use_gate_in_kernel=use_gate_in_kernel):
    # fewer, longer sequences with resets inside; sharing chunks, they are kept apart by zero decays,
    # so a non-finite input is confined to its sequence here (kda.confine)
    seqs = confine.sequences(layout.starts, layout.lens, B * T)
    layout, resets = pieces.segmented(layout, P)
    run = functools.partial(_segmented, ints=(layout.starts, layout.lens, layout.aligned_cu, resets),
                            backward=backward, plan=plan, static=(layout.T, layout.Ta, layout.chunk_size))
    probed = backward == "custom_vjp"    # the staged backward reports whether its inputs were finite
    rest = (h0[:layout.N], A_log, dt_bias) + ((jnp.zeros((), jnp.float32),) if probed else ())
    o, final_state = confine.confined(run, probed, seqs, pack(q), pack(k), pack(v), g, pack(beta), rest)
  elif short.takes(pc.short_len, initial_state=initial_state, output_final_state=output_final_state, N=N):
    o, final_state = _with_short(backward, plan, layout, pc.short_len, _known_lens(B, T, cu_seqlens, segment_ids),
                                 pack(q), pack(k), pack(v), g, pack(beta), h0, A_log, dt_bias)
  else:
    o, final_state = _core(backward, plan, layout, pack(q), pack(k), pack(v), g, pack(beta), h0, A_log, dt_bias)
  o = o.reshape(B, T, HV, V)
  return o, (final_state if output_final_state else None)


@functools.partial(jax.jit, static_argnames=("backward", "plan", "static", "clean"))
def _segmented(q, k, v, g, beta, h0, A_log, dt_bias, probe=None, *, ints, backward, plan, static, clean=False):
  """_core on a segmented layout (ints: its starts, lens, aligned_cu and resets; static: T, Ta,
  chunk_size). Jitted at module level: an eager call shares its compile with the calls before.
  probe (custom_vjp): a () float32 whose cotangent is 0 where the backward found its inputs finite,
  else 1; clean: the call on the inputs with their non-finite values replaced by 0, -inf gates
  kept (kda.confine's rerun; its kernels are the plain call's)."""
  return _core(backward, plan, _layout_of(ints, static), q, k, v, g, beta, h0, A_log, dt_bias, ints[3], probe,
               clean=clean)


def _known_lens(B, T, cu_seqlens, segment_ids):
  """The sequence lengths as numpy where the call fixes them (no cu_seqlens, or a concrete one), else
  None."""
  if segment_ids is not None:
    return None
  if cu_seqlens is None:
    return np.full((B,), T, np.int32)
  return np.diff(np.asarray(cu_seqlens).astype(np.int64)) if is_concrete(cu_seqlens) else None


def _with_short(backward, plan, layout, L, lens, q, k, v, g, beta, h0, A_log, dt_bias):
  """_core on the sequences longer than L, then the recurrence (kda.short) on the others, from the
  chunks' final states; lens: as kda.short.split's. A short sequence is empty in the chunks' layout,
  so its final state there is its h0; a long one has no step in the recurrence, whose zero inputs
  leave its state as it is: the recurrence's states are every sequence's final state, and no select
  between the two paths reads or writes a state."""
  rest, is_short, steps, any_long = short.split(layout, L, lens)
  o_long = None
  if any_long is not False:
    core = lambda *a: _core(backward, plan, rest, *a)
    args = (q, k, v, g, beta, h0, A_log, dt_bias)
    if any_long is True:
      o_long, h0 = core(*args)
    else:              # traced lengths: the chunks of the worst-case layout run only where a sequence needs them
      none = lambda *a: vary_like((jnp.zeros_like(v), a[5]), *a, rest.starts, rest.lens)
      o_long, h0 = lax.cond(any_long, core, none, *args)
  with scope("short"):
    o, wrote, states = short.run(plan, layout, is_short, steps, q, k, v, g, beta, h0, A_log, dt_bias,
                                 exact=lens is not None)
    return (o if o_long is None else jnp.where(wrote[None, :, None, None], o, o_long)), states


def _core(backward, plan, layout, q, k, v, g, beta, h0, A_log, dt_bias, resets=None, probe=None, *, clean=False):
  """Packed inputs -> (o [1, T, HV, V], final_state [N, HV, K, V]), differentiable. resets: a
  segmented layout's (kda.padding.pieces); probe, clean: `_segmented`'s (probe: custom_vjp only)."""
  # Inside shard_map every input varies over the same mesh axes, so each gradient has its input's
  # type; where an input was invariant (zeros made here, a replicated A_log) the cast's transpose
  # sums its gradient over the devices.
  q, k, v, g, beta, h0, A_log, dt_bias = vary_like((q, k, v, g, beta, h0, A_log, dt_bias),
                                                   (layout.starts, layout.lens, layout.aligned_cu))
  if backward == "autodiff":
    o, final_state, _ = pipeline.forward(plan, layout, q, k, v, g, beta, h0, A_log, dt_bias, resets=resets,
                                         clean=clean)
    return (clean_cotangent(o) if clean else o), final_state
  static = (layout.T, layout.Ta, layout.chunk_size)
  ints = (layout.starts, layout.lens, layout.aligned_cu) + (() if resets is None else (resets,))
  return _staged(plan, static, clean, ints, q, k, v, g, beta, h0, A_log, dt_bias, probe)


# The Layout's int arrays may be traced (jit over cu_seqlens), so they travel as primal arguments
# with no cotangent; the plan, the static sizes and clean are hashable nondiff arguments. probe (None
# or a () float32 nothing reads) gets the cotangent 0 if the backward's inputs were all finite, else 1.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _staged(plan, static, clean, ints, q, k, v, g, beta, h0, A_log, dt_bias, probe):
  o, final_state, _ = _forward(plan, static, clean, ints, (q, k, v, g, beta, h0, A_log, dt_bias), keep=False)
  return o, final_state


def _staged_fwd(plan, static, clean, ints, *args):
  *args, probe = args
  o, final_state, saved = _forward(plan, static, clean, ints, args, keep=True)
  return (o, final_state), (ints, args, saved, None if probe is None else ())   # no leaf either way


def _forward(plan, static, clean, ints, args, *, keep):
  """pipeline.forward -> (o, final_state, Saved or None). Never differentiated (custom_vjp: it is the
  primal or the fwd rule), so it may run unchecked where its kernels need it. The residuals hold
  the inputs as given (clean: the backward cleans them again where it reads them) and, with
  PipelineConfig.keep_forward, what the forward formed of S0's outputs."""
  def run(ints, args):
    o, final_state, records = pipeline.forward(plan, _layout_of(ints, static), *args, resets=_resets(ints),
                                               clean=clean, keep=keep and plan.config("pipeline").keep_forward)
    return o, final_state, pipeline.saved(records) if keep else None
  if planning.unchecked_kernels(plan, planning.FORWARD):
    return unchecked(run, ints, args)
  return run(ints, args)


def _staged_bwd(plan, static, clean, res, cts):
  ints, args, saved, marker = res
  probe = marker is not None      # the call passed a probe: its cotangent reports finiteness
  do, dht = cts
  def run(ints, args, saved, do, dht):
    return pipeline.backward(plan, _layout_of(ints, static), *args, saved, do, dht, resets=_resets(ints),
                             probe=probe, clean=clean)[0]
  if planning.unchecked_kernels(plan, planning.BACKWARD):
    grads = unchecked(run, ints, args, saved, do, dht)
  else:
    grads = run(ints, args, saved, do, dht)
  dprobe = jnp.where(grads.finite, 0.0, 1.0).astype(jnp.float32) if probe else None
  return ((None,) * len(ints), *grads[:8], dprobe)


def _layout_of(ints, static):
  """The Layout of _staged's int arrays (starts, lens, aligned_cu[, resets]) and static sizes."""
  return padding.Layout(*ints[:3], *static)


def _resets(ints):
  return ints[3] if len(ints) > 3 else None


_staged.defvjp(_staged_fwd, _staged_bwd)
