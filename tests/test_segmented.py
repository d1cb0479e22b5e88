"""PipelineConfig.segment_pieces (kda.padding.pieces): short sequences run as fewer, longer ones with a
-inf gate at each inner sequence start (exact: exp(GATE_FLOOR) == 0 in float32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda import padding
from kda import plan as planning
from kda.padding import pieces
from kda.reference import recurrent_kda

CU = np.array([0, 37, 37, 101, 166, 167, 197], np.int32)


@pytest.mark.parametrize("traced", [False, True], ids=["concrete", "traced"])
def test_pieces_start_at_sequence_starts_and_reset_the_rest(traced):
  T = 256
  make = lambda cu: pieces.segmented(padding.layout_from_cu_seqlens(cu, T, 64), 3)
  lay, resets = jax.jit(make)(jnp.asarray(CU)) if traced else make(CU)
  g = pieces.reset_gates(jnp.full((1, T, 1, 1), -0.5), resets)
  np.testing.assert_array_equal(np.asarray(lay.starts), [0, 101, 166])
  np.testing.assert_array_equal(np.asarray(lay.lens), [101, 65, 31])
  g = np.asarray(g)[0, :, 0, 0]
  np.testing.assert_array_equal(np.where(np.isinf(g))[0], [37, 167])   # the starts inside a piece
  assert np.all(g[np.isfinite(g)] == -0.5)
  assert sorted(set(np.asarray(resets).tolist()) - {T}) == [37, 167]  # the kernels' segment_rows take them


def test_pieces_keep_the_walks_parallel():
  pc = planning.PipelineConfig()
  assert pc.segment_pieces == 16 and pieces.count(16, pc.segment_pieces, pc.segment_walks) == 16
  assert [pieces.count(h, 16, 256) for h in (1, 3, 4, 32)] == [256, 86, 64, 16]


def test_takes_only_what_it_computes_exactly():
  kw = dict(contiguous=True, initial_state=None, output_final_state=False, N=17, use_gate_in_kernel=False)
  on = lambda P=16, **a: pieces.takes(P, **{**kw, **a})
  assert on()
  assert not on(N=16)
  assert not on(contiguous=False)
  assert not on(initial_state=jnp.zeros((1,)))
  assert not on(output_final_state=True)
  assert not on(use_gate_in_kernel=True)
  assert not on(P=0)
  assert planning.make_plan(scale=0.125, chunk_size=64, impl="mosaic_gpu").members_select("packed_forward")
  assert not planning.make_plan(scale=0.125, chunk_size=64, impl="reference").members_select("packed_forward")


@pytest.mark.large      # ~70 s in the simulator
def test_segmented_forward_and_gradient_match_the_recurrence(monkeypatch):
  """impl="mosaic_gpu" (simulator), two pieces over six sequences (one empty, boundaries mid-chunk),
  NaN past cu_seqlens[-1]: o close to the recurrence and to the aligned run, every gradient close to
  the aligned run's, finite, and exactly 0 past the end."""
  two = {"pipeline": planning.PipelineConfig(segment_pieces=2, segment_walks=4)}     # two pieces at HV = 2
  r = [np.random.default_rng(i) for i in range(6)]
  T, H, HV, K, V = 256, 1, 2, 64, 64
  none = (np.arange(T) >= CU[-1])[None, :, None, None]
  bf = lambda x: jnp.asarray(np.where(none, np.nan, x), jnp.bfloat16)
  x = (bf(r[0].standard_normal((1, T, H, K)) / 8), bf(r[1].standard_normal((1, T, H, K)) / 8),
       bf(r[2].standard_normal((1, T, HV, V))),
       jnp.asarray(np.where(none, np.nan, -np.log1p(np.exp(-r[3].standard_normal((1, T, HV, K)))) / 4), jnp.float32),
       jnp.asarray(np.where(none[..., 0], np.nan, r[4].uniform(0.1, 0.9, (1, T, HV))), jnp.bfloat16))
  do = jnp.asarray(r[5].standard_normal((1, T, HV, V)), jnp.float32)
  cu = jnp.asarray(CU)
  seen = []
  real = pieces.segmented
  monkeypatch.setattr(pieces, "segmented", lambda *a, **k: seen.append(1) or real(*a, **k))

  def run(config):
    fwd = lambda x, cu: kda.chunk_kda(*x, cu_seqlens=cu, impl="mosaic_gpu", config=config)[0]
    loss = lambda x, cu: jnp.sum(fwd(x, cu).astype(jnp.float32) * do)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    return f32(jax.jit(fwd)(x, cu)), [f32(a) for a in jax.jit(jax.grad(loss))(x, cu)]

  o, grads = run(two)
  assert seen
  seen.clear()
  o_al, grads_al = run({"pipeline": planning.PipelineConfig(segment_pieces=0)})
  assert not seen
  end = CU[-1]
  clean = lambda a: jnp.asarray(np.nan_to_num(np.asarray(a.astype(jnp.float32))))
  want = np.asarray(recurrent_kda(*map(clean, x), cu_seqlens=cu)[0])
  assert np.isfinite(o).all() and np.all(o[:, end:] == 0)
  assert np.abs(o[:, :end] - want[:, :end]).max() <= 1e-2 * np.abs(want[:, :end]).max()
  assert np.abs(o - o_al).max() <= 2 ** -7 * np.abs(o_al).max()
  for name, a, b in zip("q k v g beta".split(), grads, grads_al):
    assert np.isfinite(a).all() and np.all(a[:, end:] == 0), name
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), name


