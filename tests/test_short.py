"""PipelineConfig.short_len (kda.short): in a call with states, sequences of at most L tokens run the
recurrence token by token; the others run the chunks on a layout without them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda import padding, short
from kda import plan as planning
from kda.reference import recurrent_kda

LENS = [1, 3, 70, 0, 2, 5, 4, 130, 1]        # empty, 1..L, L + 1 and chunk-crossing sequences
OFF = {"pipeline": planning.PipelineConfig(short_len=0)}


def _inputs(lens, H=2, HV=2, K=32, V=16, seed=0):
  rng = np.random.default_rng(seed)
  T = int(sum(lens))
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  k = f(1, T, H, K)
  xs = (f(1, T, H, K), k / np.linalg.norm(k, axis=-1, keepdims=True), f(1, T, HV, V),
        -np.abs(f(1, T, HV, K)) * 0.2, 1 / (1 + np.exp(-f(1, T, HV))))
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  return xs, f(len(lens), HV, K, V), cu


def _loss(fn, w_o, w_s):
  return lambda *a: (lambda o, s: jnp.sum(o * w_o) + jnp.sum(s * w_s))(*fn(*a))


@pytest.mark.parametrize("traced", [False, True], ids=["concrete", "traced"])
def test_short_sequences_match_the_recurrence_forward_and_gradient(traced):
  xs, h0, cu = _inputs(LENS)
  call = lambda q, k, v, g, beta, h0, cu: kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                        cu_seqlens=cu)
  ref = lambda q, k, v, g, beta, h0: recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu)
  o_r, s_r = ref(*xs, h0)
  if traced:
    fn = jax.jit(lambda *a: call(*a[:6], a[6]))
    got = fn(*xs, h0, jnp.asarray(cu))
    grad = jax.jit(jax.grad(_loss(lambda *a: call(*a[:6], a[6]), o_r, s_r), argnums=range(6)))
    g_k = grad(*xs, h0, jnp.asarray(cu))
  else:
    got = call(*xs, h0, cu)
    g_k = jax.grad(_loss(lambda *a: call(*a, cu), o_r, s_r), argnums=range(6))(*xs, h0)
  np.testing.assert_allclose(got[0], o_r, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got[1], s_r, atol=2e-5, rtol=2e-5)
  g_r = jax.grad(_loss(ref, o_r, s_r), argnums=range(6))(*xs, h0)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_k, g_r):
    np.testing.assert_allclose(a, b, atol=5e-5 * float(np.max(np.abs(b))), err_msg=name)


def test_traced_lengths_skip_what_no_sequence_reaches():
  """Traced cu_seqlens, every sequence short (at most 2 tokens of L = 4): the chunks of the
  worst-case layout and the steps past the longest sequence sit behind run-time conditionals (one
  for the chunks, one per step after the first), which skip them; o, the final states and every
  gradient are the recurrence's."""
  lens = [1, 2, 0, 1, 2, 1]
  xs, h0, cu = _inputs(lens, seed=3)
  call = lambda *a: kda.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=a[6])
  ref = lambda q, k, v, g, beta, h0: recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu)
  o_r, s_r = ref(*xs, h0)
  fn = jax.jit(call)
  assert fn.lower(*xs, h0, jnp.asarray(cu)).as_text().count("stablehlo.case") == 1 + 3
  o, s = fn(*xs, h0, jnp.asarray(cu))
  np.testing.assert_allclose(o, o_r, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(s, s_r, atol=2e-5, rtol=2e-5)
  g_k = jax.jit(jax.grad(_loss(call, o_r, s_r), argnums=range(6)))(*xs, h0, jnp.asarray(cu))
  g_r = jax.grad(_loss(ref, o_r, s_r), argnums=range(6))(*xs, h0)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_k, g_r):
    np.testing.assert_allclose(a, b, atol=5e-5 * float(np.max(np.abs(b))), err_msg=name)


def test_short_len_zero_runs_every_sequence_through_the_chunks():
  xs, h0, cu = _inputs(LENS, seed=1)
  on = kda.chunk_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
  off = kda.chunk_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu, config=OFF)
  for a, b in zip(on, off):
    np.testing.assert_allclose(a, b, atol=3e-5, rtol=3e-5)


def test_raw_gates_l2norm_and_grouped_heads():
  """use_gate_in_kernel (A_log, dt_bias, lower_bound), use_qk_l2norm and HV = 2 H: the same values and
  gradients (A_log and dt_bias included) as the chunks."""
  xs, h0, cu = _inputs([2, 1, 67, 4], H=1, HV=2, seed=2)
  rng = np.random.default_rng(3)
  A_log, dt_bias = jnp.asarray(rng.standard_normal(2), jnp.float32), jnp.asarray(rng.standard_normal(64), jnp.float32)
  kw = dict(output_final_state=True, cu_seqlens=cu, use_gate_in_kernel=True, lower_bound=-3.0,
            use_qk_l2norm_in_kernel=True)

  def loss(config):
    def f(q, k, v, g, beta, h0, A_log, dt_bias):
      o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, A_log=A_log, dt_bias=dt_bias, config=config, **kw)
      return jnp.sum(o * jnp.sin(o)) + jnp.sum(s * jnp.cos(s))
    return f
  args = (*xs, h0, A_log, dt_bias)
  for a, b in zip(jax.grad(loss(None), argnums=range(8))(*args), jax.grad(loss(OFF), argnums=range(8))(*args)):
    np.testing.assert_allclose(a, b, atol=1e-4 * float(np.max(np.abs(b))))


