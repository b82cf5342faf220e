"""The KDA (Kimi Delta Attention) core as a plain per-token recurrence: the readable stand-in with the
interface of the chunked kernels, called only through this module.

Per head, with the state S [K, V], q and k L2-normalised by the caller, the gate g in log space per key
channel and beta in (0, 1) (Kimi Linear report, arXiv:2510.26692, eq. 1; transformers'
``recurrent_kimi_delta_attention``):

    S_t = diag(exp(g_t)) S_{t-1};   S_t += k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = S_t^T (q_t / sqrt(K))

All math in fp32. ``segment_ids_BT`` (> 0: a document, 0: padding) reset the state where a new document
starts; a padding token leaves it unchanged (its output is garbage, as every padding row's is).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _step(state_BHKV, q_BHK, k_BHK, v_BHV, g_BHK, beta_BH):
    state = state_BHKV * jnp.exp(g_BHK)[..., None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", state, k_BHK, precision=_HI)
    delta = (v_BHV - kv_mem) * beta_BH[..., None]
    state = state + k_BHK[..., None] * delta[:, :, None, :]
    return jnp.einsum("bhkv,bhk->bhv", state, q_BHK, precision=_HI), state


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, initial_state_BHKV=None, segment_ids_BT=None,
              chunk_size=64, impl="xla"):
    """-> (o [B, T, H, V] fp32, final state [B, H, K, V] fp32). ``chunk_size`` / ``impl`` belong to the
    chunked kernels' interface; this recurrence ignores them."""
    del chunk_size, impl
    q, k, v, g, beta = _f32(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
    B, T, H, K = q.shape
    q = q * K ** -0.5
    state = (jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state_BHKV is None
             else initial_state_BHKV.astype(jnp.float32))
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    padding = seg == 0
    starts = (seg != jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)) & ~padding   # a new document: reset

    def scan_step(state, xs):
        q_t, k_t, v_t, g_t, b_t, start_t, pad_t = xs
        state = jnp.where(start_t[:, None, None, None], 0.0, state)
        o_t, new = _step(state, q_t, k_t, v_t, g_t, b_t)
        return jnp.where(pad_t[:, None, None, None], state, new), o_t

    time_major = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts, padding))
    state, o_TBHV = jax.lax.scan(scan_step, state, time_major)
    return jnp.moveaxis(o_TBHV, 0, 1), state


def kda_decode_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV):
    """One token -> (o [B, H, V] fp32, the new state [B, H, K, V] fp32)."""
    q, k, v, g, beta, state = _f32(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV)
    return _step(state, q * q.shape[-1] ** -0.5, k, v, g, beta)
