"""chunk_kda on 4 emulated CPU devices: the cases of tests/test_multidevice.py.

Run in a fresh process (the device count is fixed when jax starts):
`python -m tests.multidevice_cases [case ...]` prints one JSON line per case: `diffs` maps every
output and gradient to max |sharded - unsharded| / max |unsharded|, and `checks` holds the case's
other findings (collectives in the compiled program, output shardings). Every sharded call runs
with shard_map's default checks (check_vma=True) and is compared with the same call unsharded.
"""
from __future__ import annotations

import os

# 4 emulated CPU devices; LLVM's optimisations off halves XLA's compile time, which is most of these
# cases' time (the sharded and the unsharded programs are compiled alike)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import kda  # noqa: E402

ARRAYS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def inputs(seed, *, R, T, H, HV, K=16, V=16, N=1, gate="plain"):
  """R rows of T tokens; N initial states per row; gate "plain" (log-space) or "raw" (in kernel)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  x = dict(q=unit(jax.random.normal(ks[0], (R, T, H, K))), k=unit(jax.random.normal(ks[1], (R, T, H, K))),
           v=jax.random.normal(ks[2], (R, T, HV, V)),
           beta=jax.nn.sigmoid(jax.random.normal(ks[4], (R, T, HV))),
           initial_state=0.5 * jax.random.normal(ks[5], (R * N, HV, K, V)))
  if gate == "raw":
    x["g"] = jax.random.normal(ks[3], (R, T, HV, K))
    x["A_log"] = jax.random.uniform(ks[6], (HV,), minval=-1.0, maxval=1.0)
    x["dt_bias"] = 0.5 * jax.random.normal(ks[7], (HV * K,))
  else:   # log-space gates, a few strong ones
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (R, T, HV, K)))
    x["g"] = jnp.where(jax.random.uniform(ks[6], g.shape) < 0.05, 30.0 * g, g)
  return x


def cotangents(seed, o, s):
  ko, ks = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(ko, o.shape), None if s is None else jax.random.normal(ks, s.shape)


def loss_and_grads(fn, x, names, seed):
  """fn(**x) -> (o, final_state); the value and the gradients in `names` of
  sum(o * Wo) + sum(final_state * Ws) with random Wo, Ws."""
  o, s = fn(**x)
  wo, ws = cotangents(seed, o, s)

  def loss(*diff):
    o, s = fn(**{**x, **dict(zip(names, diff))})
    return jnp.sum(o.astype(jnp.float32) * wo) + (0.0 if s is None else jnp.sum(s * ws))

  return (o, s), dict(zip(names, jax.grad(loss, argnums=tuple(range(len(names))))(*(x[n] for n in names))))


def rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def compare(sharded, unsharded):
  (o, s), grads = sharded
  (o_u, s_u), grads_u = unsharded
  out = {"o": rel(o, o_u)}
  if s_u is not None:
    out["final_state"] = rel(s, s_u)
  out.update({f"d{n}": rel(grads[n], grads_u[n]) for n in grads_u})
  return out


def collectives(compiled_text):
  return {n: len(re.findall(rf"\b{n}(-start)?\(", compiled_text)) for n in ("all-gather", "all-to-all",
                                                                             "all-reduce")}


def put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def shard_mapped(mesh, specs, out_specs, call):
  """call(**arrays) under jax.shard_map (default check_vma=True), as fn(**arrays) -> (o, final_state)."""
  def fn(**x):
    names = sorted(n for n in x if x[n] is not None)
    f = jax.shard_map(lambda *a: call(**dict(zip(names, a))), mesh=mesh, in_specs=tuple(specs[n] for n in names),
                      out_specs=out_specs)
    return f(*(x[n] for n in names))
  return fn


# -- cases: each returns (diffs, checks) -------------------------------------------------------

def heads(impl):
  """Heads split over "model" (H and HV together: GVA groups of 2 stay whole), replicated over
  "data"; gate in kernel with A_log / dt_bias split alike; packed varlen with an empty sequence."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(1, R=1, T=120, H=2, HV=4, N=3, gate="raw")
  cu = jnp.array([0, 37, 37, 120], jnp.int32)
  kw = dict(output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, chunk_size=16,
            impl=impl)
  hs = P(None, None, "model")
  specs = dict(q=hs, k=hs, v=hs, g=hs, beta=hs, initial_state=P(None, "model"), A_log=P("model"),
               dt_bias=P("model"), cu=P())
  call = lambda cu, **a: kda.chunk_kda(**a, cu_seqlens=cu, **kw)
  fn = shard_mapped(mesh, specs, (hs, P(None, "model")), call)
  xs = {n: put(mesh, x[n], specs[n]) for n in ARRAYS} | {"cu": put(mesh, cu, P())}
  sharded = jax.jit(lambda xs: loss_and_grads(fn, xs, ARRAYS, 2))(xs)
  unsharded = jax.jit(lambda x: loss_and_grads(lambda **a: call(cu, **a), x, ARRAYS, 2))(x)
  return compare(sharded, unsharded), {}