def test_decode_batch_without_cu_seqlens():
  """B sequences of one token each (a decoding step): the recurrence's answer, one step."""
  (q, k, v, g, beta), h0, _ = _inputs([1] * 6, seed=4)
  q, k, v, g, beta = (x.reshape((6, 1) + x.shape[2:]) for x in (q, k, v, g, beta))
  o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  o_r, s_r = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  np.testing.assert_allclose(o, o_r, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(s, s_r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", [1, 5], ids=["short", "long"])
def test_a_nan_stays_in_its_sequence(bad):
  """A NaN in one sequence's v (short: 3 tokens; long: 5 > L): every other sequence's o, final state
  and gradients equal the call without it."""
  xs, h0, cu = _inputs(LENS, seed=5)
  v_bad = xs[2].copy()
  v_bad[0, cu[bad]] = np.nan
  call = lambda v, h0: kda.chunk_kda(xs[0], xs[1], v, xs[3], xs[4], initial_state=h0, output_final_state=True,
                                     cu_seqlens=cu)
  loss = lambda v, h0: (lambda o, s: jnp.sum(o) + jnp.sum(s))(*call(v, h0))
  (o, s), (o_ok, s_ok) = call(v_bad, h0), call(xs[2], h0)
  dv, dh = jax.grad(loss, argnums=(0, 1))(v_bad, h0)
  dv_ok, dh_ok = jax.grad(loss, argnums=(0, 1))(xs[2], h0)
  tok = np.ones(int(cu[-1]), bool)
  tok[cu[bad]:cu[bad + 1]] = False
  seq = np.arange(len(LENS)) != bad
  np.testing.assert_array_equal(np.asarray(o)[0, tok], np.asarray(o_ok)[0, tok])
  np.testing.assert_array_equal(np.asarray(s)[seq], np.asarray(s_ok)[seq])
  np.testing.assert_array_equal(np.asarray(dv)[0, tok], np.asarray(dv_ok)[0, tok])
  np.testing.assert_array_equal(np.asarray(dh)[seq], np.asarray(dh_ok)[seq])
  assert np.isnan(np.asarray(s)[bad]).any()


def test_split_bounds_the_chunks_layout():
  lens = [1] * 500 + [130]
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  T = int(cu[-1])
  lay = padding.layout_from_cu_seqlens(cu, T, 64)
  assert lay.Ta >= T + 500 * 63                                            # a chunk per sequence
  rest, is_short, steps, any_long = short.split(lay, 4, np.asarray(lens))
  assert (steps, any_long, rest.Ta) == (1, True, 192)                    # known lengths: 130 tokens, 3 chunks
  assert int(np.sum(is_short)) == 500 and np.asarray(rest.lens).tolist()[-1] == 130
  seen = []
  jax.eval_shape(lambda cu: seen.append(short.split(padding.layout_from_cu_seqlens(cu, T, 64), 4)[2]), cu)
  assert seen[0] == 4                                                 # traced: L steps (a bound)
  jax.eval_shape(lambda cu: seen.append(short.split(padding.layout_from_cu_seqlens(cu, T, 64), 4)[0].Ta), cu)
  assert seen[1] == -(-(T + (T // 5) * 63) // 64) * 64                   # at most T // 5 long ones


def test_concrete_lengths_under_jit_take_the_steps_they_need():
  """cu_seqlens closed over by a jitted call (numpy): one step for one-token sequences, no chunk."""
  xs, h0, cu = _inputs([1] * 7, seed=6)
  call = jax.jit(lambda *a: kda.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu))
  text = call.lower(*xs, h0).as_text()
  assert text.count("dot_general") == 2                   # k^T S and S^T q, once each
  o, s = call(*xs, h0)
  o_r, s_r = recurrent_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
  np.testing.assert_allclose(o, o_r, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(s, s_r, atol=2e-5, rtol=2e-5)


def test_takes_and_config():
  assert short.takes(4, initial_state=jnp.zeros(1), output_final_state=False, N=3)
  assert short.takes(4, initial_state=None, output_final_state=True, N=3)
  assert not short.takes(4, initial_state=None, output_final_state=False, N=3)
  assert not short.takes(0, initial_state=jnp.zeros(1), output_final_state=True, N=3)
  with pytest.raises(ValueError, match="short_len must be an int >= 0, got -1"):
    planning.PipelineConfig(short_len=-1)


def test_kernels_beside_the_recurrence():
  """impl="mosaic_gpu" (simulator), bf16, traced cu_seqlens: the chunk kernels on a layout whose short
  sequences are empty (between long ones), the recurrence on those: loss and every gradient (h0's
  included) within bf16 accuracy of the reference impl."""
  r = [np.random.default_rng(i) for i in range(7)]
  lens = [1, 70, 2, 0, 65, 3, 4, 5]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  T, H, HV, K, V = sum(lens), 1, 2, 64, 64
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  x = (bf(r[0].standard_normal((1, T, H, K)) / 8), bf(r[1].standard_normal((1, T, H, K)) / 8),
       bf(r[2].standard_normal((1, T, HV, V))),
       jnp.asarray(-np.log1p(np.exp(-r[3].standard_normal((1, T, HV, K)))) / 4, jnp.float32),
       bf(r[4].uniform(0.1, 0.9, (1, T, HV))))
  h0 = jnp.asarray(r[5].standard_normal((len(lens), HV, K, V)) * 0.1, jnp.float32)
  do = jnp.asarray(r[6].standard_normal((1, T, HV, V)), jnp.float32)

  def run(impl):
    def loss(x, h0, cu):
      o, s = kda.chunk_kda(*x, cu_seqlens=cu, initial_state=h0, output_final_state=True, impl=impl)
      return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * 0.3)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, h0, cu)
  (got, (gx, gh)), (want, (wx, wh)) = run("mosaic_gpu"), run("reference")
  assert abs(float(got) - float(want)) <= 1e-2 * abs(float(want))
  for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), (*gx, gh), (*wx, wh)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), name