def _lowered_for_cuda(f, T, HV, K, N):
  """f's program for (q, k, v, g, beta, cu_seqlens) lowered for CUDA from the CPU, with impl=None as
  on an H200 (the platform mocked; an abstract H200 mesh, which the Triton lowering of the short
  stage's kernels needs)."""
  from unittest import mock
  from tests.lowering import h200_mesh
  S = jax.ShapeDtypeStruct
  bf = lambda *s: S(s, jnp.bfloat16)
  args = (bf(1, T, HV, K), bf(1, T, HV, K), bf(1, T, HV, K), S((1, T, HV, K), jnp.float32), bf(1, T, HV),
          S((N + 1,), jnp.int32))
  with mock.patch("kda.plan.platform_of", lambda device=None: ("gpu", "sm90")):
    plan = planning.make_plan(scale=K ** -0.5, chunk_size=64)
    assert plan.members_select("packed_forward") == "mosaic_gpu"
    with h200_mesh():
      return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_training_step_lowers_without_while_loops():
  """jax.value_and_grad with impl=None, many short sequences (the segmented mode) and traced cu_seqlens,
  lowered for CUDA: no while loop (on a GPU each iteration is launched from the host, on the
  critical path of a call) but kda.confine's two, forward and backward, which make no pass unless
  an output is not finite."""
  T, HV, K, N = 1024, 1, 128, 300            # HV = 1: 256 pieces, so N > pieces
  assert pieces.takes(pieces.count(HV, 16, 256), contiguous=True, initial_state=None, output_final_state=False,
                      N=N, use_gate_in_kernel=False)
  loss = lambda q, k, v, g, beta, cu: jnp.sum(kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)[0].astype(jnp.float32))
  txt = _lowered_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), T, HV, K, N)
  assert "mosaic_gpu" in txt and txt.count("stablehlo.while") == 2


def test_forward_with_final_state_lowers_without_while_loops():
  """The forward with the final state (not segmented: the walks group the sequences,
  kda._mosaic_gpu.sequence_groups), lowered for CUDA: no while loop."""
  txt = _lowered_for_cuda(lambda *a: kda.chunk_kda(*a[:5], cu_seqlens=a[5], output_final_state=True),
                          1024, 1, 128, 300)
  assert "mosaic_gpu" in txt and "stablehlo.while" not in txt


def _inputs(T, H, HV, K, V, seed=0):
  r = [np.random.default_rng(seed + i) for i in range(6)]
  return ([jnp.asarray(r[0].standard_normal((1, T, H, K)) / 6, jnp.bfloat16),
           jnp.asarray(r[1].standard_normal((1, T, H, K)) / 6, jnp.bfloat16),
           jnp.asarray(r[2].standard_normal((1, T, HV, V)), jnp.bfloat16),
           jnp.asarray(-np.log1p(np.exp(-r[3].standard_normal((1, T, HV, K)))) / 4, jnp.float32),
           jnp.asarray(r[4].uniform(0.1, 0.9, (1, T, HV)), jnp.bfloat16)],
          jnp.asarray(r[5].standard_normal((1, T, HV, V)), jnp.float32))


@pytest.mark.parametrize("where,seq,K,H,impl", [
    ("v", 3, 32, 1, "mosaic_gpu"), ("q", 3, 32, 1, "mosaic_gpu"), ("g", 3, 32, 1, "mosaic_gpu"),
    ("do", 3, 32, 1, "mosaic_gpu"), ("g", 4, 32, 1, "mosaic_gpu"), ("q", 3, 64, 2, "mosaic_gpu"),
    pytest.param("g", 4, 64, 1, "mosaic_gpu", marks=pytest.mark.large),
    pytest.param("v", 3, 64, 1, "mosaic_gpu", marks=pytest.mark.large),
    ("v", 3, 32, 1, "xla"), ("g", 4, 32, 1, "xla"), ("do", 3, 32, 1, "xla")],
    ids=["v", "q", "g", "do", "g-at-a-reset", "q-packed", "g-at-a-reset-packed", "v-packed",
         "v-xla", "g-at-a-reset-xla", "do-xla"])
