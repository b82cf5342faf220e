"""The LM head's logits and the next-token negative log-likelihood, whole or in chunks of positions.

Legend: B batch rows, T positions, D model width, V vocabulary, n chunks of C positions (n C >= T).

`chunked_token_nll` gives the same per-token NLL as `token_nll(head_logits(...))` without ever holding
[B, T, V] logits: the positions are cut into n chunks of C (chunk j takes positions j, n + j, 2n + j, ...:
strided, so a sequence split over context shards gives every shard its share of every chunk), a `lax.scan`
computes each chunk's logits, their log-sum-exp and the target's logit, and `jax.checkpoint` on the chunk
makes the backward pass recompute that chunk's logits instead of saving them. Peak memory is one chunk's
[B, C, V] logits and their gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.layers import constrain, einsum
from glm5_jax.parallel.axes import ACT_VOCAB, BATCH, SEQ, VOCAB


def head_logits(h_BTD, w_DV, dtype, impl, grad_dtype="float32"):
    """fp32 logits [B, T, V] of the final-norm output `h` under the head weight `w` (products in `dtype`; the
    weight's gradient emitted in `grad_dtype`: `glm5_jax.model.layers.einsum`)."""
    return constrain(einsum("btd,dv->btv", h_BTD, w_DV, dtype, jnp.float32, impl, grad_dtype),
                     (BATCH, SEQ, ACT_VOCAB))


def token_nll(logits_BTV, targets_BT):
    """-log softmax(logits)[target] per position, fp32 [B, T]."""
    logits = logits_BTV.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets_BT[..., None], -1)[..., 0]


def chunked_token_nll(h_BTD, w_DV, targets_BT, *, chunk, dtype, impl, grad_dtype="float32"):
    """`token_nll(head_logits(h, w), targets)` [B, T], computed C = ``chunk`` positions at a time (see the
    module docstring). T need not be a multiple of C: the positions are padded to n C = ceil(T / C) C
    (zero hidden states, target 0) and the padding's NLL dropped.

    The head weight is cast to ``dtype`` and laid out as the products read it (the model width whole) once,
    outside the loop, so the chunks do not gather it again; its gradient is summed over the chunks in
    ``dtype``."""
    if not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(f"chunked_token_nll: chunk={chunk!r} must be a positive int (positions per chunk)")
    B, T, D = h_BTD.shape
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    # position t = i n + j is row i of chunk j: [B, C, n, ...] -> [n, B, C, ...]
    h_nBCD = jnp.moveaxis(h_BTD.reshape(B, chunk, n, D), 2, 0)
    targets_nBC = jnp.moveaxis(targets_BT.reshape(B, chunk, n), 2, 0)
    w_DV = constrain(w_DV.astype(dtype), (None, VOCAB))

    @jax.checkpoint
    def chunk_nll(w, h_BCD, targets_BC):
        return token_nll(head_logits(h_BCD, w, dtype, impl, grad_dtype), targets_BC)

    _, nll_nBC = jax.lax.scan(lambda carry, xs: (carry, chunk_nll(w_DV, *xs)), None, (h_nBCD, targets_nBC))
    return jnp.moveaxis(nll_nBC, 0, 2).reshape(B, n * chunk)[:, :T]
