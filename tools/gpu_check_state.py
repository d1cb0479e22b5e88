"""python -m tools.gpu_check_state: compile, check and time the Mosaic GPU state, output and fused
state -> output kernels (H200).

  python -m tools.gpu_check_state [--parts state,output,fused] [--cases long,short] [--reps 20]
      [--variants default,...] [--output-variants default,...] [--fused-variants serial,...]
  CPU smoke run (simulator, small; minutes): python -m tools.gpu_check_state --interpret --total 300
      --reps 1 --cases long --no-emulation

Cases (H = HV = 16, K = V = 128, T = 32768 packed, lengths drawn as tools.bench does, seed 0):
  long   16 sequences, lengths uniform in [64, 4096]
  short  489 sequences, lengths uniform in [1, 128]
Two input sets per case, same layout: "recorded", the stages' real inputs from the reference
pipeline on tools.trace data (tools.stages.record_reference; strong gates, so little state carries
between chunks), and "synthetic", delta-rule-like inputs with slow gates (the state carries across
all 64 chunks of a long sequence; qg and Aqk random, zero at padding). Timings are the median ms
over --reps calls after 3 warm-up calls (block_until_ready around each), after lower + compile
(its time printed too). Each part runs in its own try/except; the parts (--parts):

state: the jitted reference, the Triton kernel (kda.stages.state.pallas) and each Mosaic Config
  variant (--variants), the latter with float32 inputs (the launcher's bf16 casts included, h and
  v_new stored float32) and with bf16 inputs (h and v_new stored bf16, the dtype policy); max
  relative errors max|d| / max|ref| (and ||d|| / ||ref||) of h, v_new, final_state against the
  reference on float32 inputs and on bf16-rounded inputs (the kernel's rounding of S and v_new is
  what is left, ~1e-3 in the simulator), and against a float32 numpy emulation of the kernel's
  rounding (only summation order left: <= 1e-4 expected; more means a kernel bug); whether the
  tail (chunks past aligned_cu[-1]) is exactly 0.
output: on the recorded output inputs (qg, h, Aqk, v_new) cast to bf16, each Mosaic output Config
  variant (--output-variants) against the reference on the same bf16 values (float32 summation
  order left, ~1e-6; a bf16 o adds 2^-8) and timed next to the reference and the Triton kernel (on
  the float32 inputs, as the pipeline runs it today).
fused: the fused state -> output kernel (kda.fused.state_output), each variant (--fused-variants)
  on bf16 kg, w, u, qg, Aqk, timed against the unfused pair it replaces (Mosaic state with bf16 h,
  v_new, then Mosaic output, jitted together; and Triton state then Triton output on float32); o
  and final_state against the composed references on bf16-rounded inputs (~1e-3) and against the
  unfused Mosaic pair (same roundings: ~1e-6 expected; more means a kernel bug); o past
  aligned_cu[-1] exactly 0.
A watchdog (faulthandler) ends the process if one part hangs longer than --part-timeout seconds.
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kda.fused.state_output import mosaic_gpu as fso
from kda.stages.output import mosaic_gpu as mgo
from kda.stages.state import mosaic_gpu as mgs
from tools import bench
from tools.bench import varlen_lens

BT, H, K, V, TOTAL = 64, 16, 128, 128, 32768
CASES = {"long": (64, 4096), "short": (1, 128)}


def say(*a):
  print(*a, flush=True)


def reference_fn():
  from kda.stages import state
  return state.reference.apply


def triton_fn():
  from kda.stages import state
  return state.pallas.apply


def recorded_inputs(lens, interpret=False):
  """The state and output stages' inputs of the reference pipeline: (state args, output args)."""
  from tools.stages import record_reference
  _, rec, _ = record_reference(lens, head_dim=K, heads=H, dtype="bfloat16", gate="plain", interpret=interpret)
  return tuple(rec["inputs"]["state"]), tuple(rec["inputs"]["output"])


