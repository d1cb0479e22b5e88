"""kda.padding: align / unalign / neutralize_gate, the layout helpers, chunk_table, segment_ids."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from kda import padding
from tests import cases


def _tokens(seed, T, feat=(2, 3)):
  """[1, T, *feat] float32 whose value names its token: t + 1 + a random fraction in [0, 0.5)."""
  rng = np.random.default_rng(seed)
  t = np.arange(T, dtype=np.float32).reshape((1, T) + (1,) * len(feat))
  return (t + 1 + rng.uniform(0, 0.5, (1, T) + feat)).astype(np.float32)


def _expected_align(x, lens, BT):
  """The padding layout written out: sequence n at aligned_cu[n] = sum of lens rounded up to BT."""
  T, N = x.shape[1], len(lens)
  acu = np.concatenate([[0], np.cumsum([-(-L // BT) * BT for L in lens])]).astype(np.int32)
  Ta = -(-(T + N * (BT - 1)) // BT) * BT if N else -(-max(T, 1) // BT) * BT
  out = np.zeros((1, Ta) + x.shape[2:], x.dtype)
  valid = np.zeros(Ta, bool)
  src = 0
  for n, L in enumerate(lens):
    out[0, acu[n]:acu[n] + L] = x[0, src:src + L]
    valid[acu[n]:acu[n] + L] = True
    src += L
  return out, acu, valid


_align = jax.jit(padding.align, static_argnums=2)
_unalign = jax.jit(padding.unalign, static_argnums=3)


def test_worked_example_100_50():
  """The worked example of the padding layer: seq_lens [100, 50], BT = 64, T = 150."""
  x = _tokens(0, 150)
  beta = _tokens(1, 150, feat=(2,))
  cu = cases.cu_from_lens([100, 50])
  (xa, ba), acu = padding.align([x, beta], cu, 64)   # eager, public API
  np.testing.assert_array_equal(np.asarray(acu), [0, 128, 192])
  assert xa.shape == (1, 192, 2, 3) and ba.shape == (1, 192, 2)   # concrete cu: the exact length
  real = np.zeros(192, bool)
  real[0:100] = real[128:178] = True
  np.testing.assert_array_equal(np.asarray(xa[0, 0:100]), x[0, 0:100])
  np.testing.assert_array_equal(np.asarray(xa[0, 128:178]), x[0, 100:150])
  np.testing.assert_array_equal(np.asarray(ba[0, 128:178]), beta[0, 100:150])
  np.testing.assert_array_equal(np.asarray(xa[0, ~real]), 0.0)
  np.testing.assert_array_equal(np.asarray(ba[0, ~real]), 0.0)
  layout = padding.layout_from_cu_seqlens(cu, 150, 64)
  assert (layout.T, layout.Ta, layout.chunk_size, layout.N, layout.NTa) == (150, 192, 64, 2, 3)
  np.testing.assert_array_equal(np.asarray(padding.valid_mask(layout)), real)
  np.testing.assert_array_equal(np.asarray(padding.unalign(xa, cu, acu, 150)), x)
  # traced cu_seqlens: the static bound T + N * (BT - 1), the same real tokens, zeros after
  (xt,), _ = jax.jit(lambda x, cu: padding.align([x], cu, 64))(x, cu)
  assert xt.shape == (1, 320, 2, 3)
  np.testing.assert_array_equal(np.asarray(xt[0, :192]), np.asarray(xa[0]))
  np.testing.assert_array_equal(np.asarray(xt[0, 192:]), 0.0)


@pytest.mark.parametrize("BT", [16, 64])
def test_aligned_length_buckets(BT):
  """Concrete lengths: the exact aligned length rounded up to a bucket (<= 1/8 more, a multiple of
  BT, 8 sizes per doubling); traced lengths: the bound."""
  rng = np.random.default_rng(BT)
  sizes = set()
  for _ in range(300):
    lens = rng.integers(0, 300, size=rng.integers(1, 40))
    T = int(lens.sum()) + int(rng.integers(0, 50))
    exact = int(np.sum(-(-lens // BT))) * BT
    Ta = padding.aligned_length(T, len(lens), BT, lens)
    assert Ta % BT == 0 and max(exact, BT) <= Ta <= max(exact * 9 // 8, BT), (lens, Ta, exact)
    if 4096 <= exact < 8192:
      sizes.add(Ta)
  assert len(sizes) <= 9, sorted(sizes)       # 4096, 4608, ..., 7680 and 8192
  traced = jax.eval_shape(lambda lens: jnp.zeros(padding.aligned_length(100, 3, BT, lens)), jnp.ones(3, jnp.int32))
  assert traced.shape == (padding.aligned_length(100, 3, BT),)


def _poisoned_aligned(Ta, seed=2):
  """Nonzero everywhere, position 0 included, so a read of any unowned slot shows."""
  return _tokens(seed, Ta) + 1000.0


@pytest.mark.parametrize("lens,T", [([100, 50], 170), ([0, 0, 5], 9), ([0, 0], 4), ([30, 50, 0, 0], 100)],
                         ids=["100_50+20", "leading_empty", "all_empty", "trailing_empty+20"])
def test_unalign_never_reads_unowned_slots(lens, T):
  cu = cases.cu_from_lens(lens)
  layout = padding.layout_from_cu_seqlens(cu, T, 64)
  xa = _poisoned_aligned(layout.Ta)
  S = int(sum(lens))
  for out in (_unalign(xa, cu, layout.aligned_cu, T), padding.unalign_with(layout, xa)):
    out = np.asarray(out)
    assert out.shape == (1, T, 2, 3)
    np.testing.assert_array_equal(out[0, S:], 0.0)       # past cu[-1]: exactly 0, never x[0]
    acu = np.asarray(layout.aligned_cu)
    for n, L in enumerate(lens):
      np.testing.assert_array_equal(out[0, int(cu[n]):int(cu[n]) + L], xa[0, acu[n]:acu[n] + L])
  np.testing.assert_array_equal(np.asarray(padding.packed_owned_mask(layout)), np.arange(T) < S)


ROUND_TRIP = {
    "100_50": ([100, 50], 0),
    "with_empty": (cases.SEQ_LENS["with_empty"], 0),          # T = 57, not a multiple of BT
    "trailing_empty": (cases.SEQ_LENS["trailing_empty"], 0),
    "leading_empty": ([0, 5, 33], 0),
    "multiples": ([64, 32, 64], 0),
    "boundaries": (cases.SEQ_LENS["boundaries"], 0),
    "100_50+tail": ([100, 50], 37),                          # T > sum(lens)
    "trailing_empty+tail": (cases.SEQ_LENS["trailing_empty"], 11),
    "all_ones": ([1, 1, 1], 0),                               # Ta's worst case: N * (BT - 1) padding
}


@functools.partial(jax.jit, static_argnums=2)
def _round_trip(x, cu, BT):
  (xa,), acu = padding.align([x], cu, BT)
  layout = padding.layout_from_cu_seqlens(cu, x.shape[1], BT)
  assert layout.Ta == xa.shape[1]
  return xa, acu, padding.valid_mask(layout), padding.unalign(xa, cu, acu, x.shape[1])


@pytest.mark.parametrize("name,BT", [(n, 64) for n in ROUND_TRIP] + [
    (n, BT) for n in ("with_empty", "boundaries", "100_50+tail", "trailing_empty+tail") for BT in (16, 32)])
def test_align_unalign_round_trip(name, BT):
  lens, extra = ROUND_TRIP[name]
  S = int(sum(lens))
  T = S + extra
  x = _tokens(3, T)
  x[0, S:] = np.nan                                         # never read
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  xa, acu, valid, back = (np.asarray(a) for a in _round_trip(x, cu, BT))
  want, want_acu, want_valid = _expected_align(x, lens, BT)
  np.testing.assert_array_equal(acu, want_acu)
  assert xa.shape == want.shape, (xa.shape, want.shape)
  assert xa.shape[1] % BT == 0 and xa.shape[1] >= want_acu[-1]
  np.testing.assert_array_equal(xa, want)                   # padding slots exactly 0, no NaN
  np.testing.assert_array_equal(valid, want_valid)
  np.testing.assert_array_equal(back[0, :S], x[0, :S])
  np.testing.assert_array_equal(back[0, S:], 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_neutralize_gate_sets_minus_1e4_exactly_where_masked(dtype):
  rng = np.random.default_rng(4)
  g = jnp.asarray(2.0 * rng.standard_normal((2, 10, 3, 4)), dtype)
  m = rng.uniform(size=(2, 10)) < 0.6
  mask = jnp.asarray(m)
  assert m.any() and (~m).any()
  for fn in (padding.neutralize_gate, jax.jit(padding.neutralize_gate)):
    out = fn(g, mask)
    assert out.dtype == dtype and out.shape == g.shape
    out32, g32 = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (out, g))
    np.testing.assert_array_equal(out32[m], g32[m])
    np.testing.assert_array_equal(out32[~m], float(jnp.asarray(-1e4, dtype)))
  assert padding.NEUTRAL_GATE == -1e4


@pytest.mark.parametrize("acu,NTa,want", [
    # one empty sequence in the middle owns no chunk; two unowned tail chunks
    ([0, 128, 128, 192], 5, dict(seq=[0, 0, 2, -1, -1], local=[0, 1, 0, 0, 0],
                                 first=[1, 0, 1, 0, 0], last=[0, 1, 1, 0, 0])),
    ([0, 64, 256], 4, dict(seq=[0, 1, 1, 1], local=[0, 0, 1, 2], first=[1, 1, 0, 0], last=[1, 0, 0, 1])),
    # leading empty sequence
    ([0, 0, 64], 2, dict(seq=[1, -1], local=[0, 0], first=[1, 0], last=[1, 0])),
], ids=["inner_empty+tail", "long_second", "leading_empty"])
def test_chunk_table_by_hand(acu, NTa, want):
  for fn in (padding.chunk_table, jax.jit(padding.chunk_table, static_argnums=(1, 2))):
    table = fn(jnp.asarray(acu, jnp.int32), NTa, 64)
    for field, w in want.items():
      got = np.asarray(getattr(table, field))
      np.testing.assert_array_equal(got.astype(np.int32), np.asarray(w, np.int32), err_msg=field)


# (segment_ids, starts, lens) in the packed [B*T] buffer; MaxText convention
SEGMENTS = {
    "two_rows": ([[1, 1, 1, 2, 2, 0, 0, 3], [0, 5, 5, 0, 5, 7, 7, 7]],
                 [0, 3, 7, 9, 12, 13], [3, 2, 1, 2, 1, 3]),
    "same_id_across_rows": ([[0, 0, 4, 4], [4, 4, 0, 0]], [2, 4], [2, 2]),
    "same_id_split_by_0": ([[3, 3, 0, 3, 3, 3]], [0, 3], [2, 3]),
    "adjacent_ids": ([[1, 2, 2, 1]], [0, 1, 3], [1, 2, 1]),
    "padding_row": ([[0, 0, 0], [2, 2, 0]], [3], [2]),
}


@pytest.mark.parametrize("name", list(SEGMENTS))
def test_segment_ids_to_seqs(name):
  seg, starts, lens = SEGMENTS[name]
  seg = jnp.asarray(seg, jnp.int32)
  N = len(lens)
  assert padding.count_segments(seg) == N
  s, l = padding.segment_ids_to_seqs(seg, N)
  np.testing.assert_array_equal(np.asarray(s), starts)
  np.testing.assert_array_equal(np.asarray(l), lens)
  np.testing.assert_array_equal(np.asarray(padding.segment_ids_to_cu_seqlens(seg)),
                                np.concatenate([[0], np.cumsum(lens)]))
  # unused slots: empty sequences starting at B*T (nothing owned)
  s, l = padding.segment_ids_to_seqs(seg, N + 2)
  np.testing.assert_array_equal(np.asarray(s), starts + [seg.size] * 2)
  np.testing.assert_array_equal(np.asarray(l), lens + [0, 0])
  np.testing.assert_array_equal(np.asarray(padding.segment_ids_to_cu_seqlens(seg, N + 2)),
                                np.concatenate([[0], np.cumsum(lens + [0, 0])]))


def test_segment_layout_puts_tokens_at_their_runs():
  """The pipeline's segment_ids path: make_layout(starts, lens) aligns each run's own tokens."""
  seg, starts, lens = SEGMENTS["two_rows"]
  seg = jnp.asarray(seg, jnp.int32)
  s, l = padding.segment_ids_to_seqs(seg, len(lens))
  layout = padding.make_layout(s, l, seg.size, 16)
  x = _tokens(5, seg.size)
  xa = np.asarray(padding.align_with(layout, x))
  for n, (st, L) in enumerate(zip(starts, lens)):
    np.testing.assert_array_equal(xa[0, 16 * n:16 * n + L], x[0, st:st + L])
  back = np.asarray(padding.unalign_with(layout, xa))
  owned = np.asarray(seg).reshape(-1) > 0
  np.testing.assert_array_equal(back[0, owned], x[0, owned])
  np.testing.assert_array_equal(back[0, ~owned], 0.0)


def test_jit_traced_cu_seqlens_one_compile():
  traces = []

  @jax.jit
  def f(x, cu):
    traces.append(1)                                        # runs once per trace
    (xa,), acu = padding.align([x], cu, 32)
    return xa, acu, padding.unalign(xa, cu, acu, x.shape[1])

  T = 90
  x = _tokens(6, T)
  for lens in ([30, 50, 0], [61, 1, 20], [0, 0, 90]):       # same N, different lengths
    cu = cases.cu_from_lens(lens)
    xa, acu, back = f(x, cu)
    want, want_acu, _ = _expected_align(x, lens, 32)
    np.testing.assert_array_equal(np.asarray(acu), want_acu)
    np.testing.assert_array_equal(np.asarray(xa), want)
    S = sum(lens)
    np.testing.assert_array_equal(np.asarray(back)[0, :S], x[0, :S])
    np.testing.assert_array_equal(np.asarray(back)[0, S:], 0.0)
  assert len(traces) == 1
  assert f._cache_size() == 1


def test_jit_traced_segment_ids_one_compile():
  traces = []

  @functools.partial(jax.jit, static_argnums=1)
  def f(seg, N):
    traces.append(1)
    return padding.segment_ids_to_seqs(seg, N), padding.segment_ids_to_cu_seqlens(seg, N)

  for seg in ([[1, 1, 1, 2, 2, 0, 0, 3], [0, 5, 5, 0, 5, 7, 7, 7]],
              [[2, 2, 0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]]):
    seg = jnp.asarray(seg, jnp.int32)
    (s, l), cu = f(seg, 6)
    ws, wl = padding.segment_ids_to_seqs(seg, 6)             # eager
    np.testing.assert_array_equal(np.asarray(s), np.asarray(ws))
    np.testing.assert_array_equal(np.asarray(l), np.asarray(wl))
    np.testing.assert_array_equal(np.asarray(cu), np.concatenate([[0], np.cumsum(np.asarray(wl))]))
  assert len(traces) == 1
  # the second input: runs [0,2) id 2, [7,8) id 1 and row 1 all id 1 (a new sequence: rows never join)
  np.testing.assert_array_equal(np.asarray(s), [0, 7, 8, 16, 16, 16])
  np.testing.assert_array_equal(np.asarray(l), [2, 1, 8, 0, 0, 0])


def test_count_segments_of_concrete_ids_inside_a_trace():
  """chunk_kda counts the runs of concrete segment_ids even while tracing a function that closes
  over them (jit of a closure): the count must not go through traced jnp ops."""
  seg, starts, lens = SEGMENTS["two_rows"]
  seg = jnp.asarray(seg, jnp.int32)
  counted = []
  jax.jit(lambda x: counted.append(padding.count_segments(seg)) or x)(jnp.zeros(()))
  assert counted == [len(lens)]


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("lens, T", [([37, 0, 163, 1], 210), ([64, 64], 128), ([1, 127, 65, 63], 300), ([], 50)])
def test_chunk_rows_match_align_index(lens, T, traced):
  """chunk_rows is align_index by chunk: aligned row c*BT + r reads packed src[c] + r for
  r < count[c] and nothing (padding) after; the tail has count 0."""
  BT = 64
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))

  def rows(cu):
    layout = padding.layout_from_cu_seqlens(cu, T, BT)
    return padding.chunk_rows(layout), padding.align_index(layout)

  (src, count), idx = jax.jit(rows)(cu) if traced else rows(cu)
  src, count, idx = map(np.asarray, (src, count, idx))
  assert src.shape == count.shape == (idx.size // BT,)
  assert ((0 <= count) & (count <= BT)).all()
  p = np.arange(idx.size)
  want = np.where(p % BT < count[p // BT], src[p // BT] + p % BT, T)
  np.testing.assert_array_equal(want, idx)


def test_chunk_rows_of_segment_ids():
  seg, starts, lens = SEGMENTS["two_rows"]
  s, l = padding.segment_ids_to_seqs(jnp.asarray(seg, jnp.int32), len(lens))
  layout = padding.make_layout(s, l, np.asarray(seg).size, 16)
  src, count = map(np.asarray, padding.chunk_rows(layout))
  idx = np.asarray(padding.align_index(layout))
  p = np.arange(idx.size)
  np.testing.assert_array_equal(np.where(p % 16 < count[p // 16], src[p // 16] + p % 16, layout.T), idx)


@pytest.mark.parametrize("traced", [False, True])
def test_align_and_unalign_transpose_each_other(traced):
  """The vjp of align_with is unalign_with and vice versa (an exact transpose: <align x, y> ==
  <x, unalign y>), with padding slots, an empty sequence and tokens of no sequence (their gradient
  is exactly 0); and it is a gather, not autodiff's scatter-add."""
  lens, T, BT = [5, 0, 70, 20], 100, 32
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)

  def run(cu):
    lay = padding.layout_from_cu_seqlens(cu, T, BT)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, T, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (1, lay.Ta, 3))
    ax, a_vjp = jax.vjp(lambda x: padding.align_with(lay, x), x)
    uy, u_vjp = jax.vjp(lambda y: padding.unalign_with(lay, y), y)
    return (jnp.vdot(ax, y), jnp.vdot(x, uy), a_vjp(y)[0], uy, u_vjp(x)[0],
            padding.align_with(lay, x))

  f = jax.jit(run) if traced else run
  lhs, rhs, ga, uy, gu, ax = f(cu)
  np.testing.assert_allclose(float(lhs), float(rhs), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(ga), np.asarray(uy))
  np.testing.assert_array_equal(np.asarray(gu), np.asarray(ax))
  assert not np.asarray(ga)[0, sum(lens):].any()              # tokens of no sequence: exactly 0
  lay = padding.layout_from_cu_seqlens(cu, T, BT)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(padding.align_with(lay, x) ** 2)))(jnp.ones((1, T, 3))))
  assert "scatter-add" not in jaxpr and "scatter_add" not in jaxpr