def test_a_non_finite_value_stays_in_its_sequence(where, seq, K, H, impl):
  """Two pieces over six sequences sharing chunks: one NaN at a token of sequence `seq` leaves every
  other sequence's o and gradients finite and bit-identical to the run with that value replaced by
  0; that sequence's o (or, for do, its gradients) is NaN. Sequence 4 is one token at a reset, where
  the gate is set to -inf: a NaN there must still be seen. impl="mosaic_gpu" (simulator): K = V =
  32, the backward's kernels refuse the head dims and its jnp stages run (the backward's probe from
  S0's outputs); 64: the packed backward's kernels (the probe from S0's wy kernel; in the rerun S3
  and S4 read q, k, v cleaning, S5 the raw gates). Two value heads; one query head (GVA: q, k
  repeated, so S3 and S4 read cleaned copies) or two (S3 and S4 read the raw q, k). impl="xla": the
  unpacked stages, the resets as -inf gates."""
  _non_finite_case(where, seq, K, H, impl)


@pytest.mark.parametrize("where,K", [("q", 32), pytest.param("q", 64, marks=pytest.mark.large),
                                     pytest.param("v", 64, marks=pytest.mark.large)])
def test_a_non_finite_value_stays_in_its_sequence_with_keep_forward(where, K):
  """As above with PipelineConfig(keep_forward=True): the backward's probe is read from the
  forward's w, u, qg, kg (K = 32: the unpacked stages; 64: the packed kernels)."""
  _non_finite_case(where, 3, K, 2 if K == 64 else 1, "mosaic_gpu", keep_forward=True)


def _non_finite_case(where, seq, K, H, impl, **pipeline):
  two = {"pipeline": planning.PipelineConfig(segment_pieces=2, segment_walks=4, **pipeline)}
  T, HV = 200, 2
  x, do = _inputs(T, H, HV, K, K)
  cu, lo, hi = jnp.asarray(CU), CU[seq], CU[seq + 1]
  bad_tok = 120 if seq == 3 else lo

  @jax.jit
  def run(x, do):
    fwd = lambda *x: kda.chunk_kda(*x, cu_seqlens=cu, impl=impl, config=two)[0]
    o, vjp = jax.vjp(fwd, *x)
    return o.astype(jnp.float32), [d.astype(jnp.float32) for d in vjp(do.astype(o.dtype))]

  def put(value):
    xs, d = list(x), do
    if where == "do":
      d = d.at[0, bad_tok, 1, 3].set(value)
    else:
      i = "q k v g beta".split().index(where)
      idx = (0, bad_tok) + (0,) * (xs[i].ndim - 2)
      xs[i] = xs[i].at[idx].set(value)
    return run(xs, d)

  o, grads = put(np.nan)
  o0, grads0 = put(0.0)
  keep = np.r_[0:lo, hi:T]
  for name, a, b in [("o", o, o0)] + list(zip("q k v g beta".split(), grads, grads0)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a[:, keep]).all(), name
    np.testing.assert_array_equal(a[:, keep], b[:, keep], err_msg=name)
  seen = np.asarray(grads[2]) if where == "do" else np.asarray(o)
  assert not np.isfinite(seen[:, lo:hi]).any()


@pytest.mark.parametrize("impl", ["xla", "reference", "mosaic_tpu", "pallas"])
def test_pieces_run_on_every_backend(impl, monkeypatch):
  """Every backend runs the pieces (their stages take the resets as -inf gates): two pieces over six
  sequences (one empty, starts mid-chunk), traced cu_seqlens; o close to the recurrence, o and every
  gradient close to the aligned run's and 0 past the last sequence."""
  T, H, HV, K, V = 256, 1, 2, 32, 32
  x, do = _inputs(T, H, HV, K, V)
  cu = jnp.asarray(CU)
  seen = []
  real = pieces.segmented
  monkeypatch.setattr(pieces, "segmented", lambda *a, **k: seen.append(1) or real(*a, **k))

  def run(segment_pieces):
    config = {"pipeline": planning.PipelineConfig(segment_pieces=segment_pieces, segment_walks=4)}
    fwd = lambda x, cu: kda.chunk_kda(*x, cu_seqlens=cu, impl=impl, config=config)[0]
    loss = lambda x, cu: jnp.sum(fwd(x, cu).astype(jnp.float32) * do)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    return f32(jax.jit(fwd)(x, cu)), [f32(a) for a in jax.jit(jax.grad(loss))(x, cu)]

  o, grads = run(2)
  assert seen
  seen.clear()
  o_al, grads_al = run(0)
  assert not seen
  end = CU[-1]
  want = np.asarray(recurrent_kda(*[a.astype(jnp.float32) for a in x], cu_seqlens=cu)[0])
  assert np.all(o[:, end:] == 0)
  assert np.abs(o[:, :end] - want[:, :end]).max() <= 1e-2 * np.abs(want[:, :end]).max()
  assert np.abs(o - o_al).max() <= 2 ** -7 * np.abs(o_al).max()
  for name, a, b in zip("q k v g beta".split(), grads, grads_al):
    assert np.isfinite(a).all() and np.all(a[:, end:] == 0), name
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), name

