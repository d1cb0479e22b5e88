"""Bad input to kda.chunk_kda raises ValueError (TypeError for dtypes) naming the argument and the
received value (docs/api.md). Every case fails in the up-front checks, before any computation."""
from __future__ import annotations

import re
from kda import plan as planning
from kda import stages

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from tests import cases

B, T, H, K, V = 1, 12, 2, 8, 8     # two sequences [5, 7]


@pytest.fixture(scope="module")
def inp():
  return cases.make_inputs(0, lens=[5, 7], H=H, K=K, V=V, gate="raw")


def call(inp, **over):
  args = {f: over.pop(f, getattr(inp, f)) for f in ("q", "k", "v", "g", "beta")}
  over.setdefault("cu_seqlens", inp.cu_seqlens)
  return kda.chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **over)


def two_rows(inp):
  """The same tensors with B = 2."""
  return {f: jnp.concatenate([getattr(inp, f)] * 2) for f in ("q", "k", "v", "g", "beta")}


def _m(*parts):
  """A regex matching the parts in order (escaped), anything in between."""
  return ".*".join(re.escape(p) for p in parts)


# (id, overrides (a function of inp), exception, message parts in order)
BAD = [
    ("q_rank", lambda i: dict(q=i.q[0]), ValueError, ("q must have rank 4", "got shape (12, 2, 8)")),
    ("k_rank", lambda i: dict(k=i.k[..., None]), ValueError, ("k must have rank 4", "got shape (1, 12, 2, 8, 1)")),
    ("v_rank", lambda i: dict(v=i.v[0]), ValueError, ("v must have rank 4", "got shape (12, 2, 8)")),
    ("g_rank", lambda i: dict(g=i.g[0]), ValueError, ("g must have rank 4", "got shape (12, 2, 8)")),
    ("beta_rank", lambda i: dict(beta=i.beta[..., None]), ValueError,
     ("beta must have rank 3", "got shape (1, 12, 2, 1)")),
    # one argument transposed to [B, H, T, K]: named, against the layout the others agree on
    ("q_transposed", lambda i: dict(q=jnp.swapaxes(i.q, 1, 2)), ValueError,
     ("q must have shape (1, 12, 2, 8) ([B, T, H, K]; B=1, T=12 as k, v, g, beta)", "got (1, 2, 12, 8)")),
    ("k_transposed", lambda i: dict(k=jnp.swapaxes(i.k, 1, 2)), ValueError,
     ("k must have shape (1, 12, 2, 8) ([B, T, H, K]", "got (1, 2, 12, 8)")),
    ("g_transposed", lambda i: dict(g=jnp.swapaxes(i.g, 1, 2)), ValueError,
     ("g must have shape (1, 12, 2, 8) ([B, T, HV, K]", "got (1, 2, 12, 8)")),
    ("k_shape", lambda i: dict(k=i.k[:, :, :1]), ValueError, ("k must have shape (1, 12, 2, 8)", "got (1, 12, 1, 8)")),
    ("k_head_dim", lambda i: dict(k=i.k[..., :4]), ValueError, ("k must have shape (1, 12, 2, 8)", "got (1, 12, 2, 4)")),
    ("v_tokens", lambda i: dict(v=i.v[:, :5]), ValueError, ("v must have shape [B=1, T=12", "got (1, 5, 2, 8)")),
    ("hv_not_multiple_of_h", lambda i: dict(v=jnp.concatenate([i.v, i.v[:, :, :1]], 2)), ValueError,
     ("HV must be a multiple of q's H=2", "got HV=3")),
    ("g_shape", lambda i: dict(g=i.g[..., :4]), ValueError, ("g must have shape (1, 12, 2, 8)", "got (1, 12, 2, 4)")),
    ("beta_shape", lambda i: dict(beta=i.beta[:, :, :1]), ValueError, ("beta must have shape (1, 12, 2)", "got (1, 12, 1)")),
    ("B2_with_cu_seqlens", lambda i: two_rows(i), ValueError, ("cu_seqlens requires B == 1", "got B=2")),
    ("cu_start", lambda i: dict(cu_seqlens=jnp.array([1, 5, 12], jnp.int32)), ValueError,
     ("cu_seqlens must start at 0", "got cu_seqlens[0]=1")),
    ("cu_decreasing", lambda i: dict(cu_seqlens=jnp.array([0, 7, 5, 12], jnp.int32)), ValueError,
     ("cu_seqlens must be non-decreasing", "cu_seqlens[1]=7 > cu_seqlens[2]=5")),
    ("cu_past_T", lambda i: dict(cu_seqlens=np.array([0, 5, 13], np.int32)), ValueError,
     ("cu_seqlens[-1] must be <= T=12", "got 13")),
    ("cu_empty", lambda i: dict(cu_seqlens=jnp.zeros((0,), jnp.int32)), ValueError,
     ("cu_seqlens must have at least one entry", "got an empty array")),
    ("cu_rank", lambda i: dict(cu_seqlens=jnp.array([[0, 5, 12]], jnp.int32)), ValueError,
     ("cu_seqlens must have rank 1", "got shape (1, 3)")),
    ("cu_float", lambda i: dict(cu_seqlens=jnp.array([0.0, 5.0, 12.0])), TypeError,
     ("cu_seqlens must have an integer dtype", "got float32")),
    ("initial_state_N", lambda i: dict(initial_state=jnp.zeros((3, 2, 8, 8))), ValueError,
     ("initial_state must have shape (2, 2, 8, 8)", "got (3, 2, 8, 8)")),
    ("initial_state_K", lambda i: dict(initial_state=jnp.zeros((2, 2, 4, 8))), ValueError,
     ("initial_state must have shape (2, 2, 8, 8)", "got (2, 2, 4, 8)")),
    ("initial_state_rank", lambda i: dict(initial_state=jnp.zeros((2, 8, 8))), ValueError,
     ("initial_state must have rank 4", "got shape (2, 8, 8)")),
    ("initial_state_int", lambda i: dict(initial_state=jnp.zeros((2, 2, 8, 8), jnp.int32)), TypeError,
     ("initial_state must have a floating dtype", "got int32")),
    ("A_log_missing", lambda i: dict(use_gate_in_kernel=True), ValueError, ("requires A_log", "got None")),
    ("A_log_shape", lambda i: dict(use_gate_in_kernel=True, A_log=jnp.zeros(3)), ValueError,
     ("A_log must have shape (2,)", "got (3,)")),
    ("A_log_int", lambda i: dict(use_gate_in_kernel=True, A_log=jnp.zeros(2, jnp.int32)), TypeError,
     ("A_log must have a floating dtype", "got int32")),
    ("dt_bias_shape", lambda i: dict(use_gate_in_kernel=True, A_log=i.A_log, dt_bias=jnp.zeros(8)), ValueError,
     ("dt_bias must have shape (16,)", "got (8,)")),
    ("A_log_without_gate_in_kernel", lambda i: dict(A_log=i.A_log), ValueError,
     ("A_log / dt_bias are only used with use_gate_in_kernel=True", "A_log=set")),
    ("lower_bound_below_-5_safe", lambda i: dict(safe_gate=True, lower_bound=-6.0), ValueError,
     ("lower_bound must be in [-5.0, 0) with safe_gate", "got -6.0")),
    ("lower_bound_0_safe", lambda i: dict(safe_gate=True, lower_bound=0.0), ValueError,
     ("lower_bound must be in [-5.0, 0)", "got 0.0")),
    ("lower_bound_positive", lambda i: dict(use_gate_in_kernel=True, lower_bound=0.5), ValueError,
     ("lower_bound must be in", "0)", "got 0.5")),
    ("safe_gate_without_lower_bound", lambda i: dict(safe_gate=True), ValueError,
     ("safe_gate=True requires lower_bound", "got lower_bound=None")),
    ("lower_bound_str", lambda i: dict(safe_gate=True, lower_bound="-1"), TypeError,
     ("lower_bound must be a float", "got str")),
    ("chunk_size_128", lambda i: dict(chunk_size=128), ValueError, ("chunk_size must be one of (16, 32, 64)", "got 128")),
    ("chunk_size_8", lambda i: dict(chunk_size=8), ValueError, ("chunk_size must be one of (16, 32, 64)", "got 8")),
    ("q_int", lambda i: dict(q=i.q.astype(jnp.int32)), TypeError, ("q must have a floating dtype", "got int32")),
    ("k_int", lambda i: dict(k=i.k.astype(jnp.int8)), TypeError, ("k must have a floating dtype", "got int8")),
    ("v_bool", lambda i: dict(v=i.v > 0), TypeError, ("v must have a floating dtype", "got bool")),
    ("g_int", lambda i: dict(g=i.g.astype(jnp.int32)), TypeError, ("g must have a floating dtype", "got int32")),
    ("beta_int", lambda i: dict(beta=i.beta.astype(jnp.int32)), TypeError, ("beta must have a floating dtype", "got int32")),
    ("scale_str", lambda i: dict(scale="0.5"), TypeError, ("scale must be a (static) real number or None", "got str")),
    # zero head counts / head dims (were ZeroDivisionError)
    ("K_zero", lambda i: dict(q=i.q[..., :0], k=i.k[..., :0], g=i.g[..., :0]), ValueError,
     ("q must have K >= 1", "got K=0", "(1, 12, 2, 0)")),
    ("V_zero", lambda i: dict(v=i.v[..., :0]), ValueError, ("v must have V >= 1", "got V=0", "(1, 12, 2, 0)")),
    ("H_zero", lambda i: dict(q=i.q[:, :, :0], k=i.k[:, :, :0]), ValueError,
     ("q must have H >= 1", "got H=0", "(1, 12, 0, 8)")),
    ("HV_zero", lambda i: dict(v=i.v[:, :, :0], g=i.g[:, :, :0], beta=i.beta[:, :, :0]), ValueError,
     ("v must have HV >= 1", "got HV=0", "(1, 12, 0, 8)")),
    # non-finite scale (was accepted: all NaN out)
    ("scale_nan", lambda i: dict(scale=float("nan")), ValueError, ("scale must be a finite real number", "got nan")),
    ("scale_inf", lambda i: dict(scale=np.float32(np.inf)), ValueError, ("scale must be a finite real number", "got inf")),
    ("scale_-inf", lambda i: dict(scale=-float("inf")), ValueError, ("scale must be a finite real number", "got -inf")),
    ("scale_bool", lambda i: dict(scale=True), TypeError, ("scale must be a (static) real number or None", "got bool")),
    # values that do not fit int32 (used to wrap silently in the cast)
    ("cu_int64_overflow", lambda i: dict(cu_seqlens=np.array([0, 5, 2 ** 32 + 12], np.int64)), ValueError,
     ("cu_seqlens values must fit int32 [-2147483648, 2147483647]", "got cu_seqlens[2]=4294967308", "int64")),
    ("cu_list_overflow", lambda i: dict(cu_seqlens=[0, 2 ** 40, 12]), ValueError,
     ("cu_seqlens values must fit int32", f"got cu_seqlens[1]={2 ** 40}")),
    ("cu_uint32_overflow", lambda i: dict(cu_seqlens=np.array([0, 5, 2 ** 31], np.uint32)), ValueError,
     ("cu_seqlens values must fit int32", f"got cu_seqlens[2]={2 ** 31}", "uint32")),
    ("cu_int64_underflow", lambda i: dict(cu_seqlens=np.array([0, -2 ** 32 + 5, 12], np.int64)), ValueError,
     ("cu_seqlens values must fit int32", f"got cu_seqlens[1]={-2 ** 32 + 5}")),
    ("segment_ids_int64_overflow", lambda i: dict(cu_seqlens=None, segment_ids=np.full((1, 12), 2 ** 32 + 1, np.int64)),
     ValueError, ("segment_ids values must fit int32", "got segment_ids[0, 0]=4294967297")),
    # lower_bound must be a finite negative number
    ("lower_bound_-inf", lambda i: dict(use_gate_in_kernel=True, lower_bound=-float("inf")), ValueError,
     ("lower_bound must be a finite negative number", "gradients of A_log and dt_bias are undefined", "got -inf")),
    ("lower_bound_-inf_numpy", lambda i: dict(use_gate_in_kernel=True, lower_bound=np.float32(-np.inf)), ValueError,
     ("lower_bound must be a finite negative number", "got -inf")),
    ("lower_bound_nan", lambda i: dict(use_gate_in_kernel=True, lower_bound=float("nan")), ValueError,
     ("lower_bound must be a finite negative number", "got nan")),
    ("lower_bound_-inf_safe", lambda i: dict(safe_gate=True, lower_bound=-float("inf")), ValueError,
     ("lower_bound must be a finite negative number", "got -inf")),
    ("lower_bound_numpy_below_-5_safe", lambda i: dict(safe_gate=True, lower_bound=np.float32(-6.0)), ValueError,
     ("lower_bound must be in [-5.0, 0) with safe_gate", "got -6.0")),
    ("lower_bound_numpy_positive", lambda i: dict(use_gate_in_kernel=True, lower_bound=np.float64(0.5)), ValueError,
     ("lower_bound must be in", "0)", "got 0.5")),
    ("lower_bound_bool", lambda i: dict(use_gate_in_kernel=True, lower_bound=True), TypeError,
     ("lower_bound must be a float", "got bool")),
    ("lower_bound_numpy_bool", lambda i: dict(use_gate_in_kernel=True, lower_bound=np.bool_(True)), TypeError,
     ("lower_bound must be a float", "got bool")),
    ("impl_unknown", lambda i: dict(impl="triton"), ValueError, ("impl must be", "got 'triton'")),
    ("impl_unknown_stage", lambda i: dict(impl={"intraa": "reference"}), ValueError,
     ("impl names unknown stages ['intraa']",)),
    ("impl_unknown_stage_impl", lambda i: dict(impl={"intra": "cuda"}), ValueError,
     ("impl['intra'] must be one of", "got 'cuda'")),
    ("impl_type", lambda i: dict(impl=3), TypeError, ("impl must be None, a str or a dict", "got int")),
    ("impl_dict_missing_kernel", lambda i: dict(impl={"bwd_dav": "pallas"}), ValueError,
     ("impl['bwd_dav'] = 'pallas'", "stage 'bwd_dav' has no 'pallas' implementation", "it has reference")),
    ("cu_and_segment_ids", lambda i: dict(segment_ids=jnp.ones((1, 12), jnp.int32)), ValueError,
     ("either cu_seqlens or segment_ids", "got both")),
    ("segment_ids_negative", lambda i: dict(cu_seqlens=None, segment_ids=-jnp.ones((1, 12), jnp.int32)), ValueError,
     ("segment_ids must be >= 0", "got min -1")),
    ("segment_ids_shape", lambda i: dict(cu_seqlens=None, segment_ids=jnp.ones((1, 11), jnp.int32)), ValueError,
     ("segment_ids must have shape (1, 12)", "got (1, 11)")),
    ("segment_ids_rank", lambda i: dict(cu_seqlens=None, segment_ids=jnp.ones((12,), jnp.int32)), ValueError,
     ("segment_ids must have rank 2", "got shape (12,)")),
    ("segment_ids_float", lambda i: dict(cu_seqlens=None, segment_ids=jnp.ones((1, 12))), TypeError,
     ("segment_ids must have an integer dtype", "got float32")),
    ("num_segments_too_small", lambda i: dict(cu_seqlens=None, segment_ids=jnp.asarray([[1] * 4 + [2] * 4 + [3] * 4]),
                                             num_segments=2), ValueError,
     ("num_segments must be >= the number of sequences in segment_ids (3)", "got 2")),
    ("segment_initial_state_too_small", lambda i: dict(cu_seqlens=None, segment_ids=jnp.asarray([[1] * 4 + [2] * 4 + [3] * 4]),
                                                      initial_state=jnp.zeros((2, 2, 8, 8))), ValueError,
     ("initial_state.shape[0] must be >= the number of sequences in segment_ids (3)", "got 2")),
    ("num_segments_negative", lambda i: dict(cu_seqlens=None, segment_ids=jnp.ones((1, 12), jnp.int32),
                                            num_segments=-1), ValueError, ("num_segments must be a non-negative", "got -1")),
    ("num_segments_float", lambda i: dict(cu_seqlens=None, segment_ids=jnp.ones((1, 12), jnp.int32),
                                         num_segments=3.5), ValueError, ("num_segments must be a non-negative", "got 3.5")),
    ("num_segments_vs_initial_state", lambda i: dict(cu_seqlens=None, segment_ids=jnp.ones((1, 12), jnp.int32),
                                                    num_segments=3, initial_state=jnp.zeros((2, 2, 8, 8))), ValueError,
     ("num_segments must equal initial_state.shape[0]=2", "got 3")),
]


