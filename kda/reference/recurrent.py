"""The token-by-token KDA recurrence: the ground truth of every test.

For one sequence and one value head, state S [K, V], for t = 0..L-1:

    S   = diag(exp(g_t)) @ S
    S   = S + beta_t * k_t^T (v_t - k_t @ S)
    o_t = scale * q_t @ S

Varlen: one scan over the packed tokens; the state is reset to initial_state[n] at the first token
of sequence n and copied to final_state[n] after its last. Tokens past cu_seqlens[-1] belong to no
sequence: they get o = 0 and are never read (their values are masked before any arithmetic).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kda._vma import vary_like
from kda.shapes import check_fits_int32

HI = lax.Precision.HIGHEST


def _math_dtype(*xs):
  return jnp.promote_types(jnp.float32, jnp.result_type(*[x.dtype for x in xs]))


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
  """q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (log-space, activated); beta [B,T,HV].

  Returns (o [B,T,HV,V] in v.dtype, final_state [N,HV,K,V] float32 or None). Math in float32
  (float64 when an input is float64 and x64 is on). Arrays may be jax or numpy (cu_seqlens also a
  list); T == 0 and empty sequences are valid (final state = initial state).
  """
  q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if min(H, K, HV, V) < 1:
    raise ValueError(f"head counts and head dims must be >= 1, got H={H}, K={K}, HV={HV}, V={V}")
  if HV % H:
    raise ValueError(f"v heads HV={HV} must be a multiple of q/k heads H={H}")
  dt = _math_dtype(q, k, v, g, beta)
  out_dtype = v.dtype
  scale = K ** -0.5 if scale is None else scale
  if cu_seqlens is None:
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    q, k, v, g, beta = (x.reshape((1, B * T) + x.shape[2:]) for x in (q, k, v, g, beta))
  else:
    if B != 1:
      raise ValueError(f"cu_seqlens requires B == 1, got B={B}")
    if not isinstance(cu_seqlens, jax.Array):
      cu_seqlens = np.asarray(cu_seqlens)
    check_fits_int32("cu_seqlens", cu_seqlens)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  N = cu.shape[0] - 1
  Tp = q.shape[1]
  rep = HV // H
  q, k = (jnp.repeat(x[0].astype(dt), rep, axis=1) for x in (q, k))   # [Tp, HV, K]
  v, g, beta = v[0].astype(dt), g[0].astype(dt), beta[0].astype(dt)
  h0 = (jnp.zeros((N, HV, K, V), dt) if initial_state is None
        else jnp.asarray(initial_state).astype(dt))

  t = jnp.arange(Tp)
  seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, max(N - 1, 0))
  owned = t < cu[-1]
  first = owned & (t == cu[seq])
  last = owned & (t == cu[seq + 1] - 1)
  m = owned[:, None, None]
  q, k, v, g = (jnp.where(m, x, 0) for x in (q, k, v, g))
  beta = jnp.where(owned[:, None], beta, 0)

  def step(carry, x):
    S, final = carry
    qt, kt, vt, gt, bt, n, is_first, is_last, is_owned = x
    S = jnp.where(is_first, h0[n], S)
    S = S * jnp.exp(gt)[:, :, None]
    pred = jnp.einsum("hk,hkv->hv", kt, S, precision=HI)
    S = S + jnp.einsum("hk,hv->hkv", kt, bt[:, None] * (vt - pred), precision=HI)
    o = scale * jnp.einsum("hk,hkv->hv", qt, S, precision=HI)
    final = final.at[n].set(jnp.where(is_last, S, final[n]))
    return (S, final), jnp.where(is_owned, o, 0)

  xs = (q, k, v, g, beta, seq, first, last, owned)
  init = vary_like((jnp.zeros((HV, K, V), dt), h0), xs)
  (_, final), o = lax.scan(step, init, xs)
  o = o.reshape((B, T, HV, V)).astype(out_dtype)
  if not output_final_state:
    return o, None
  return o, final
