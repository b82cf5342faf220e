"""Causal flash attention in the MHA form (training): the one place that picks how it runs, by ``impl``.

* ``"reference"``: `reference.flash_attention` over all queries at once, differentiated by JAX.
* ``"xla"``: the same, chunked over queries (each chunk rematerialised in the backward pass).
* ``"pallas"`` / ``"pallas_interpret"``: the TPU kernels of kernel.py (real Mosaic / the Pallas interpreter
  on CPU). JAX cannot differentiate ``pallas_call``: the forward runs on detached inputs, its results are
  named (``SAVED_NAMES``, so a remat policy keeping them never reruns it) and `_with_grads`, an identity
  with a custom VJP, attaches the backward kernels. T and S are padded to the blocks with segment 0 (seen
  by nobody, seeing nothing), head dims to multiples of 128 with zeros (logits unchanged; GLM-5's 256 need
  none), and the padding is cut off.

Shapes: q [B,T,H,D], k [B,S,H,D], v [B,S,H,Dv], positions / segment ids [B,T] and [B,S], optionally a
selection mask ``allowed`` [B,T,S] bool (a key is attended only where it is also allowed: DSA's top-k set)
-> out [B,T,H,Dv] in q's dtype, lse [B,T,H] fp32 (-inf for a query that sees no key).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.flash_attention import kernel, reference
from pallas_kernels.impls import PALLAS, PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.tpu_utils import pad_axis, removable_when_unused, round_up

IMPLS = (REFERENCE, XLA, PALLAS, PALLAS_INTERPRET)
SAVED_NAMES = ("flash_attention_out", "flash_attention_lse")
BLOCK = 512   # queries / keys per kernel block (a multiple of 128; smaller sequences use one padded block)


class FlashAttention(NamedTuple):
    out: jax.Array   # [B, T, H, Dv]
    lse: jax.Array   # [B, T, H] fp32 log-sum-exp of the scaled logits over the visible keys


def check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"flash_attention: unknown impl {impl!r}; choose one of {IMPLS}")


def flash_attention(q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, scale, impl=XLA,
                    block=BLOCK, q_chunk=512, allowed_BTS=None) -> FlashAttention:
    """Attention of every query over its visible keys (same non-zero segment, key position <= query
    position), restricted to ``allowed_BTS`` when given. ``q_chunk``: queries per chunk of the ``"xla"``
    impl; ``block``: the kernels' block size."""
    check_impl(impl)
    args = (q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS)
    if allowed_BTS is not None and allowed_BTS.shape != (q_BTHD.shape[0], q_BTHD.shape[1], k_BSHD.shape[1]):
        raise ValueError(f"flash_attention: allowed {allowed_BTS.shape} is not [B, T, S] of q {q_BTHD.shape}, "
                         f"k {k_BSHD.shape}")
    if impl in PALLAS_IMPLS:
        return FlashAttention(*_pallas(*args, allowed_BTS, scale=float(scale), block=block,
                                       interpret=impl == PALLAS_INTERPRET))
    chunk = None if impl == REFERENCE else q_chunk
    return FlashAttention(*reference.flash_attention(*args, scale=scale, q_chunk=chunk, allowed_BTS=allowed_BTS))


# ----------------------------------------------------------------------------------------- Pallas path
def _blocks(T, S, block):
    """(block_q, block_k): ``block``, or one block of the length rounded up to 128 when that is shorter."""
    return min(block, round_up(T, kernel.LANES)), min(block, round_up(S, kernel.LANES))


def _pad(args, bq, bk):
    """Operands padded along T to bq and along S to bk (padded rows get segment 0), head dims to 128."""
    q, k, v, q_pos, kv_pos, q_seg, kv_seg = args
    T, S = q.shape[1], k.shape[1]
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    D, Dv = (round_up(x.shape[3], kernel.LANES) for x in (q, v))
    return (_pad_head(pad_axis(q, 1, Tp), D), _pad_head(pad_axis(k, 1, Sp), D), _pad_head(pad_axis(v, 1, Sp), Dv),
            pad_axis(q_pos, 1, Tp), pad_axis(kv_pos, 1, Sp), pad_axis(q_seg, 1, Tp), pad_axis(kv_seg, 1, Sp))


def _pad_head(x, size):
    return pad_axis(x, 3, size)


def _pad_mask(allowed_BTS, bq, bk):
    """The selection mask as int8, padded along T and S with 0 (padded tokens are allowed nowhere)."""
    if allowed_BTS is None:
        return None
    T, S = allowed_BTS.shape[1:]
    return pad_axis(pad_axis(allowed_BTS.astype(jnp.int8), 1, round_up(T, bq)), 2, round_up(S, bk))


def _flash_fwd(allowed_BTS, *args, **static):
    return kernel.flash_fwd(*args, allowed_BTS=allowed_BTS, **static)


def _pallas(*args, scale, block, interpret):
    *args, allowed = args
    T, S = args[0].shape[1], args[1].shape[1]
    bq, bk = _blocks(T, S, block)
    sg = jax.lax.stop_gradient
    allowed = None if allowed is None else sg(allowed).astype(jnp.int8)
    out, lse_BHT = removable_when_unused(_flash_fwd, _pad_mask(allowed, bq, bk),
                                         *_pad(tuple(sg(x) for x in args), bq, bk),
                                         scale=scale, block_q=bq, block_k=bk, interpret=interpret)
    out = checkpoint_name(out[:, :T, :, :args[2].shape[3]], SAVED_NAMES[0])
    lse = checkpoint_name(jnp.swapaxes(lse_BHT, 1, 2)[:, :T], SAVED_NAMES[1])
    return _with_grads(*args, allowed, out, lse, (scale, bq, bk, interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _with_grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, allowed, out, lse, static):
    """The identity on (out, lse); its VJP runs the backward kernels."""
    return out, lse


def _with_grads_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, allowed, out, lse, static):
    return (out, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, allowed, out, lse)


def _with_grads_bwd(static, residuals, cotangents):
    scale, bq, bk, interpret = static
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, allowed, out, lse = residuals
    dout, dlse = cotangents
    T = q.shape[1]
    # d lse / d s = p: an lse cotangent enters like -delta; a query without keys has no dependence on q/k/v
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
    Tp = round_up(T, bq)
    dout_p = _pad_head(pad_axis(dout, 1, Tp), round_up(v.shape[3], kernel.LANES))
    lse_p, delta_p = (jnp.swapaxes(pad_axis(x.astype(jnp.float32), 1, Tp), 1, 2) for x in (lse, delta))
    dq, dk, dv = kernel.flash_bwd(*_pad((q, k, v, q_pos, kv_pos, q_seg, kv_seg), bq, bk), dout_p, lse_p, delta_p,
                                  scale=scale, block_q=bq, block_k=bk, allowed_BTS=_pad_mask(allowed, bq, bk),
                                  interpret=interpret)
    S = k.shape[1]
    D, Dv = q.shape[3], v.shape[3]
    return (dq[:, :T, :, :D].astype(q.dtype), dk[:, :S, :, :D].astype(k.dtype), dv[:, :S, :, :Dv].astype(v.dtype),
            None, None, None, None, None, None, None)


_with_grads.defvjp(_with_grads_fwd, _with_grads_bwd)