@pytest.mark.parametrize("over,exc,parts", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_with_argument_and_value(inp, over, exc, parts):
  with pytest.raises(exc, match=_m(*parts)):
    call(inp, **over(inp))


def test_traced_segment_ids_need_num_segments(inp):
  f = jax.jit(lambda seg: call(inp, cu_seqlens=None, segment_ids=seg))
  with pytest.raises(ValueError, match=_m("traced segment_ids", "pass num_segments=N", "got neither")):
    f(jnp.ones((1, T), jnp.int32))


def test_traced_segment_ids_bad_num_segments(inp):
  f = jax.jit(lambda seg: call(inp, cu_seqlens=None, segment_ids=seg, num_segments=-2))
  with pytest.raises(ValueError, match=_m("num_segments must be a non-negative", "got -2")):
    f(jnp.ones((1, T), jnp.int32))


def test_traced_cu_seqlens_still_checks_dtype_and_rank(inp):
  with pytest.raises(TypeError, match=_m("cu_seqlens must have an integer dtype", "got float32")):
    jax.jit(lambda cu: call(inp, cu_seqlens=cu))(jnp.array([0.0, 5.0, 12.0]))
  with pytest.raises(ValueError, match=_m("cu_seqlens must have rank 1", "got shape (1, 3)")):
    jax.jit(lambda cu: call(inp, cu_seqlens=cu))(jnp.array([[0, 5, 12]], jnp.int32))


def test_good_input_variants_are_accepted(inp):
  """The checks do not reject what docs/api.md allows: cu_seqlens as a list or numpy array, a lower_bound
  below -5 without safe_gate, lower_bound without A_log (the sigmoid form)."""
  f = jax.jit(lambda q, k, v, g, beta: kda.chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 5, 12],
                                                     use_gate_in_kernel=True, lower_bound=-7.0))
  o, _ = f(inp.q, inp.k, inp.v, inp.g, inp.beta)
  assert o.shape == inp.v.shape and np.isfinite(np.asarray(o)).all()