def test_pad_to_capacity_keeps_results_and_compiles_once():
  """Padded to fixed capacities (empty sequences at the end, a tail of no sequence), batches of other
  N and T run one compiled program and give the unpadded results."""
  f = jax.jit(lambda q, k, v, g, beta, cu, h0: kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0,
                                                            output_final_state=True))
  for seed, lens in ((0, [5, 9, 3]), (1, [17, 1])):
    inp = cases.make_inputs(seed, lens=lens, H=2, K=8, V=8, gate="plain")
    h0 = jax.random.normal(jax.random.PRNGKey(seed + 7), (len(lens), 2, 8, 8))
    arrays, cu, h0p = kda.padding.pad_to_capacity((inp.q, inp.k, inp.v, inp.g, inp.beta), np.asarray(inp.cu_seqlens),
                                                  max_sequences=4, max_tokens=24, initial_state=np.asarray(h0))
    assert cu.shape == (5,) and arrays[0].shape[1] == 24 and h0p.shape[0] == 4
    o, ht = f(*arrays, cu, h0p)
    o_ref, ht_ref = kda.chunk_kda(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=inp.cu_seqlens, initial_state=h0,
                                  output_final_state=True)
    T = inp.q.shape[1]
    np.testing.assert_allclose(np.asarray(o[:, :T]), np.asarray(o_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ht[:len(lens)]), np.asarray(ht_ref), rtol=1e-5, atol=1e-6)
  assert f._cache_size() == 1


def test_pad_to_capacity_refuses_a_batch_over_capacity():
  x = np.zeros((1, 10, 2, 8), np.float32)
  with pytest.raises(ValueError, match="max_sequences must be >= the batch's number of sequences N=3, got 2"):
    kda.padding.pad_to_capacity((x,), [0, 3, 6, 10], max_sequences=2, max_tokens=16)
  with pytest.raises(ValueError, match="max_tokens must be >= the batch's length T=10, got 8"):
    kda.padding.pad_to_capacity((x,), [0, 3, 6, 10], max_sequences=4, max_tokens=8)
