"""The composer: packed inputs -> align -> gate -> intra -> state -> output -> unalign, and back.

forward:  prepare -> gate -> intra -> state -> output -> unalign.
backward: prepare (again) -> S0 bwd_recompute -> S1 bwd_dav -> S2 bwd_dh -> S3 bwd_wy -> S4 bwd_intra
          -> S5 bwd_gate -> prepare's vjp. The six stages are hand-derived; the cheap glue around
          them (prepare: align, l2norm, GVA repeat, gate neutralisation; and unalign) is differentiated
          with jax.vjp: unalign's transpose is align of do, prepare's vjp sums each GVA group, applies
          the l2norm backward and drops the gradients of padding positions. The backward's only
          per-chunk state buffer is S0's h: S2 keeps the state cotangent one chunk at a time.

Every stage is called through its Stage object with the implementation chosen in `Plan.impls`,
so a single stage can be swapped between its kernel and its jnp reference. With `record=True`
every stage's output record is returned as well (tools.trace, per-stage debugging).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kda import padding, shapes
from kda.fused import gate_intra, state_output
from kda.padding import Layout
from kda import stages
from kda.stages.base import resolve
from kda.stages.bwd_gate import mosaic_gpu as bwd_gate_mgpu
from kda.stages.gate import mosaic_gpu as gate_mgpu
from kda.stages.intra import mosaic_gpu as intra_mgpu

FORWARD_STAGES = ("gate", "intra", "state", "output")
# Fused groups (DESIGN.md): consecutive stages -> {backend: (kernel, predicate)}. The composer calls
# the fused kernel when every member selects that backend and the predicate takes the call.
FUSED = {("state", "output"): {"mosaic_gpu": (state_output.mosaic_gpu, state_output.takes)}}
# Fused groups not yet compiled and checked on an H200 (tools.gpu_check_bwd): impl=None runs their
# members unfused; impl="mosaic_gpu" (or a dict) fuses them.
UNVERIFIED_GROUPS: frozenset[tuple[str, ...]] = frozenset()
# The whole forward with align / unalign folded into the kernels (packed_forward): mosaic_gpu only.
PACKED = ("align",) + FORWARD_STAGES + ("unalign",)
BACKWARD_STAGES = ("bwd_recompute", "bwd_dav", "bwd_dh", "bwd_wy", "bwd_intra", "bwd_gate")


def is_hopper(device=None) -> bool:
  """sm_90 (H100/H200): the only GPUs with wgmma, which the mosaic_gpu kernels use."""
  device = device or jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


# Whether kda.api tells the plan that the initial state is zero (initial_state=None) and that the
# final state is unused (output_final_state=False), so that the Mosaic GPU state kernels neither
# read the zero state nor store the unused one (nor the backward walk the zero cotangent and the
# dropped dh0). A switch so that tests and tools.bench can compare both ways.
ELIDE_ZERO_STATES = True

# Whether backward() runs packed where `packed_backward_rows` allows it (tools.packed_check and
# tools.bench --aligned-backward compare both ways; the same gradients).
PACKED_BACKWARD = True

# Whether the packed forward's and backward's kernels still write zeros at the chunks past
# aligned_cu[-1] (the tail of the static-bound layout). Packed, nothing reads those rows (every
# consumer skips the tail or masks it by a select; the forward's residuals Aqk, Ainv keep their tail
# zeros and I), so False leaves them unwritten: the same outputs and gradients with less traffic
# (B: a quarter of its chunks; on the H200 the same bits as True for shapes A, B, C, and B's
# forward+backward 13.78 ms against 14.46 with the zeros written).
TAIL_ZEROS = False
# The packed forward's gate -> intra group (kda.fused.gate_intra) where it takes the call. H200,
# forward back to back (device time), ms: plain gates A 1.423-1.446 unfused, 1.356 with the group,
# 1.271-1.275 with it, the solve's RESIDENT_AKK and the blocked gate scan (in the simulator the
# same bits as unfused with RESIDENT_AKK); gates x 40 (bounded, reaching -1; the session before)
# 1.807 vs 1.390; but x 640 (no chunk bounded: the persistent two-part kernel redoes every chunk, at
# one CTA per SM) 4.10 vs 5.72. A lax.cond taking the unfused pair where many chunks need the redo
# cost 0.31 ms of copies on plain gates (XLA copies a conditional's results), so there is none.
FUSE_GATE_INTRA = True
# Whether the packed forward's solve leaves w = Ainv kd and u = Ainv beta v unformed and the fused
# state + output kernel applies Ainv instead, v_new = Ainv (beta v - kd S) (kda.fused.state_output,
# "Inverse"): the solve stores Ainv's split and beta v in place of w, u and reads no kd, and so runs
# three CTAs per SM (168 registers with kda.stages.intra.mosaic_gpu.X_FROM_SMEM). H200, A forward back
# to back: 1.267 ms against 1.263-1.287 with w, u formed in the solve (three calls: within their
# spread; the solve 0.315 against 0.424, the state + output kernel ~0.30 against 0.205). Without the
# state kernel's SPLIT_RHS it was 1.224-1.245, but the final state's bf16 error rose to 5.63e-3. bf16
# fidelity (fidelity.py's inputs): o 4.81e-3 against 4.60e-3, final state 4.56e-3 against 4.87e-3
# (FLA 4.62e-3, 4.53e-3).
INVERSE_IN_STATE = True

# Whether chunk_kda runs many short sequences as fewer, longer pieces (`segment_pieces`) where that
# is exact and the forward runs Mosaic GPU kernels (`segmented_takes`): each piece starts at a
# sequence start and holds the sequences that start before the next piece's start, chunked as one
# sequence, with a gate of -inf at each of their later starts. The gate stage floors it to
# GATE_FLOOR, whose decay exp(-128) is exactly 0 in float32: no term crosses the boundary and the
# state entering a sequence is zero, as in the recurrence; the reset gate's gradient is 0 (so is the
# true one: it only decays the zero initial state). The intra and bwd_intra kernels take the resets
# as segment masks (`segment_rows`), so that a chunk holding one keeps their bounded path. Fewer
# chunks (B: a static bound of 528 against 994 aligned ones) and half the memory. Conditions: a
# zero initial state and an unused final state (a piece has one of each), log-space gates (a
# built-in activation may not reach the floor), sequences that tile the stream (cu_seqlens or
# fixed-length rows; segment_ids may leave gaps) and more of them than pieces. H200, shape B: forward
# 1.55 ms back to back against 2.21 aligned, forward+backward 10.37 against 14.06, in 2845 MiB of XLA
# temporaries against 5347 (with resets as gates alone, every chunk holding one took intra's
# six-level path: forward 4.25 ms; with the gate kernel reading a copy of g with the -inf written
# in, 1.70).
SEGMENTED = True
SEGMENT_PIECES = 16
# A piece's chunks are one serial walk per value head (the state kernels): at least this many walks
# (pieces * HV), so that few heads do not serialise the walks (one piece: A's forward 2.67 ms
# against 1.44 on the H200)
SEGMENT_WALKS = 256


def segment_pieces(HV: int) -> int:
  """The pieces of a segmented call with HV value heads: SEGMENT_PIECES, more where HV is small."""
  return max(SEGMENT_PIECES, -(-SEGMENT_WALKS // max(HV, 1)))


def segmented_takes(plan: Plan, *, contiguous: bool, initial_state, output_final_state: bool, N: int,
                    pieces: int | None = None) -> bool:
  """Whether chunk_kda runs this call's sequences as `pieces` (default SEGMENT_PIECES) segmented ones
  (SEGMENTED)."""
  P = SEGMENT_PIECES if pieces is None else pieces
  return (SEGMENTED and contiguous and N > P and initial_state is None and not output_final_state
          and not plan.use_gate_in_kernel and all(plan.impl(n) == "mosaic_gpu" for n in FORWARD_STAGES))


def segmented(layout: Layout, pieces: int | None = None):
  """layout -> (the layout of `pieces` sequences over the same tokens, the other sequence starts
  [N] int32 (T where a start is a piece's): the resets, where the gate is taken as -inf
  (`reset_gates`; the packed kernels take them as `segment_rows`). Piece j starts at the first
  sequence start at or after j * ceil(end / pieces) (end: the last sequence's end); pieces may be
  empty. Starts at T (empty sequences at the end) are dropped."""
  P = SEGMENT_PIECES if pieces is None else pieces
  starts, ends = layout.starts, layout.starts + layout.lens
  concrete = shapes.is_concrete(starts) and shapes.is_concrete(ends)
  xp = np if concrete else jnp
  starts, end = xp.asarray(starts, xp.int32), xp.asarray(ends[-1], xp.int32)
  step = (end + P - 1) // P
  queries = xp.arange(P, dtype=xp.int32) * step
  at = np.searchsorted(starts, queries, side="left") if concrete else padding.search_left(starts, queries)
  first = xp.where(at < starts.shape[0], starts[xp.minimum(at, starts.shape[0] - 1)], end)
  first = xp.minimum(first, end).astype(xp.int32)
  lens = xp.diff(xp.concatenate([first, end.reshape(1)])).astype(xp.int32)
  reset = jnp.where(jnp.isin(jnp.asarray(starts), jnp.asarray(first)), layout.T, jnp.asarray(starts))
  return padding.make_layout(first, lens, layout.T, layout.chunk_size), reset.astype(jnp.int32)


def reset_gates(g, resets):
  """Packed g [1, T, HV, K] with -inf at a segmented layout's resets (`segmented`): what the
  unpacked paths run on (the gate stage floors it to -128: no decay crosses them)."""
  return g.at[0, resets].set(-jnp.inf, mode="drop")


def segment_rows(layout: Layout, resets) -> jax.Array:
  """[2, Ta] float32 per aligned row of a segmented layout (`resets`: segmented()'s second result):
  [0] n, the resets among its chunk's tokens up to it; [1] the chunk row where its segment starts
  (0 for the chunk's first segment). Rows past a chunk's tokens take its last token's values, the
  tail's are 0. The intra kernels mask their pairs to n_i == n_j (j >= start_i) and add 128 n to
  gc_int, which takes the resets' -128 steps out of their decays (exact integers)."""
  BT, T = layout.chunk_size, layout.T
  rows = padding.chunk_rows(layout)
  ind = jnp.zeros((T + 1,), jnp.int32).at[resets].set(1, mode="drop")[:T]   # empty sequences repeat a start
  before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ind)])     # resets in [0, t)
  r = jnp.minimum(jnp.arange(BT, dtype=jnp.int32)[None], jnp.maximum(rows.count - 1, 0)[:, None])
  pos = rows.src[:, None] + r                                                  # [NTa, BT], < T
  live = (rows.count > 0)[:, None]
  n = jnp.where(live, before[pos + 1] - before[rows.src][:, None], 0)
  at = jnp.where(live & (ind[jnp.minimum(pos, T - 1)] > 0), r, 0)              # the row of a reset
  start = lax.cummax(at, axis=1)
  return jnp.stack([n.reshape(-1), start.reshape(-1)]).astype(jnp.float32)


# Whether the packed backward's S2 terms kernel reads do packed (the align folded into its load:
# the same bf16 values as the walk's aligned do), so that the aligned do dies after the walk, before
# the backward's memory peak (S2's terms kernel on shape A). On the H200
# the same bits as the aligned do (shapes A, B) and 132 MiB less temp on A, 248 on B.
PACKED_DO = True

# Stages whose mosaic_gpu kernel has passed the simulator and the CUDA lowering but not yet
# tools.gpu_check on an H200: impl=None leaves them out (an explicit impl="mosaic_gpu" runs them).
DEVICE_UNVERIFIED: frozenset[str] = frozenset()


def default_impls(names, backend: str | None = None, hopper: bool | None = None) -> dict[str, str]:
  """Per stage the fastest the platform runs: mosaic_gpu on sm_90 where the stage has it (and it is
  not in DEVICE_UNVERIFIED), else pallas on a GPU where it has a kernel, else the jnp reference (on a
  CPU kernels only interpret). A mosaic_gpu or pallas choice made here falls back at call time when
  the kernel's `supports` predicate refuses the call (`_run`)."""
  backend = backend or jax.default_backend()
  hopper = is_hopper() if hopper is None and backend == "gpu" else bool(hopper)
  out = {}
  for n in names:
    st = stages.get(n)
    if backend != "cpu" and hopper and st.mosaic_gpu is not None and n not in DEVICE_UNVERIFIED:
      out[n] = "mosaic_gpu"
    elif backend != "cpu" and st.pallas is not None:
      out[n] = "pallas"
    else:
      out[n] = "reference"
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call (hashable: it keys the jit cache)."""
  scale: float
  chunk_size: int
  use_qk_l2norm: bool
  use_gate_in_kernel: bool
  lower_bound: float | None
  impls: tuple[tuple[str, str], ...]
  interpret: bool
  strict: tuple[str, ...] = ()   # stages an impl dict named: a refusing `supports` is an error there
  auto: bool = True              # impl=None: a refused kernel gives way to the next backend, else to the reference
  zero_initial_state: bool = False  # h0 is zeros made by the api (its gradient is dropped): kernels skip it
  final_state_unused: bool = False  # the caller drops the final state (so its cotangent is zero)

  def impl(self, name: str) -> str:
    return dict(self.impls)[name]

  def state_kwargs(self) -> dict[str, bool]:
    """The forward state kernels' switches: {} unless a state is elided."""
    kw = {}
    if self.zero_initial_state:
      kw["zero_h0"] = True
    if self.final_state_unused:
      kw["store_final"] = False
    return kw


def make_plan(*, scale, chunk_size, use_qk_l2norm=False, use_gate_in_kernel=False, lower_bound=None,
              impl=None, interpret=None, zero_initial_state=False, final_state_unused=False) -> Plan:
  names = stages.names()
  impls = resolve(impl, names, default_impls(names), {n: stages.get(n).implementations() for n in names})
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  strict = tuple(sorted(impl)) if isinstance(impl, dict) else ()
  return Plan(float(scale), int(chunk_size), bool(use_qk_l2norm), bool(use_gate_in_kernel),
              None if lower_bound is None else float(lower_bound), tuple(sorted(impls.items())),
              bool(interpret), strict, impl is None, bool(zero_initial_state), bool(final_state_unused))


def choose(plan: Plan, name: str, *args, **kwargs) -> str:
  """The implementation stage `name` runs on these arguments: the plan's, unless its `supports`
  predicate refuses them; then a ValueError with the predicate's reason where an impl dict named
  the stage, the reference where a string impl asked for the backend, and with impl=None the next
  of mosaic_gpu -> pallas -> reference that the stage has and takes them."""
  st = stages.get(name)
  impl = plan.impl(name)
  order = ("mosaic_gpu", "pallas", "reference")
  for cand in order[order.index(impl):] if plan.auto else (impl, "reference"):
    if getattr(st, cand) is None:
      continue
    pred = (st.supports or {}).get(cand)
    why = None if pred is None else pred(*args, **kwargs)
    if why is None:
      return cand
    if name in plan.strict:
      raise ValueError(f"impl[{name!r}] = {impl!r}: {why}")
  return "reference"


def fused_kernel(plan: Plan, group: tuple[str, ...], first_args, *args, **kwargs):
  """The fused kernel of `group` for this call, or None: every member must select the same backend
  (the first member decided on `first_args`, the others by the plan: their inputs exist only
  unfused) and the group's predicate must take `args`, `kwargs`. Record mode never fuses; impl=None
  leaves the groups of UNVERIFIED_GROUPS unfused."""
  if plan.auto and group in UNVERIFIED_GROUPS:
    return None
  kw = forward_kwargs if group[0] in FORWARD_STAGES else backward_kwargs
  first = choose(plan, group[0], *first_args, **kw(plan, group[0]))
  if any(plan.impl(n) != first for n in group[1:]):
    return None
  kernel, takes = FUSED.get(group, {}).get(first, (None, None))
  if kernel is None or takes(*args, **kwargs) is not None:
    return None
  return kernel


def o_dtype(v):
  """The dtype a fused kernel stores o in: v's where that is bf16 (o ends in it), else float32."""
  return jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32


def l2norm(x):
  """x / sqrt(sum(x**2, -1) + 1e-6) in float32, back in x's dtype."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def scope(name: str):
  """The name scope of a pipeline piece (kda.<stage>, kda.state+output, ...): XLA's ops and the
  kernels of that piece carry it in profiles (tools.profile groups the device time by it)."""
  return jax.named_scope(f"kda.{name}")


def _run(plan: Plan, name: str, *args, **kwargs):
  with scope(name):
    return stages.get(name)(choose(plan, name, *args, **kwargs), *args, interpret=plan.interpret, **kwargs)


def forward_kwargs(plan: Plan, name: str) -> dict[str, Any]:
  """The static keyword arguments forward() passes to stage `name` (tools.stages reuses them)."""
  BT = plan.chunk_size
  return {
      "gate": dict(chunk_size=BT, use_gate_in_kernel=plan.use_gate_in_kernel, lower_bound=plan.lower_bound),
      "intra": dict(scale=plan.scale, chunk_size=BT),
      "state": dict(chunk_size=BT),
      "output": dict(scale=plan.scale, chunk_size=BT),
  }[name]


def prepare(plan: Plan, layout: Layout, q, k, v, g, beta):
  """Packed [1, T, ...] inputs -> aligned, l2-normalised, head-mapped, gate-neutralised inputs.
  g None: not aligned (a kernel reads it packed), None returned in its place."""
  q, k, v, beta = (padding.align_with(layout, x) for x in (q, k, v, beta))
  valid = padding.valid_mask(layout)[None]                       # [1, Ta]
  q, k = _query_keys(plan, q, k, v.shape[2])                     # after align: padding stays 0
  if g is not None:
    g = padding.align_with(layout, g)
    if plan.use_gate_in_kernel:
      g = padding.neutralize_gate(g, valid)
  return q, k, v, g, beta, valid


def _query_keys(plan: Plan, q, k, HV):
  """prepare's per-token steps on q, k, aligned or packed: use_qk_l2norm (a zero row stays zero),
  then the GVA repeat (value head j reads head j // (HV // H))."""
  if plan.use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  rep = HV // q.shape[2]
  if rep > 1:
    q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
  return q, k


def packed_forward(plan: Plan, layout: Layout, q, k, v, g, beta, initial_state, A_log, dt_bias, resets=None):
  """The whole forward as the fused group PACKED, or None where it does not apply: every forward
  stage selects mosaic_gpu on this call and each packed kernel takes it. The kernels fold align and
  unalign into their loads and stores (kda.padding.ChunkRows places each aligned chunk in the packed
  buffer): the gate and intra kernels read the packed inputs, the fused state + output kernel writes
  o packed. Same arithmetic as the unfused mosaic_gpu stages on the aligned inputs. resets (a
  segmented layout's, `segmented`): the gate and intra kernels take segment_rows, so that a chunk
  holding a reset keeps intra's bounded path; the same o up to rounding.
  -> (o [1, T, HV, V], final_state, records {"intra": ...}) or None."""
  if any(plan.impl(n) != "mosaic_gpu" for n in FORWARD_STAGES):
    return None
  S = jax.ShapeDtypeStruct
  HV, Ta, BT = v.shape[2], layout.Ta, plan.chunk_size
  aligned = lambda x: S((1, Ta) + x.shape[2:], x.dtype)          # what prepare would hand the stages
  qs = S((1, Ta, HV, q.shape[3]), q.dtype)
  gi = S((1, Ta, HV, k.shape[3]), jnp.float32)
  gate_args = (aligned(g), S((1, Ta), jnp.bool_), A_log, dt_bias)
  intra_args = (qs, qs, aligned(v), aligned(beta), gi, gi, layout.aligned_cu)
  if (choose(plan, "gate", *gate_args, **forward_kwargs(plan, "gate")) != "mosaic_gpu"
      or choose(plan, "intra", *intra_args, **forward_kwargs(plan, "intra")) != "mosaic_gpu"):
    return None
  bf = lambda d: S((1, Ta, HV, d), jnp.bfloat16)
  K, V = k.shape[3], v.shape[3]
  state_args = (bf(K), bf(K), bf(V), gi, gi, initial_state, layout.aligned_cu)
  fused = fused_kernel(plan, ("state", "output"), state_args, bf(K), bf(K), bf(V), bf(K), bf(BT),
                       *state_args[3:], chunk_size=BT)
  if fused is None:
    return None
  rows = padding.chunk_rows(layout)
  gkw = forward_kwargs(plan, "gate")
  if gate_mgpu.packed_takes(g, rows, A_log, dt_bias, **gkw) is not None:
    return None
  with scope("prepare"):
    q, k = _query_keys(plan, q, k, HV)
  if intra_mgpu.packed_supports(q, k, v, beta, gi, gi, layout.aligned_cu, rows, **forward_kwargs(plan, "intra")):
    return None
  tail = {} if TAIL_ZEROS else dict(tail_zeros=False)   # only this group's kernels read the tail's gc,
  ikw = forward_kwargs(plan, "intra")                   # Akk, qg, kg, w, u (they skip it)
  gc_int = gc_frac = decay = None
  seg = {} if resets is None else dict(seg=segment_rows(layout, resets))
  defer = dict(defer=True) if INVERSE_IN_STATE else {}
  if FUSE_GATE_INTRA and not seg and gate_intra.takes(q, k, v, beta, g, layout.aligned_cu, rows, **{**ikw, **gkw}) is None:
    with scope("gate+intra"):
      it, decay = gate_intra.mosaic_gpu(q, k, v, beta, g, layout.aligned_cu, rows, interpret=plan.interpret,
                                        **ikw, **tail, **defer)
  else:
    with scope("gate"):
      gc_int, gc_frac, bounded, two_part = gate_mgpu.packed(g, rows, A_log, dt_bias, interpret=plan.interpret,
                                                            **gkw, **tail, **seg)
    with scope("intra"):
      it = intra_mgpu.packed(q, k, v, beta, gc_int, gc_frac, layout.aligned_cu, rows, bounded=bounded,
                             two_part=two_part, interpret=plan.interpret, **ikw, **tail, **seg, **defer)
  if defer:       # the state + output kernel applies Ainv: kd and beta v in place of w, u
    it, dfr = it
    w, u, inv = dfr.kd, dfr.bv, dict(inverse=(it.Ainv, dfr.ainv_lo))
  else:
    w, u, inv = it.w, it.u, {}
  with scope("state+output"):
    o, final_state = fused(it.kg, w, u, it.qg, it.Aqk, gc_int, gc_frac, initial_state, layout.aligned_cu,
                           scale=plan.scale, chunk_size=BT, interpret=plan.interpret, out_dtype=o_dtype(v),
                           rows=rows, T=layout.T, decay=decay, **inv, **plan.state_kwargs())
  return o.astype(v.dtype), final_state, {"intra": it}


def forward(plan: Plan, layout: Layout, q, k, v, g, beta, initial_state, A_log, dt_bias, *,
            record: bool = False, packed: bool = True, resets=None):
  """Packed inputs [1, T, ...] -> (o [1, T, HV, V] in v's dtype, final_state [N, HV, K, V] f32, records).

  records maps each stage name to its output record (and "valid" to the [1, Ta] real-token mask,
  "inputs" to {stage: positional args}, the keywords being forward_kwargs) when `record` is set,
  else it holds "intra" alone (what saved() reads). Record mode runs every stage unfused; otherwise
  the fused group PACKED (packed_forward) runs where it applies, unless `packed` is False (the same
  kernels on the aligned layout: tools.gpu_check compares the two). resets: a segmented layout's
  (`segmented`): the packed kernels take them as segment_rows, the other paths as -inf gates.
  """
  if packed and not record:
    out = packed_forward(plan, layout, q, k, v, g, beta, initial_state, A_log, dt_bias, resets)
    if out is not None:
      return out
  if resets is not None:
    g = reset_gates(g, resets)
  with scope("prepare"):
    q, k, v, g, beta, valid = prepare(plan, layout, q, k, v, g, beta)
  inputs = {}

  def run(name, *args):
    inputs[name] = args
    return _run(plan, name, *args, **forward_kwargs(plan, name))

  gt = run("gate", g, valid, A_log, dt_bias)
  it = run("intra", q, k, v, beta, gt.gc_int, gt.gc_frac, layout.aligned_cu)
  state_args = (it.kg, it.w, it.u, gt.gc_int, gt.gc_frac, initial_state, layout.aligned_cu)
  fused = None if record else fused_kernel(plan, ("state", "output"), state_args,
                                           it.kg, it.w, it.u, it.qg, it.Aqk, *state_args[3:],
                                           chunk_size=plan.chunk_size)
  if fused is not None:        # h and v_new never leave the kernel
    with scope("state+output"):
      o, final_state = fused(it.kg, it.w, it.u, it.qg, it.Aqk, *state_args[3:], scale=plan.scale,
                             chunk_size=plan.chunk_size, interpret=plan.interpret, out_dtype=o_dtype(v),
                             **plan.state_kwargs())
  else:
    st = run("state", *state_args)
    ot = run("output", it.qg, st.h, it.Aqk, st.v_new)
    o, final_state = ot.o, st.final_state
  with scope("unalign"):
    o = padding.unalign_with(layout, o).astype(v.dtype)
  records: dict[str, Any] = {"intra": it}          # what saved() reads
  if record:
    records = {"valid": valid, "gate": gt, "intra": it, "state": st, "output": ot, "inputs": inputs}
  return o, final_state, records


class Saved(NamedTuple):
  """What the custom VJP keeps of the forward besides its inputs: O(T * BT) per head, no state."""
  Aqk: jax.Array   # [1, Ta, HV, BT] intra's dtype (bf16 from kernels for bf16 inputs)
  Ainv: jax.Array  # [1, Ta, HV, BT] (I + Akk)^-1, intra's dtype


class Grads(NamedTuple):
  """Cotangents of forward's inputs, each like its input (None where the input is None)."""
  q: jax.Array              # [1, T, H, K]
  k: jax.Array              # [1, T, H, K]
  v: jax.Array              # [1, T, HV, V]
  g: jax.Array              # [1, T, HV, K]
  beta: jax.Array           # [1, T, HV]
  initial_state: jax.Array  # [N, HV, K, V] float32
  A_log: jax.Array | None   # [HV]
  dt_bias: jax.Array | None  # [HV * K]


def saved(records) -> Saved:
  """The residuals of a forward() call (its records, with or without record=True)."""
  return Saved(records["intra"].Aqk, records["intra"].Ainv)


def backward_kwargs(plan: Plan, name: str) -> dict[str, Any]:
  """The static keyword arguments backward() passes to stage `name`."""
  BT, scale = plan.chunk_size, plan.scale
  zero_h0 = dict(zero_h0=True) if plan.zero_initial_state else {}   # S0's state kernel skips h0
  dh = {}                                      # the walk skips a zero dht and a dropped dh0
  if plan.zero_initial_state:
    dh["need_dh0"] = False
  if plan.final_state_unused:
    dh["dht_zero"] = True
  return {
      "bwd_recompute": dict(chunk_size=BT, use_gate_in_kernel=plan.use_gate_in_kernel,
                            lower_bound=plan.lower_bound, **zero_h0),
      "bwd_dav": dict(chunk_size=BT),
      "bwd_dh": dict(scale=scale, chunk_size=BT, **dh),
      "bwd_wy": dict(chunk_size=BT),
      "bwd_intra": dict(scale=scale, chunk_size=BT),
      "bwd_gate": dict(chunk_size=BT, use_gate_in_kernel=plan.use_gate_in_kernel, lower_bound=plan.lower_bound),
  }[name]


class PackedRows(NamedTuple):
  """Where the packed backward's kernels read and store packed rows."""
  rows: padding.ChunkRows   # padding.chunk_rows(layout)
  pieces: jax.Array         # padding.gap_pieces: the packed rows of no sequence, in <= BT pieces


def packed_backward_rows(plan: Plan, layout: Layout, q, k, v, g, beta, A_log, dt_bias, initial_state):
  """PackedRows where the backward runs packed, else None: S0 and S5 select mosaic_gpu on the
  aligned call and their packed modes take it. Packed, g is never aligned (S0's gate kernel reads
  it packed, S5 reads it and stores dg packed) and S3 (dv), S4 (dq, dk) store their gradients
  packed where they select their kernels: no XLA pass unaligns them."""
  if plan.impl("bwd_recompute") != "mosaic_gpu" or plan.impl("bwd_gate") != "mosaic_gpu":
    return None
  S = jax.ShapeDtypeStruct
  Ta, HV = layout.Ta, v.shape[2]
  aligned = lambda x, d=None: S((1, Ta) + x.shape[2:], d or x.dtype)
  qs = S((1, Ta, HV, q.shape[3]), q.dtype)
  ga, valid, gc = aligned(g), S((1, Ta), jnp.bool_), aligned(g, jnp.float32)
  rc_args = (qs, qs, aligned(v), ga, aligned(beta), valid, A_log, dt_bias, None, initial_state, layout.aligned_cu)
  if (choose(plan, "bwd_recompute", *rc_args, **backward_kwargs(plan, "bwd_recompute")) != "mosaic_gpu"
      or choose(plan, "bwd_gate", ga, valid, A_log, dt_bias, gc, gc, **backward_kwargs(plan, "bwd_gate"))
      != "mosaic_gpu"):
    return None
  rows = padding.chunk_rows(layout)
  pieces = padding.gap_pieces(rows, layout.aligned_cu, layout.T, plan.chunk_size)
  if bwd_gate_mgpu.packed_supports(g, rows, pieces, A_log, dt_bias, gc, gc, **backward_kwargs(plan, "bwd_gate")):
    return None
  return PackedRows(rows, pieces)


def backward(plan: Plan, layout: Layout, q, k, v, g, beta, initial_state, A_log, dt_bias, saved: Saved,
             do, dht, *, record: bool = False, packed: bool = True, resets=None):
  """Cotangents of forward's (o [1, T, HV, V], final_state [N, HV, K, V]) -> (Grads, records).

  Takes forward's inputs and `saved` (Aqk, Ainv); S0 recomputes the rest. Memory: the
  [NTa, HV, K, V] buffers of the backward are S0's h (the state entering each chunk) and, in S2's
  Mosaic GPU kernels, the state cotangent per chunk in bf16 (the reference S2 carries it in its
  scan instead). S2 hands S3 everything that needs h or that cotangent as O(T * K) terms (dqg, dkg,
  dw, du) and O(NTa * K) ones (dgc_last). `do` may hold anything (even NaN) at
  tokens of no sequence: they are never read. records is as in forward (stage outputs and
  "inputs") when `record` is set, else empty. Outside record mode the backward runs packed where
  `packed_backward_rows` says so (the same bits; `packed=False` keeps the aligned layout). resets: as
  in forward: segment_rows for the packed backward's S0 gate kernel, S4 and S5, else -inf gates
  (whose gradient the gate stage's floor makes 0, the true one: they decay a zero state).
  """
  pk = None
  if packed and PACKED_BACKWARD and not record:
    pk = packed_backward_rows(plan, layout, q, k, v, g, beta, A_log, dt_bias, initial_state)
  seg = {}
  if resets is not None and pk is not None:
    seg = dict(seg=segment_rows(layout, resets))
  elif resets is not None:
    g = reset_gates(g, resets)
  with scope("prepare"):
    if pk is None:
      (qa, ka, va, ga, ba), prepare_vjp = jax.vjp(lambda *x: prepare(plan, layout, *x)[:5], q, k, v, g, beta)
    else:   # packed backward: g stays packed (S0's gate kernel and S5 read it there), and the kernels
      # that can store dq, dk (S4), dv (S3), dg (S5) packed do: the unalign folds into their stores
      (qp, kp), qk_vjp = jax.vjp(lambda q, k: _query_keys(plan, q, k, v.shape[2]), q, k)   # per token
      qa, ka, va, ba = (padding.align_with(layout, x) for x in (qp, kp, v, beta))
      ga = g
    valid = padding.valid_mask(layout)[None]
    do_packed = do
    do = padding.align_with(layout, do)       # the transpose of unalign_with; in o's dtype (stages upcast)
  inputs = {}

  def run(name, *args, **extra):
    inputs[name] = args
    return _run(plan, name, *args, **backward_kwargs(plan, name), **extra)

  tail = {} if TAIL_ZEROS else dict(tail_zeros=False)   # the packed backward's unwritten tail

  def packed_kernel(name, *args, **extra):
    """Whether the backward runs packed and stage `name` selects its kernel on these arguments."""
    return pk is not None and choose(plan, name, *args, **backward_kwargs(plan, name), **extra) == "mosaic_gpu"

  def packed_kw(name, *args, store=False, **extra):
    """The packed backward's keywords for stage `name`'s kernel where the call selects it: the
    unwritten tail and, with `store`, its packed output store (rows, pieces, T)."""
    if not packed_kernel(name, *args, **extra):
      return {}
    return dict(tail, **(dict(rows=pk.rows, pieces=pk.pieces, T=layout.T) if store else {}))

  rc_args = (qa, ka, va, ga, ba, valid, A_log, dt_bias, saved.Ainv, initial_state, layout.aligned_cu)
  if pk is None:
    rc = run("bwd_recompute", *rc_args)
  else:
    with scope("bwd_recompute"):
      rc = stages.get("bwd_recompute")("mosaic_gpu", *rc_args, interpret=plan.interpret, rows=pk.rows,
                                       **backward_kwargs(plan, "bwd_recompute"), **tail, **seg)
  av_args = (rc.v_new, saved.Aqk, do, layout.aligned_cu)
  av = run("bwd_dav", *av_args, **packed_kw("bwd_dav", *av_args))
  gc = (rc.gc_int, rc.gc_frac)
  dh_args = (rc.qg, rc.kg, rc.w, *gc, rc.h, rc.v_new, do, av.dv, dht, layout.aligned_cu)
  dh_kw = packed_kw("bwd_dh", *dh_args)
  if PACKED_DO and do_packed.dtype == jnp.bfloat16 and packed_kernel("bwd_dh", *dh_args):
    dh_kw.update(do_packed=do_packed, rows=pk.rows)   # the terms kernel reads do packed
  ds = run("bwd_dh", *dh_args, **dh_kw)
  # S3's dv and S4's dq, dk are the final gradients of the aligned inputs: stored in their dtypes
  # (prepare_vjp rounds them there first anyway; the same bits, half the bytes for bf16 inputs).
  # Record mode keeps float32 stage outputs (what tools.stages and the checks compare).
  dv_dtype = {} if record else dict(dv_dtype=va.dtype)
  grad_dtype = {} if record or qa.dtype != ka.dtype else dict(grad_dtype=qa.dtype)
  wy_args = (qa, ka, va, ba, *gc, saved.Ainv, ds.dqg, ds.dkg, ds.dw, ds.du, ds.dgc_last, layout.aligned_cu)
  wy_kw = packed_kw("bwd_wy", *wy_args, store=True, **dv_dtype)
  wy = run("bwd_wy", *wy_args, **dv_dtype, **wy_kw)
  dh0 = ds.dh0
  it_args = (qa, ka, ba, *gc, av.dAqk, wy.dAkk, wy.dq, wy.dk, wy.dbeta, wy.dgc, layout.aligned_cu)
  it_kw = packed_kw("bwd_intra", *it_args, store=True, **grad_dtype)
  if it_kw:
    it_kw.update(seg)
  it = run("bwd_intra", *it_args, **grad_dtype, **it_kw)
  if pk is None:
    gt = run("bwd_gate", ga, valid, A_log, dt_bias, it.dgc, wy.dg_state)
  else:           # dg packed in g's dtype, zeros at tokens of no sequence
    with scope("bwd_gate"):
      gt = bwd_gate_mgpu.packed(g, pk.rows, pk.pieces, A_log, dt_bias, it.dgc, wy.dg_state,
                                interpret=plan.interpret, **backward_kwargs(plan, "bwd_gate"), **seg)
  like = lambda d, x: None if x is None else d.astype(x.dtype)
  with scope("prepare_vjp"):
    if pk is None:
      dq, dk, dv, dg, dbeta = prepare_vjp(tuple(like(d, x) for d, x in zip(
          (it.dq, it.dk, wy.dv, gt.dg, it.dbeta), (qa, ka, va, ga, ba))))
    else:         # what a kernel did not store packed is unaligned here (align's transpose)
      unalign = lambda d, kw: d if "rows" in kw else padding.unalign_with(layout, d)
      dq, dk = qk_vjp((like(unalign(it.dq, it_kw), qp), like(unalign(it.dk, it_kw), kp)))
      if plan.use_qk_l2norm:    # its backward at tokens of no sequence (any q, k there: NaN) gives 0
        owned = padding.packed_owned_mask(layout)[None, :, None, None]
        dq, dk = (jnp.where(owned, d, jnp.zeros((), d.dtype)) for d in (dq, dk))
      dv = like(unalign(wy.dv, wy_kw), v)
      dg, dbeta = like(gt.dg, g), like(unalign(it.dbeta, {}), beta)
  grads = Grads(dq, dk, dv, dg, dbeta, dh0, like(gt.dA_log, A_log), like(gt.ddt_bias, dt_bias))
  records: dict[str, Any] = {}
  if record:
    records = {"valid": valid, "bwd_recompute": rc, "bwd_dav": av, "bwd_dh": ds, "bwd_wy": wy,
               "bwd_intra": it, "bwd_gate": gt, "inputs": inputs}
  return grads, records