def test_recurrent_kda_rejects_bad_heads_and_batch(inp):
  with pytest.raises(ValueError, match=_m("HV=3", "H=2")):
    kda.reference.recurrent_kda(inp.q, inp.k, jnp.concatenate([inp.v, inp.v[:, :, :1]], 2), inp.g, inp.beta)
  rows = two_rows(inp)
  with pytest.raises(ValueError, match=_m("cu_seqlens requires B == 1", "got B=2")):
    kda.reference.recurrent_kda(rows["q"], rows["k"], rows["v"], rows["g"], rows["beta"],
                                cu_seqlens=inp.cu_seqlens)


def test_recurrent_kda_rejects_bad_values(inp):
  with pytest.raises(ValueError, match=_m("cu_seqlens values must fit int32", "got cu_seqlens[2]=4294967308")):
    kda.reference.recurrent_kda(inp.q, inp.k, inp.v, inp.g, inp.beta,
                                cu_seqlens=np.array([0, 5, 2 ** 32 + 12], np.int64))
  with pytest.raises(ValueError, match=_m("head counts and head dims must be >= 1", "K=0")):
    kda.reference.recurrent_kda(inp.q[..., :0], inp.k[..., :0], inp.v, inp.g[..., :0], inp.beta)


def test_autodiff_backward_with_kernels_is_refused():
  from kda.api import chunk_kda_with
  inp = cases.make_inputs(0, lens=[30, 20], H=1, K=16, V=16)
  with pytest.raises(ValueError, match=re.escape("got kernels for stages ['intra']")):
    chunk_kda_with(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=inp.cu_seqlens,
                   impl={"intra": "pallas"}, backward="autodiff")


def test_impl_string_takes_the_backend_where_a_stage_has_it():
  """impl="pallas": kernels for the stages that have one, the xla implementation (else the
  reference) for the others (a dict is strict, see impl_dict_missing_kernel above)."""
  plan = planning.make_plan(scale=1.0, chunk_size=16, impl="pallas")
  for n in stages.names():
    have = stages.get(n).implementations()
    want = "pallas" if "pallas" in have else "xla" if "xla" in have else "reference"
    assert plan.impl(n) == want, (n, plan.impl(n))
  assert plan.impl("intra") == "pallas" and plan.impl("bwd_dav") == "reference"
