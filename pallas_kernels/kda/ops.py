"""Kimi Delta Attention (the channel-wise gated delta rule of GLM-5.3-Flash's linear-attention layers) behind
an ``impl`` switch, and the one-token decode step.

* ``"reference"``: reference.chunk_kda, the readable chunked form (materialises [C, C, K] decays; small
  shapes only), differentiated by JAX.
* ``"xla"``: the kernels' per-chunk math (chunk_step.py) under ``lax.scan`` over chunks, vmapped over rows
  and heads (the diagonal blocks' columns in a ``fori_loop``: one body to compile), each chunk
  rematerialised in the backward pass; differentiated by JAX.
* ``"pallas"`` / ``"pallas_interpret"``: the TPU kernels of kernel.py (Mosaic / the Pallas interpreter on
  CPU) under a custom VJP: the forward saves the state at every chunk start, the backward kernel runs the
  chunks in reverse.

Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [B, H, K, V]. q and k arrive
L2-normalised; the query scale K^-0.5 is applied here. g is the log forget gate (<= 0). Computation is fp32;
o comes in q's dtype, the final state in fp32. Packed documents (``segment_ids_BT``, nonzero, padding 0):
the state restarts at every change of id, only the row's first segment sees ``initial_state_BHKV``, padding
passes the state through, and the final state is the one after the row's last token: its last document's
(see reference.py).
Padding: T up to the chunk with k = v = g = beta = 0 in the last token's segment (the state passes through
it unchanged); K and V up to multiples of 128 with zeros (the kernels only), cut off afterwards.

`chunk_kda_flat` takes and returns the heads' channels flat, [B, T, H * K] (head h's channels at h * K ...):
the kernels' own layout. On TPU a [B, T, H, K] array is tiled over (H, K) and its flat form over (T, H * K), so
reshaping one into the other is a copy; callers whose activations are flat pass them flat.
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.kda import kernel, reference
from pallas_kernels.kda.chunk_step import chunk_step
from pallas_kernels.tpu_utils import LANES, pad_axis, round_up

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"chunk_kda: unknown impl {impl!r}; choose one of {IMPLS}")


def chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, initial_state_BHKV=None, segment_ids_BT=None,
              chunk_size=64, impl=XLA):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32)."""
    check_impl(impl)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    if chunk_size % 16:
        raise ValueError(f"chunk_kda: chunk_size={chunk_size} must be a multiple of 16")
    init = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BHKV is None
            else initial_state_BHKV.astype(jnp.float32))
    if impl == REFERENCE:
        return reference.chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, init, segment_ids_BT, chunk_size)
    Tp = round_up(T, chunk_size)
    g, beta, seg_BT = reference.pass_state_through_padding(g_BTHK, beta_BTH, segment_ids_BT)
    seg_BT, prev_BT = _chunk_segments(seg_BT, Tp, chunk_size)
    q, k, v, g, beta = (pad_axis(x, 1, Tp) for x in (q_BTHK, k_BTHK, v_BTHV, g, beta))
    if impl == XLA:
        o, final = _scan_chunks(q, k, v, g, beta, seg_BT, prev_BT, init, chunk=chunk_size)
    else:
        Kp, Vp = round_up(K, LANES), round_up(V, LANES)
        q, k, g = (pad_axis(x, 3, Kp).reshape(B, Tp, H * Kp) for x in (q, k, g))
        v = pad_axis(v, 3, Vp).reshape(B, Tp, H * Vp)
        init_p = pad_axis(pad_axis(init, 2, Kp), 3, Vp)
        o, final = _pallas_flat(q, k, v, g, beta, seg_BT, prev_BT, init_p, K**-0.5, chunk_size, impl)
        o, final = o.reshape(B, Tp, H, Vp)[..., :V], final[:, :, :K, :V]
    return o[:, :T].astype(q_BTHK.dtype), final


def chunk_kda_flat(q_BTC, k_BTC, v_BTC, g_BTC, beta_BTH, *, initial_state_BHKV=None, segment_ids_BT=None,
                   chunk_size=64, impl=XLA):
    """`chunk_kda` on flat heads: q, k, g [B, T, H * K], v [B, T, H * V], beta [B, T, H] -> (o [B, T, H * V] in
    q's dtype, final state [B, H, K, V] fp32). The Pallas impls read and write the flat arrays as they are when K
    and V are whole lane tiles (GLM-5.3-Flash: 128); otherwise this is `chunk_kda` on the [B, T, H, K] views."""
    check_impl(impl)
    B, T, HK = q_BTC.shape
    H = beta_BTH.shape[-1]
    K, V = HK // H, v_BTC.shape[-1] // H
    if impl not in PALLAS_IMPLS or K % LANES or V % LANES:
        heads = (x.reshape(B, T, H, -1) for x in (q_BTC, k_BTC, v_BTC, g_BTC))
        o, final = chunk_kda(*heads, beta_BTH, initial_state_BHKV=initial_state_BHKV, segment_ids_BT=segment_ids_BT,
                             chunk_size=chunk_size, impl=impl)
        return o.reshape(B, T, H * V), final
    if chunk_size % 16:
        raise ValueError(f"chunk_kda: chunk_size={chunk_size} must be a multiple of 16")
    init = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BHKV is None
            else initial_state_BHKV.astype(jnp.float32))
    Tp = round_up(T, chunk_size)
    g, beta, seg_BT = reference.pass_state_through_padding(g_BTC, beta_BTH, segment_ids_BT)
    seg_BT, prev_BT = _chunk_segments(seg_BT, Tp, chunk_size)
    q, k, v, g, beta = (pad_axis(x, 1, Tp) for x in (q_BTC, k_BTC, v_BTC, g, beta))
    o, final = _pallas_flat(q, k, v, g, beta, seg_BT, prev_BT, init, K**-0.5, chunk_size, impl)
    return o[:, :T].astype(q_BTC.dtype), final