def synthetic_qa(acu, lens, Ta, seed=1):
  """qg [1, Ta, H, K] ~ randn / sqrt(K) and a causal Aqk [1, Ta, H, BT] ~ randn / 8, zero at padding."""
  valid = np.zeros(Ta, bool)
  for n, L in enumerate(lens):
    valid[acu[n]:acu[n] + L] = True
  ks = jax.random.split(jax.random.key(seed), 2)
  m = jnp.asarray(valid)[None, :, None, None]
  qg = jnp.where(m, jax.random.normal(ks[0], (1, Ta, H, K)) / np.sqrt(K), 0.0)
  causal = (np.arange(Ta) % BT)[:, None] >= np.arange(BT)[None, :]
  pair = jnp.asarray(causal & valid.reshape(-1, BT).repeat(BT, 0))[None, :, None, :]
  Aqk = jnp.where(m & pair, jax.random.normal(ks[1], (1, Ta, H, BT)) / 8, 0.0)
  return qg, Aqk


def synthetic_inputs(lens, Ta=None, seed=0):
  """Delta-rule-like inputs with slow gates, so the state carries across many chunks: unit-norm k,
  beta in (0, 1/4), w = beta k exp(gc), kg = k exp(gc_last - gc) (the WY inverse left out), gates
  log_sigmoid(randn) / 64 (chunk decay ~0.45) with 5% of the channels at log_sigmoid(randn)."""
  alens = [-(-L // BT) * BT for L in lens]
  acu = np.concatenate([[0], np.cumsum(alens)]).astype(np.int32)
  Ta = Ta or -(-(int(acu[-1]) + BT) // 1024) * 1024
  valid = np.zeros(Ta, bool)
  for n, L in enumerate(lens):
    valid[acu[n]:acu[n] + L] = True
  m = jnp.asarray(valid)[None, :, None, None]
  ks = jax.random.split(jax.random.key(seed), 6)
  k = jax.random.normal(ks[0], (1, Ta, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = jax.random.uniform(ks[1], (1, Ta, H, 1), maxval=0.25)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[2], (1, Ta, H, K)))
  strong = jax.random.uniform(ks[5], (1, 1, H, K)) < 0.05
  g = jnp.where(m, jnp.where(strong, g, g / 64), 0.0)
  gc = jnp.cumsum(g.reshape(1, Ta // BT, BT, H, K), axis=2).reshape(1, Ta, H, K)
  last = jnp.repeat(gc[:, BT - 1::BT], BT, axis=1)
  kg = jnp.where(m, k * jnp.exp(last - gc), 0.0)
  w = jnp.where(m, beta * k * jnp.exp(gc), 0.0)
  u = jnp.where(m, jax.random.normal(ks[3], (1, Ta, H, V)), 0.0)
  gi = jnp.floor(gc)
  h0 = jax.random.normal(ks[4], (len(lens), H, K, V))
  return kg, w, u, gi, gc - gi, h0, jnp.asarray(acu)


def _bf16_round(x):
  """float32 -> nearest bf16 (ties to even) -> float32, in numpy."""
  b = np.ascontiguousarray(x, np.float32).view(np.uint32)
  b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
  return b.view(np.float32)


def emulate(args):
  """The kernel's arithmetic in float32 numpy (S and v_new rounded to bf16 where they enter the dots,
  inputs rounded to bf16), all heads at once: against it only summation order is left."""
  kg, w, u = (_bf16_round(np.asarray(x, np.float32)[0]) for x in args[:3])    # [Ta, HV, D]
  gi, gf = (np.asarray(x, np.float32)[0, BT - 1::BT] for x in args[3:5])
  decay = np.exp(gi + gf)                                                      # [NTa, HV, K]
  h0, acu = np.asarray(args[5], np.float32), np.asarray(args[6]).astype(int)
  NTa = decay.shape[0]
  h = np.zeros((NTa,) + h0.shape[1:], np.float32)
  v_new = np.zeros(u.shape, np.float32)
  final = h0.copy()
  for n in range(len(acu) - 1):
    S = h0[n]                                                                  # [HV, K, V]
    for c in range(acu[n] // BT, acu[n + 1] // BT):
      rows = slice(c * BT, (c + 1) * BT)
      h[c] = S
      v = u[rows].transpose(1, 0, 2) - w[rows].transpose(1, 0, 2) @ _bf16_round(S)   # [HV, BT, V]
      v_new[rows] = v.transpose(1, 0, 2)
      S = decay[c][:, :, None] * S + kg[rows].transpose(1, 2, 0) @ _bf16_round(v)
    final[n] = S
  return h[None], v_new[None], final


def timeit(fn, args, reps):
  return bench.timeit(fn, *args, reps=reps)


def compile_timed(f, args):
  t0 = time.perf_counter()
  c = jax.jit(f).lower(*args).compile()
  return c, time.perf_counter() - t0


def errors(out, ref):
  res = {}
  for name, a, b in zip(("h", "v_new", "final_state"), out, ref):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = np.abs(a - b)
    res[name] = (float(d.max() / max(np.abs(b).max(), 1e-30)),
                 float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
                 bool(np.isfinite(a).all()))
  return res


def fmt(errs):
  return "  ".join(f"{k}: max {e[0]:.3e} norm {e[1]:.3e}{'' if e[2] else ' NONFINITE'}"
                   for k, e in errs.items())


def tail_is_zero(out, acu, Ta):
  c0, t0 = int(acu[-1]) // BT, int(acu[-1])
  return bool((np.asarray(out.h[:, c0:]) == 0).all() and (np.asarray(out.v_new[:, t0:]) == 0).all()), Ta - t0


class Part:
  """A try/except around one part that also arms the hang watchdog."""

  def __init__(self, label, timeout):
    self.label, self.timeout = label, timeout

  def __enter__(self):
    faulthandler.dump_traceback_later(self.timeout, exit=True)
    return self

  def __exit__(self, typ, exc, tb):
    faulthandler.cancel_dump_traceback_later()
    if exc is not None:
      say(f"  [{self.label}] FAILED: {typ.__name__}: {str(exc)[:3000]}")
      traceback.print_exception(typ, exc, tb, limit=-4)
      sys.stdout.flush()
    return True


def build_inputs(lens, part_timeout, interpret):
  """{set name: state args}, {set name: output args (qg, h, Aqk, v_new)} (recorded only) and
  {set name: (qg, Aqk)}."""
  sets, outs, qa = {}, {}, {}
  with Part("recorded inputs", part_timeout):
    t0 = time.perf_counter()
    sets["recorded"], outs["recorded"] = jax.block_until_ready(recorded_inputs(lens, interpret))
    qa["recorded"] = (outs["recorded"][0], outs["recorded"][2])
    say("  recorded inputs (tools.stages.record_reference, reference pipeline on tools.trace data): "
        + ", ".join(f"{x.shape}{x.dtype}" for x in sets["recorded"]) + f" ({time.perf_counter() - t0:.1f}s)")
  with Part("synthetic inputs", part_timeout):
    Ta = sets["recorded"][0].shape[1] if "recorded" in sets else None
    sets["synthetic"] = jax.block_until_ready(synthetic_inputs(lens, Ta))
    acu = np.asarray(sets["synthetic"][6])
    qa["synthetic"] = jax.block_until_ready(synthetic_qa(acu, lens, sets["synthetic"][0].shape[1]))
    if "recorded" in sets and not np.array_equal(np.asarray(sets["recorded"][6]), acu):
      say("  note: recorded and synthetic layouts differ")
  return sets, outs, qa


def run_case(case, reps, part_timeout, variants, total=TOTAL, interpret=False, emulation=True,
             parts=("state",), output_variants=(), fused_variants=()):
  lens = varlen_lens(total, *CASES[case])
  say(f"\n=== case {case}: N={len(lens)} sequences, T={sum(lens)}, H={H}, K={K}, V={V}")
  sets, outs, qa = build_inputs(lens, part_timeout, interpret)
  if not sets:
    return
  for name, a in sets.items():
    acu = np.asarray(a[6])
    Ta = a[0].shape[1]
    say(f"  {name}: Ta={Ta}, aligned_cu[-1]={int(acu[-1])}, tail chunks={(Ta - int(acu[-1])) // BT}")
  if "state" in parts:
    say("\n  --- state")
    state_part(sets, reps, part_timeout, variants, interpret, emulation)
  if "output" in parts and outs:
    say("\n  --- output")
    output_part(outs, reps, part_timeout, output_variants, interpret)
  if "fused" in parts:
    say("\n  --- fused state -> output")
    fused_part(sets, qa, reps, part_timeout, fused_variants, interpret)


def state_part(sets, reps, part_timeout, variants, interpret, emulation):
  bf = lambda x: x.astype(jnp.bfloat16)
  input_forms = lambda a: (a, tuple(bf(x).astype(jnp.float32) for x in a[:3]) + tuple(a[3:]),
                           tuple(bf(x) for x in a[:3]) + tuple(a[3:]))
  timed = next(iter(sets))                     # time on the first set only (the data does not matter)

  refs = {}
  with Part("reference", part_timeout):
    ref = reference_fn()
    f = jax.jit(lambda *a: ref(*a, chunk_size=BT))
    args = sets[timed]
    c, secs = compile_timed(f, args)
    say(f"  reference (jitted): compile {secs:.2f}s, {timeit(c, args, reps):.3f} ms")
    for name, a in sets.items():
      full, rnd, _ = input_forms(a)
      refs[name] = (jax.block_until_ready(f(*full)), jax.block_until_ready(f(*rnd)))

  emus = {}
  if emulation:
    for name, a in sets.items():
      with Part(f"emulation {name}", part_timeout):
        t0 = time.perf_counter()
        emus[name] = emulate(a)
        say(f"  numpy emulation of the kernel's rounding on {name}: {time.perf_counter() - t0:.1f}s")

  with Part("triton", part_timeout):
    tri = triton_fn()
    f = jax.jit(lambda *a: tri(*a, chunk_size=BT, interpret=interpret))
    args = sets[timed]
    c, secs = compile_timed(f, args)
    say(f"  triton (kda.stages.state.pallas): compile {secs:.2f}s, {timeit(c, args, reps):.3f} ms")
    for name, a in sets.items():
      if name in refs:
        say(f"    {name} vs reference: {fmt(errors(f(*a), refs[name][0]))}")

  for label, cfg in variants:
    with Part(f"mosaic {label}", part_timeout):
      args = sets[timed]
      reason = mgs.supports(*args, chunk_size=BT)
      if reason:
        say(f"  mosaic {label}: supports() refuses: {reason}")
        continue
      f = jax.jit(lambda *a, cfg=cfg: mgs.apply(*a, chunk_size=BT, config=cfg, interpret=interpret))
      c, secs = compile_timed(f, args)
      ms = timeit(c, args, reps)
      args_bf = input_forms(args)[2]
      c_bf, _ = compile_timed(f, args_bf)
      ms_bf = timeit(c_bf, args_bf, reps)
      stored = lambda a: f"h and v_new stored {jnp.dtype(cfg.stores(*a[:3])).name}"
      say(f"  mosaic {label}: compile {secs:.2f}s, {ms:.3f} ms with float32 inputs (launcher casts "
          f"included, {stored(args)}), {ms_bf:.3f} ms with bf16 inputs ({stored(args_bf)})")
      for name, a in sets.items():
        full, rnd, abf = input_forms(a)
        out = jax.block_until_ready(f(*full))
        acu, Ta = np.asarray(a[6]), a[0].shape[1]
        z, ntail = tail_is_zero(out, acu, Ta)
        say(f"    {name}: tail ({ntail} tokens) exactly 0: {z}")
        if name in refs:
          say(f"    {name} vs reference, float32 inputs:      {fmt(errors(out, refs[name][0]))}")
          say(f"    {name} vs reference, bf16 inputs ({stored(abf)}): {fmt(errors(f(*abf), refs[name][1]))}")
        if name in emus:
          say(f"    {name} vs numpy emulation of its rounding: {fmt(errors(out, emus[name]))}")
        empty = np.flatnonzero(np.diff(acu) == 0)
        if empty.size:
          same = bool((np.asarray(out.final_state)[empty] == np.asarray(a[5])[empty]).all())
          say(f"    {name}: empty sequences {empty.tolist()}: final_state == initial_state: {same}")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  d = np.abs(a - b)
  return (float(d.max() / max(np.abs(b).max(), 1e-30)),
          float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), bool(np.isfinite(a).all()))


def _fmt1(name, e):
  return f"{name}: max {e[0]:.3e} norm {e[1]:.3e}{'' if e[2] else ' NONFINITE'}"


def output_part(outs, reps, part_timeout, variants, interpret):
  from kda.stages import output
  scale = K ** -0.5
  for name, a in outs.items():
    a_bf = tuple(x.astype(jnp.bfloat16) for x in a)
    a_rnd = tuple(x.astype(jnp.float32) for x in a_bf)
    with Part(f"output reference {name}", part_timeout):
      f = jax.jit(lambda *x: output.reference.apply(*x, scale=scale, chunk_size=BT))
      c, secs = compile_timed(f, a)
      say(f"  reference (jitted) on {name}: compile {secs:.2f}s, {timeit(c, a, reps):.3f} ms")
      want = jax.block_until_ready(f(*a_rnd)).o
    with Part(f"output triton {name}", part_timeout):
      f = jax.jit(lambda *x: output.pallas.apply(*x, scale=scale, chunk_size=BT, interpret=interpret))
      c, secs = compile_timed(f, a)
      say(f"  triton (kda.stages.output.pallas), float32 inputs: compile {secs:.2f}s, "
          f"{timeit(c, a, reps):.3f} ms; vs reference {_fmt1('o', _rel(f(*a_rnd).o, want))}")
    for label, cfg in variants:
      with Part(f"output mosaic {label}", part_timeout):
        f = jax.jit(lambda *x, cfg=cfg: mgo.apply(*x, scale=scale, chunk_size=BT, config=cfg, interpret=interpret))
        c, secs = compile_timed(f, a_bf)
        ms = timeit(c, a_bf, reps)
        got = jax.block_until_ready(f(*a_bf)).o
        say(f"  mosaic {label} ({cfg}), bf16 inputs: compile {secs:.2f}s, {ms:.3f} ms; "
            f"vs reference {_fmt1('o', _rel(got, want))}")


def fused_part(sets, qa, reps, part_timeout, variants, interpret):
  from kda.stages import output, state
  scale = K ** -0.5
  bf = lambda x: x.astype(jnp.bfloat16)

  def fused_args(name):                        # kg, w, u, qg, Aqk, gc_int, gc_frac, h0, acu
    kg, w, u, gi, gf, h0, acu = sets[name]
    qg, Aqk = qa[name]
    return (kg, w, u, qg, Aqk, gi, gf, h0, acu)

  def composed_ref(kg, w, u, qg, Aqk, gi, gf, h0, acu):
    st = state.reference.apply(kg, w, u, gi, gf, h0, acu, chunk_size=BT)
    return output.reference.apply(qg, st.h, Aqk, st.v_new, scale=scale, chunk_size=BT).o, st.final_state

  def unfused(st_impl, out_impl, **kw):
    def f(kg, w, u, qg, Aqk, gi, gf, h0, acu):
      st = st_impl(kg, w, u, gi, gf, h0, acu, chunk_size=BT, **kw)
      return out_impl(qg, st.h, Aqk, st.v_new, scale=scale, chunk_size=BT, **kw).o, st.final_state
    return f

  timed = next(iter(sets))
  with Part("unfused triton", part_timeout):
    a = fused_args(timed)
    f = jax.jit(unfused(state.pallas.apply, output.pallas.apply, interpret=interpret))
    c, secs = compile_timed(f, a)
    say(f"  unfused Triton state + Triton output, float32 inputs: compile {secs:.2f}s, "
        f"{timeit(c, a, reps):.3f} ms")
  refs, pairs = {}, {}
  for name in sets:
    a = fused_args(name)
    a_bf = tuple(bf(x) for x in a[:5]) + a[5:]
    a_rnd = tuple(x.astype(jnp.float32) for x in a_bf[:5]) + a[5:]
    with Part(f"fused reference {name}", part_timeout):
      f = jax.jit(composed_ref)
      if name == timed:
        c, secs = compile_timed(f, a)
        say(f"  composed references (jitted): compile {secs:.2f}s, {timeit(c, a, reps):.3f} ms")
      refs[name] = jax.block_until_ready(f(*a_rnd))
    with Part(f"unfused mosaic {name}", part_timeout):
      f = jax.jit(unfused(mgs.apply, mgo.apply, interpret=interpret))
      if name == timed:
        c, secs = compile_timed(f, a_bf)
        say(f"  unfused Mosaic state (bf16 h, v_new) + Mosaic output, bf16 inputs: compile {secs:.2f}s, "
            f"{timeit(c, a_bf, reps):.3f} ms")
      pairs[name] = jax.block_until_ready(f(*a_bf))
      say(f"    {name} vs composed references: {_fmt1('o', _rel(pairs[name][0], refs[name][0]))}  "
          f"{_fmt1('final_state', _rel(pairs[name][1], refs[name][1]))}")

  for label, cfg in variants:
    with Part(f"fused {label}", part_timeout):
      f = jax.jit(lambda *x, cfg=cfg: fso.apply(*x, scale=scale, chunk_size=BT, config=cfg,
                                                     interpret=interpret))
      for name in sets:
        a = fused_args(name)
        a_bf = tuple(bf(x) for x in a[:5]) + a[5:]
        if name == timed:
          reason = fso.supports(*a_bf, chunk_size=BT)
          if reason:
            say(f"  fused {label}: takes() refuses: {reason}")
          c, secs = compile_timed(f, a_bf)
          say(f"  fused {label} ({cfg}), bf16 inputs: compile {secs:.2f}s, {timeit(c, a_bf, reps):.3f} ms")
        o, final = jax.block_until_ready(f(*a_bf))
        acu = np.asarray(a[8])
        t0 = int(acu[-1])
        say(f"    {name}: o past aligned_cu[-1] ({o.shape[1] - t0} tokens) exactly 0: "
            f"{bool((np.asarray(o[:, t0:]) == 0).all())}")
        if name in refs:
          say(f"    {name} vs composed references:   {_fmt1('o', _rel(o, refs[name][0]))}  "
              f"{_fmt1('final_state', _rel(final, refs[name][1]))}")
        if name in pairs:
          say(f"    {name} vs unfused Mosaic kernels: {_fmt1('o', _rel(o, pairs[name][0]))}  "
              f"{_fmt1('final_state', _rel(final, pairs[name][1]))}")
        empty = np.flatnonzero(np.diff(acu) == 0)
        if empty.size:
          same = bool((np.asarray(final)[empty] == np.asarray(a[7])[empty]).all())
          say(f"    {name}: empty sequences {empty.tolist()}: final_state == initial_state: {same}")


STATE_VARIANTS = {
    "default": mgs.Config(), "direct-stores": mgs.Config(stage_stores=False),
    "f32-stores": mgs.Config(store_dtype="float32"), "lane": mgs.Config(lane_semantics=True),
    "seq-minor": mgs.Config(seq_major=False), "input-order": mgs.Config(longest_first=False),
    "swizzled-stages": mgs.Config(store_dtype="float32", swizzle_stages=True),
    "direct-stores-lane": mgs.Config(stage_stores=False, lane_semantics=True)}
OUTPUT_VARIANTS = {
    "default": mgo.Config(), "one-chunk": mgo.Config(chunks_per_program=1),
    "two-chunks": mgo.Config(chunks_per_program=2), "eight-chunks": mgo.Config(chunks_per_program=8),
    "bv128": mgo.Config(block_v=128), "bv128-one-chunk": mgo.Config(block_v=128, chunks_per_program=1),
    "bf16-o": mgo.Config(out_dtype="bfloat16"), "direct-store": mgo.Config(stage_store=False),
    "lane": mgo.Config(lane_semantics=True)}
FUSED_VARIANTS = {
    "serial": fso.Config(), "warp-specialized": fso.Config(warp_specialized=True),
    "serial-bf16-o": fso.Config(out_dtype="bfloat16"),
    "warp-specialized-bf16-o": fso.Config(warp_specialized=True, out_dtype="bfloat16"),
    "serial-one-slot": fso.Config(input_slots=1),
    "serial-one-slot-direct-o": fso.Config(input_slots=1, stage_o=False),
    "serial-direct-o": fso.Config(stage_o=False),
    "warp-specialized-direct-o": fso.Config(warp_specialized=True, stage_o=False),
    "input-order": fso.Config(longest_first=False)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default="long,short")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--part-timeout", type=int, default=600, help="seconds before a hung part ends the run")
  p.add_argument("--parts", default="state,output,fused",
                 help="what to check and time, of: state, output, fused (see above)")
  p.add_argument("--variants", default="default,direct-stores,f32-stores,lane,seq-minor",
                 help=f"Config variants of the Mosaic state kernel, of: {', '.join(STATE_VARIANTS)}")
  p.add_argument("--output-variants", default="default,one-chunk,bv128,bf16-o,direct-store",
                 help=f"Config variants of the Mosaic output kernel, of: {', '.join(OUTPUT_VARIANTS)}")
  p.add_argument("--fused-variants",
                 default="serial,serial-one-slot,warp-specialized,serial-bf16-o,warp-specialized-bf16-o",
                 help=f"Config variants of the fused state -> output kernel, of: {', '.join(FUSED_VARIANTS)}")
  p.add_argument("--total", type=int, default=TOTAL, help="packed tokens (smaller for a smoke run)")
  p.add_argument("--interpret", action="store_true", help="CPU smoke run: simulator / interpret mode")
  p.add_argument("--no-emulation", action="store_true",
                 help="skip the numpy emulation (seconds to a minute a case)")
  a = p.parse_args(argv)
  def pick(known, names):
    bad = sorted(set(filter(None, names.split(","))) - set(known))
    if bad:
      p.error(f"unknown variants {bad}; known: {', '.join(known)}")
    return [(v, known[v]) for v in names.split(",") if v]

  variants = pick(STATE_VARIANTS, a.variants)
  output_variants = pick(OUTPUT_VARIANTS, a.output_variants)
  fused_variants = pick(FUSED_VARIANTS, a.fused_variants)
  parts = tuple(x for x in a.parts.split(",") if x)
  bad = sorted(set(parts) - {"state", "output", "fused"})
  if bad:
    p.error(f"unknown parts {bad}")
  try:
    say(f"jax {jax.__version__}, devices {jax.devices()}, kind {jax.devices()[0].device_kind}")
  except Exception as e:  # noqa: BLE001
    say(f"no devices: {e}")
  for case in a.cases.split(","):
    try:
      run_case(case, a.reps, a.part_timeout, variants, a.total, a.interpret, not a.no_emulation,
               parts, output_variants, fused_variants)
    except Exception as e:  # noqa: BLE001
      say(f"case {case} FAILED: {type(e).__name__}: {e}")
      traceback.print_exc()
  say("done")


if __name__ == "__main__":
  main()
