"""jla's kernels per call (forward and value_and_grad) on shapes A,B,C: {"A:plain": {"fwd": [...], "fwd+bwd": [...]}}.

Run from the repository root on the GPU machine after ../shared/peer/run_peer.sh (copied to .peer/, which
installs jla into /tmp/peer-site): PYTHONPATH=/tmp/peer-site:. python3 benchmarks/h200-2026-12-05c/jla_profile.py A,B,C OUT.json
"""
import collections, json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".peer"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import common, jla_bench
import jax, jax.numpy as jnp
from tools import profile as prof
from jla.ops.mosaic_gpu.kda import kda as jla_kda

shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["A", "B", "C"]
out_path = sys.argv[2] if len(sys.argv) > 2 else None
reps = 5
res = {}
for name in shapes:
  s = common.shapes()[name]
  B, T, cu = s["B"], s["T"], s["cu"]
  x = jla_bench.inputs(B, T, common.H, common.K, common.V)
  sid = None if cu is None else jla_bench.seg_ids(cu, T)
  fwd = lambda q, k, v, g, beta, sid_: jla_kda(q, k, v, g, beta, segment_ids=sid_)[0]
  def loss(q, k, v, g, beta, sid_, do):
    return jnp.sum(fwd(q, k, v, g, beta, sid_).astype(jnp.float32) * do.astype(jnp.float32))
  args = (x["q"], x["k"], x["v"], x["g"], x["beta"], sid)
  fns = {"fwd": (jax.jit(fwd), args),
         "fwd+bwd": (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))), args + (x["do"],))}
  res[f"{name}:plain"] = {}
  for label, (f, a) in fns.items():
    c = f.lower(*a).compile()
    jax.block_until_ready(c(*a)); jax.block_until_ready(c(*a))
    d = f"/tmp/jla-prof/{name}-{label}"
    with jax.profiler.trace(d):
      r = None
      for _ in range(reps):
        r = c(*a)
      jax.block_until_ready(r)
    events, _ = prof.device_events(d)
    ms, n = collections.Counter(), collections.Counter()
    for ename, dur, args_, _ in events:
      ms[ename] += dur / 1e3 / reps
      n[ename] += 1
    res[f"{name}:plain"][label] = [{"kernel": k, "ms": round(v, 4), "launches": n[k] / reps} for k, v in ms.most_common()]
    print(name, label, round(sum(ms.values()), 3), [(k[:40], round(v, 3)) for k, v in ms.most_common(8)], flush=True)
if out_path:
  json.dump(res, open(out_path, "w"), indent=1)
