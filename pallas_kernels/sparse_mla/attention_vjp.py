"""The identity-with-custom-VJP that attaches a hand-written attention backward to a forward's results.

A forward runs on detached inputs and returns (out, lse); `attention_vjp(grads)` gives a function that is the
identity on (out, lse) and whose VJP is ``grads(q, kv, idx, valid, dout, lse, delta, *static) -> (dq, dkv)``,
with the flash-attention row term ``delta = rowsum(dout * out) - dlse`` (d lse / d s = p, so an lse cotangent
enters exactly like -delta). A query without valid slots has lse = -inf and no dependence on q / kv: its lse
cotangent is dropped. Because the forward's results pass through unchanged, a remat policy that saves them by
name never reruns the forward for the backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def attention_vjp(grads):
    """``with_grads(q, kv, idx, valid, out, lse, static) -> (out, lse)``; ``static`` is a hashable tuple passed
    to ``grads`` after its array arguments."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def with_grads(q, kv, idx, valid, out, lse, static):
        return out, lse

    def fwd(q, kv, idx, valid, out, lse, static):
        return (out, lse), (q, kv, idx, valid, out, lse)

    def bwd(static, residuals, cotangents):
        q, kv, idx, valid, out, lse = residuals
        dout, dlse = cotangents
        dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
        dq, dkv = grads(q, kv, idx, valid, dout, lse, delta, *static)
        return dq.astype(q.dtype), dkv.astype(kv.dtype), None, None, None, None

    with_grads.defvjp(fwd, bwd)
    return with_grads