def _pallas_flat(q, k, v, g, beta_BTH, seg_BT, prev_BT, init, scale, chunk, impl):
    """The kernels on T-padded flat channels (q, k, g [B, Tp, H * Kp], v [B, Tp, H * Vp]; Kp, Vp lane multiples)."""
    beta = jnp.swapaxes(beta_BTH.astype(jnp.float32), 1, 2)[..., None]
    meta = tuple(x.astype(jnp.float32)[..., None] for x in (seg_BT, prev_BT))
    return _pallas(q, k, v, g, beta, *meta, init, (scale, chunk, impl == PALLAS_INTERPRET))


def kda_decode_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV):
    """One token: (o [B, H, V] in q's dtype, the new state [B, H, K, V] fp32)."""
    q, k, v, g, beta, S = (x.astype(jnp.float32) for x in (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV))
    o, S = reference.recurrent_step(S, q * q.shape[-1]**-0.5, k, v, g, beta)
    return o.astype(q_BHK.dtype), S


def _chunk_segments(seg_BT, Tp, chunk):
    """(segment id, the id of the document whose state enters the token's chunk) [B, Tp] int32: the padded
    tail continues the last token's segment; chunk 0's entering state is the row's first segment's."""
    B, T = seg_BT.shape
    seg = jnp.pad(seg_BT, [(0, 0), (0, Tp - T)], mode="edge")
    seg_BNC = seg.reshape(B, Tp // chunk, chunk)
    prev_BN1 = jnp.concatenate([seg_BNC[:, :1, :1], seg_BNC[:, :-1, -1:]], axis=1)
    return seg, jnp.broadcast_to(prev_BN1, seg_BNC.shape).reshape(B, Tp)


# ------------------------------------------------------------------------------------------------ XLA path
def _scan_chunks(q, k, v, g, beta, seg_BT, prev_BT, init_BHKV, *, chunk):
    B, Tp, H, K = q.shape
    N = Tp // chunk

    def chunks(x):   # [B, Tp, H, ...] -> [N, B, H, C, ...]
        return jnp.moveaxis(x.reshape(B, N, chunk, H, *x.shape[3:]), (1, 3), (0, 2))

    xs = tuple(chunks(x.astype(jnp.float32)) for x in (q, k, v, g, beta[..., None]))
    meta = tuple(jnp.moveaxis(x.astype(jnp.float32).reshape(B, N, chunk, 1), 1, 0) for x in (seg_BT, prev_BT))
    step = functools.partial(chunk_step, scale=K**-0.5, loop=True)
    per_head = jax.vmap(step, in_axes=(0, 0, 0, 0, 0, 0, None, None))
    per_row = jax.vmap(per_head, in_axes=(0,) * 8)

    @jax.checkpoint
    def body(S, x):
        o, S = per_row(S, *x)
        return S, o

    final, o_NBHCV = jax.lax.scan(body, init_BHKV, xs + meta)
    return jnp.moveaxis(o_NBHCV, (0, 2), (1, 3)).reshape(B, Tp, H, -1), final


# --------------------------------------------------------------------------------------------- Pallas path
@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _pallas(q, k, v, g, beta, seg, prev, init, static):
    scale, chunk, interpret = static
    o, final, _ = kernel.kda_fwd(q, k, v, g, beta, seg, prev, init, scale=scale, chunk=chunk, save_states=False,
                                 interpret=interpret)
    return o, final


def _pallas_fwd(q, k, v, g, beta, seg, prev, init, static):
    scale, chunk, interpret = static
    o, final, states = kernel.kda_fwd(q, k, v, g, beta, seg, prev, init, scale=scale, chunk=chunk,
                                      save_states=True, interpret=interpret)
    return (o, final), (q, k, v, g, beta, seg, prev, states)


def _pallas_bwd(static, residuals, cotangents):
    scale, chunk, interpret = static
    q, k, v, g, beta, seg, prev, states = residuals
    do, dfinal = cotangents
    dq, dk, dv, dg, dbeta, dinit = kernel.kda_bwd(q, k, v, g, beta, seg, prev, states, do.astype(q.dtype),
                                                  dfinal.astype(jnp.float32), scale=scale, chunk=chunk,
                                                  interpret=interpret)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype), dbeta,
            jnp.zeros_like(seg), jnp.zeros_like(prev), dinit)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)