def heads_closed_cu(impl):
  """As heads(), with cu_seqlens a concrete array placed on the (explicit) mesh and closed over by
  the shard_map body, as a user's data loader leaves it: inside shard_map nothing repartitions."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(4, R=1, T=90, H=2, HV=2, N=3)
  cu = put(mesh, jnp.array([0, 20, 64, 90], jnp.int32), P())
  kw = dict(output_final_state=True, chunk_size=16, impl=impl)
  hs = P(None, None, "model")
  names = ("q", "k", "v", "g", "beta", "initial_state")
  specs = dict(q=hs, k=hs, v=hs, g=hs, beta=hs, initial_state=P(None, "model"))
  call = lambda **a: kda.chunk_kda(**a, cu_seqlens=cu, **kw)
  fn = shard_mapped(mesh, specs, (hs, P(None, "model")), call)
  x = {n: x[n] for n in names}
  sharded = jax.jit(lambda xs: loss_and_grads(fn, xs, names, 5))({n: put(mesh, x[n], specs[n]) for n in names})
  unsharded = jax.jit(lambda x: loss_and_grads(call, x, names, 5))(jax.device_get(x))
  return compare(sharded, unsharded), {}


def sequences(impl, head_axis):
  """Packed sequences split over "data": each device its own packed row, cu_seqlens and initial
  states; heads also split over "model" when head_axis is set. A_log / dt_bias are replicated over
  "data", so their gradients sum over its devices. Unsharded: the two rows packed into one."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  N, T = 3, 100
  x = inputs(3, R=2, T=T, H=2, HV=2, N=N, gate="raw")
  cus = np.array([[0, 45, 80, 100], [0, 1, 64, 97]], np.int32)   # the last 3 tokens: no sequence
  kw = dict(output_final_state=True, use_gate_in_kernel=True, chunk_size=32, impl=impl)
  h = head_axis
  xs_spec = P("data", None, h)
  specs = dict(q=xs_spec, k=xs_spec, v=xs_spec, g=xs_spec, beta=xs_spec, initial_state=P("data", h),
               A_log=P(h), dt_bias=P(h), cu=P("data"))
  call = lambda cu, **a: kda.chunk_kda(**a, cu_seqlens=cu, **kw)
  fn = shard_mapped(mesh, specs, (xs_spec, P("data", h)), lambda cu, **a: call(cu[0], **a))
  xs = {n: put(mesh, x[n], specs[n]) for n in ARRAYS} | {"cu": put(mesh, jnp.asarray(cus), P("data"))}
  sharded = jax.jit(lambda xs: loss_and_grads(fn, xs, ARRAYS, 4))(xs)
  cu_all = np.concatenate([cus[0], cus[1, 1:] + T])

  def packed(**a):
    rows = {n: a[n].reshape(1, 2 * T, *a[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    o, s = call(cu_all, **a | rows)
    return o.reshape(a["v"].shape), s

  unsharded = jax.jit(lambda x: loss_and_grads(packed, x, ARRAYS, 4))(x)
  return compare(sharded, unsharded), {}


def segments(impl):
  """Batch rows split over "data" with segment_ids (padding between sequences), heads whole: each
  device numbers its own sequences (num_segments of them, the spare ones empty). Unsharded: one
  call on every row, its sequence numbering mapped to the devices' slots."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  Nl = 4                                    # sequence slots per device (its 2 rows)
  x = inputs(5, R=4, T=40, H=2, HV=2, N=2)   # initial_state: [2 * Nl, ...]
  seg = np.zeros((4, 40), np.int32)
  seg[0, :25], seg[0, 27:40] = 1, 2          # device 0: rows 0, 1 -> 3 sequences and an empty slot
  seg[1, 3:40] = 7
  seg[2, :40] = 1                           # device 1: rows 2, 3 -> 4 sequences
  seg[3, :10], seg[3, 10:30], seg[3, 31:] = 4, 5, 4
  slots = np.array([0, 1, 2, 7, 3, 4, 5, 6])  # device slot i -> sequence slots[i] of the whole batch
  bs = P("data")
  specs = dict(q=bs, k=bs, v=bs, g=bs, beta=bs, initial_state=bs, seg=bs)
  call = lambda seg, n, **a: kda.chunk_kda(**a, segment_ids=seg, num_segments=n, output_final_state=True,
                                           chunk_size=16, impl=impl)
  fn = shard_mapped(mesh, specs, (bs, bs), lambda seg, **a: call(seg, Nl, **a))
  names = ("q", "k", "v", "g", "beta", "initial_state")
  x = {n: x[n] for n in names}
  xs = {n: put(mesh, x[n], specs[n]) for n in names} | {"seg": put(mesh, jnp.asarray(seg), bs)}
  sharded = jax.jit(lambda xs: loss_and_grads(fn, xs, names, 6))(xs)

  def whole(initial_state, **a):
    o, s = call(seg, 2 * Nl, **a, initial_state=initial_state[np.argsort(slots)])
    return o, s[slots]

  unsharded = jax.jit(lambda x: loss_and_grads(whole, x, names, 6))(x)
  return compare(sharded, unsharded), {}


def recurrence():
  """kda.reference.recurrent_kda (the ground truth) inside shard_map: heads over "model"."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(11, R=1, T=60, H=2, HV=4, N=2)
  cu = jnp.array([0, 25, 60], jnp.int32)
  names = ("q", "k", "v", "g", "beta", "initial_state")
  x = {n: x[n] for n in names}
  hs = P(None, None, "model")
  specs = dict(q=hs, k=hs, v=hs, g=hs, beta=hs, initial_state=P(None, "model"))
  call = lambda **a: kda.reference.recurrent_kda(**a, cu_seqlens=cu, output_final_state=True)
  fn = shard_mapped(mesh, specs, (hs, P(None, "model")), call)
  xs = {n: put(mesh, x[n], specs[n]) for n in names}
  sharded = jax.jit(lambda xs: loss_and_grads(fn, xs, names, 12))(xs)
  unsharded = jax.jit(lambda x: loss_and_grads(call, x, names, 12))(x)
  return compare(sharded, unsharded), {}


def unchecked_region():
  """kda._vma.unchecked inside shard_map: what it runs equals the checked call, its results vary
  like its inputs, and differentiating through it raises (its cast back would sum over devices)."""
  from kda._vma import _vma, unchecked
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = put(mesh, jax.random.normal(jax.random.PRNGKey(19), (4, 8)), P("data", "model"))
  fn = lambda x: jnp.cumsum(x, axis=1) * 2.0
  run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model")))
  types = []
  got = run(lambda x: (types.append(sorted(_vma(y := unchecked(fn, x)))), y)[1])(x)
  raised = ""
  try:
    jax.jit(jax.grad(lambda x: run(lambda x: unchecked(fn, x))(x).sum()))(x)
  except TypeError as e:
    raised = str(e)
  return {"o": rel(got, run(fn)(x))}, {"vma": types[0], "grad_raised": raised}


def plain_jit(impl):
  """Plain jax.jit on inputs sharded over explicit mesh axes (jax.make_mesh's default): rows over
  "data", heads over "model", initial/final states [B, HV, K, V] alike. chunk_kda partitions itself:
  no all-gather, o and the gradients sharded like the inputs."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(7, R=2, T=50, H=2, HV=4, N=1)
  names = ("q", "k", "v", "g", "beta", "initial_state")
  x = {n: x[n] for n in names}
  bs = P("data", None, "model")
  specs = dict(q=bs, k=bs, v=bs, g=bs, beta=bs, initial_state=P("data", "model"))
  fn = lambda **a: kda.chunk_kda(**a, output_final_state=True, chunk_size=16, impl=impl)
  xs = {n: put(mesh, x[n], specs[n]) for n in names}
  compiled = jax.jit(lambda xs: loss_and_grads(fn, xs, names, 8)).lower(xs).compile()
  sharded = compiled(xs)
  unsharded = jax.jit(lambda x: loss_and_grads(fn, x, names, 8))(x)
  (o, s), grads = sharded
  checks = {"collectives": collectives(compiled.as_text()), "o_spec": str(o.sharding.spec),
            "final_state_spec": str(s.sharding.spec), "dq_spec": str(grads["q"].sharding.spec)}
  return compare(sharded, unsharded), checks


def plain_jit_varlen(impl):
  """Plain jax.jit, explicit axes, one packed row with traced cu_seqlens: heads split over "model",
  the "data" axis replicated."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(9, R=1, T=90, H=2, HV=2, N=2)
  cu = jnp.array([0, 70, 90], jnp.int32)
  hs = P(None, None, "model")
  specs = dict(q=hs, k=hs, v=hs, g=hs, beta=hs, initial_state=P(None, "model"))
  names = tuple(specs)
  x = {n: x[n] for n in names}
  fn = lambda cu, **a: kda.chunk_kda(**a, cu_seqlens=cu, output_final_state=True, chunk_size=32, impl=impl)
  f = lambda xs, cu: loss_and_grads(lambda **a: fn(cu, **a), xs, names, 10)
  xs, cu_s = {n: put(mesh, x[n], specs[n]) for n in names}, put(mesh, cu, P())
  compiled = jax.jit(f).lower(xs, cu_s).compile()
  sharded = compiled(xs, cu_s)
  unsharded = jax.jit(f)(x, cu)
  return compare(sharded, unsharded), {"collectives": collectives(compiled.as_text()),
                                       "o_spec": str(sharded[0][0].sharding.spec)}


def plain_jit_segments(impl):
  """Plain jax.jit, explicit axes, traced segment_ids: rows over "data" (no state in or out, so rows
  are independent), heads over "model"; forward only."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(17, R=2, T=40, H=2, HV=2)
  seg = np.zeros((2, 40), np.int32)
  seg[0, :20], seg[0, 22:], seg[1, 5:] = 1, 2, 3
  names = ("q", "k", "v", "g", "beta")
  bs = P("data", None, "model")
  fn = lambda *a, seg: kda.chunk_kda(*a, segment_ids=seg, num_segments=3, chunk_size=16, impl=impl)[0]
  xs, seg_s = [put(mesh, x[n], bs) for n in names], put(mesh, jnp.asarray(seg), P("data"))
  compiled = jax.jit(fn).lower(*xs, seg=seg_s).compile()
  o = compiled(*xs, seg=seg_s)
  return {"o": rel(o, jax.jit(fn)(*(x[n] for n in names), seg=jnp.asarray(seg)))}, {
      "collectives": collectives(compiled.as_text()), "o_spec": str(o.sharding.spec)}


def plain_jit_auto(impl):
  """Plain jax.jit with Auto mesh axes: no sharding is part of a type while tracing, so chunk_kda
  cannot partition itself and XLA places the call; kernels, opaque to XLA, are gathered (forward)."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  x = inputs(13, R=2, T=50, H=2, HV=2, N=1)
  names = ("q", "k", "v", "g", "beta")
  bs = P("data", None, "model")
  fn = lambda *a: kda.chunk_kda(*a, chunk_size=16, impl=impl)[0]
  xs = [put(mesh, x[n], bs) for n in names]
  compiled = jax.jit(fn).lower(*xs).compile()
  o = compiled(*xs)
  return {"o": rel(o, jax.jit(fn)(*(x[n] for n in names)))}, {
      "collectives": collectives(compiled.as_text()), "o_spec": str(o.sharding.spec)}


def heads_mosaic_gpu():
  """The Mosaic GPU kernels (simulator) inside shard_map: bf16, BT = 64, K = V = 64, heads over
  "model". Not in DEFAULT: the simulator of jax 0.11.2 fails on more than one device (see
  tests/test_multidevice.py)."""
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  x = inputs(15, R=1, T=100, H=4, HV=4, K=64, V=64, N=2)
  x = {n: x[n].astype(jnp.bfloat16) if n in ("q", "k", "v") else x[n]
       for n in ("q", "k", "v", "g", "beta", "initial_state")}
  cu = jnp.array([0, 40, 100], jnp.int32)
  hs = P(None, None, "model")
  specs = dict(q=hs, k=hs, v=hs, g=hs, beta=hs, initial_state=P(None, "model"))
  call = lambda **a: kda.chunk_kda(**a, cu_seqlens=cu, output_final_state=True, chunk_size=64, impl="mosaic_gpu")
  fn = shard_mapped(mesh, specs, (hs, P(None, "model")), call)
  names = tuple(specs)
  xs = {n: put(mesh, x[n], specs[n]) for n in names}
  sharded = jax.jit(lambda xs: loss_and_grads(fn, xs, names, 16))(xs)
  unsharded = jax.jit(lambda x: loss_and_grads(call, x, names, 16))(x)
  return compare(sharded, unsharded), {}


CASES = {
    "shard_map-heads-pallas": lambda: heads("pallas"),
    "shard_map-heads-closed-cu-xla": lambda: heads_closed_cu("xla"),
    "shard_map-seqs+heads-reference": lambda: sequences("reference", "model"),
    # the xla stages, and the short stage's Pallas kernels (interpret mode) on the one-token sequence
    "shard_map-seqs+heads-xla-short_pallas": lambda: sequences({"short": "pallas"}, "model"),
    "shard_map-segment_ids-xla": lambda: segments("xla"),
    "shard_map-heads-recurrence": recurrence,
    "unchecked-region": unchecked_region,
    "jit-explicit-xla": lambda: plain_jit("xla"),
    "jit-explicit-varlen-reference": lambda: plain_jit_varlen("reference"),
    "jit-explicit-segment_ids-xla": lambda: plain_jit_segments("xla"),
    "jit-auto-pallas": lambda: plain_jit_auto("pallas"),
    "shard_map-heads-mosaic_gpu": heads_mosaic_gpu,
}
# the CI run's cases; LARGE's repeat what they check on another path (tests/test_multidevice.py runs
# them under the `large` marker)
LARGE = ("shard_map-heads-closed-cu-xla", "shard_map-seqs+heads-reference", "shard_map-heads-recurrence",
         "jit-explicit-varlen-reference")
DEFAULT = tuple(n for n in CASES if "mosaic_gpu" not in n and n not in LARGE)


def main(names):
  assert len(jax.devices()) == 4, jax.devices()
  for name in names or DEFAULT:
    t0 = time.perf_counter()
    try:
      diffs, checks = CASES[name]()
      print(json.dumps({"case": name, "diffs": diffs, "checks": checks,
                        "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    except Exception:   # reported per case; the test names the case and shows the traceback
      print(json.dumps({"case": name, "error": traceback.format_exc()}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
