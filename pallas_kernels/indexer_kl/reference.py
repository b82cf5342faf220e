"""DSA indexer KL loss in plain XLA (docs/architecture.md#dsa-training-stages-and-the-indexer-kl,
docs/training.md#dsa-stages).

Target p[t, :]: the main (absorbed MLA) attention probabilities of every head, summed over heads and
L1-normalised over the key set; computed from *detached* q/kv (Megatron passes query.detach(),
key.detach()), so only the indexer inputs receive gradients.

    warmup: set = every visible key          loss_t = KL(p_t || softmax(I_t))   over visible s
    sparse: set = the selected valid slots   both distributions renormalised over that set

The warm-up form also takes a mask ``allowed_BTS`` [B, T, S] (set = visible and allowed keys): with
``masking.selection_mask`` of the selection it is the sparse stage's KL computed densely, as when the
sparse attention runs as masked dense attention (its lse then covers the same set).

Loss = mean over query tokens that have a non-empty set. KL is sum_s p log p - p log q with q taken as
an exact log-softmax (Megatron adds 1e-10 inside both logs; the difference is O(1e-10)). Then
d loss / d I[t, s] = (softmax(I_t) - p_t)[s] / n_tokens on the set and 0 elsewhere.

Warm-up target from the attention's own log-sum-exp (``lse_BTH``, the flash kernel's fp32 lse in the MHA
form): each head's probabilities are exp(s - lse) directly, p = sum_h exp(s_h - lse_h) / H, so a chunk
recomputes its logits from the MHA query and per-head keys (2 x 256 FLOPs per pair and head for GLM-5
against 2 x 576 in the absorbed form) and needs no max or sum pass over the keys.

Memory: queries are processed in chunks, so forward and backward hold at most [B, T_chunk, H, S]
attention logits (warm-up, whose chunks are rematerialised under ``jax.checkpoint``) and never
[B, T, S, H]. In the sparse stage each chunk keeps O(B * T_chunk * k) values for the backward pass: the
target p (no gradient) and the selected keys' scores, whose VJP (selected_scores.py) recomputes the
per-head dots instead of keeping [B, T_chunk, k, H] of them.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.chunking import merge_queries
from pallas_kernels.indexer_kl.selected_scores import selected_index_scores
from pallas_kernels.lightning_indexer.reference import index_scores
from pallas_kernels.masking import visible_mask
from pallas_kernels.sparse_mla.reference import gather_rows

STAGES = ("warmup", "sparse")


def head_summed_target(logits_BTHN, allowed_BTN):
    """Per-head softmax over the allowed set, summed over heads, L1-normalised -> p [B, T, N]."""
    logits = jnp.where(allowed_BTN[:, :, None, :], logits_BTHN, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
    summed = jnp.sum(probs, axis=2)
    return summed / jnp.maximum(jnp.sum(summed, axis=-1, keepdims=True), 1e-30)


def head_summed_target_from_lse(logits_BTHN, lse_BTH, allowed_BTN):
    """The same target from each head's known log-sum-exp: exp(s - lse) over the allowed set, summed over
    heads, L1-normalised (the normalisation only absorbs rounding: every head's row already sums to 1)."""
    lse = jnp.where(jnp.isfinite(lse_BTH), lse_BTH, 0.0)[..., None]
    probs = jnp.where(allowed_BTN[:, :, None, :], jnp.exp(logits_BTHN - lse), 0.0)
    summed = jnp.sum(probs, axis=2)
    return summed / jnp.maximum(jnp.sum(summed, axis=-1, keepdims=True), 1e-30)


def kl_per_token(p_BTN, scores_BTN, allowed_BTN):
    """KL(p || softmax(scores)) over the allowed set -> (kl [B, T], has_set [B, T] bool)."""
    has_set = jnp.any(allowed_BTN, axis=-1)
    masked = jnp.where(allowed_BTN, scores_BTN, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    shifted = jnp.where(allowed_BTN, scores_BTN - row_max, 0.0)  # finite everywhere: safe gradients
    log_norm = jnp.log(jnp.sum(jnp.where(allowed_BTN, jnp.exp(shifted), 0.0), axis=-1, keepdims=True)
                       + (~has_set)[..., None])
    log_q = shifted - log_norm
    terms = jax.scipy.special.xlogy(p_BTN, p_BTN) - p_BTN * log_q
    kl = jnp.sum(jnp.where(allowed_BTN, terms, 0.0), axis=-1)
    return jnp.where(has_set, kl, 0.0), has_set


def _warmup_chunk(q, kv, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, lse=None, allowed=None, *, scale):
    visible = visible_mask(q_pos, kv_pos, q_seg, kv_seg)
    if allowed is not None:   # the key set: visible and allowed
        visible = visible & (allowed != 0)
    if lse is None:   # absorbed: q [B, t, H, C] on the latent rows kv [B, S, C]
        logits = jnp.einsum("bthc,bsc->bths", q, kv, preferred_element_type=jnp.float32) * scale
        p = head_summed_target(logits, visible)
    else:             # MHA: q [B, t, H, D] on per-head keys kv [B, S, H, D], with the attention's lse
        logits = jnp.einsum("bthd,bshd->bths", q, kv, preferred_element_type=jnp.float32) * scale
        p = head_summed_target_from_lse(logits, lse, visible)
    return kl_per_token(p, index_scores(iq, ik, iw, visible), visible)


def _sparse_target(q, kv, idx, valid, *, scale):
    rows_BTKC = gather_rows(kv, idx)
    # key-major per query ([k, C] @ [C, H]): several times faster on XLA:CPU than [H, C] @ [C, k]
    logits_BTKH = jnp.einsum("btkc,bthc->btkh", rows_BTKC, q, preferred_element_type=jnp.float32) * scale
    return head_summed_target(jnp.swapaxes(logits_BTKH, 2, 3), valid)


def _sparse_chunk_kl(p, iq, ik, iw, idx, valid):
    # Indexer scores of the selected keys only: I[t, j] = sum_h w[t, h] ReLU(q[t, h] . k[idx[t, j]]);
    # its VJP recomputes the per-head dots, so nothing [B, T_chunk, k, H] is kept for the backward
    return kl_per_token(p, selected_index_scores(iq, ik, iw, idx), valid)


def indexer_kl_loss(q_BTHC, kv_BSC, index_q_BTHD, index_k_BSD, index_w_BTH,
                    q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, scale, stage,
                    idx_BTK=None, valid_BTK=None, target_BTK=None, lse_BTH=None, allowed_BTS=None, q_chunk=128):
    """Scalar indexer loss; gradients reach only index_q / index_k / index_w (q and kv are detached).

    Warm-up stage: with ``lse_BTH`` (the attention's fp32 log-sum-exp [B, T, H]) q is the MHA query
    [B, T, H, D] and kv the per-head keys [B, S, H, D] the attention used; without it, the absorbed q
    [B, T, H, C] and latent rows kv [B, S, C]. ``allowed_BTS`` (bool or int [B, T, S], optional) restricts
    each query's key set to its visible keys with allowed != 0 (``lse_BTH`` must then be over that set).

    Sparse stage: ``target_BTK`` may carry the head-averaged attention probabilities over the selected
    slots when the caller already has them (the XLA sparse attention computes them from the same
    logits: `sparse_mla.reference.sparse_mla(..., with_target=True)`); q and kv are then unused.
    """
    kl_BT, has_set_BT = indexer_kl_per_token(
        q_BTHC, kv_BSC, index_q_BTHD, index_k_BSD, index_w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS,
        scale=scale, stage=stage, idx_BTK=idx_BTK, valid_BTK=valid_BTK, target_BTK=target_BTK, lse_BTH=lse_BTH,
        allowed_BTS=allowed_BTS, q_chunk=q_chunk)
    return mean_over_tokens(kl_BT, has_set_BT)


def mean_over_tokens(kl_BT, has_set_BT):
    """The loss from per-token KL: mean over the query tokens that have a non-empty key set."""
    return jnp.sum(kl_BT) / jnp.maximum(jnp.sum(has_set_BT.astype(jnp.float32)), 1.0)


def indexer_kl_per_token(q_BTHC, kv_BSC, index_q_BTHD, index_k_BSD, index_w_BTH,
                         q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, scale, stage,
                         idx_BTK=None, valid_BTK=None, target_BTK=None, lse_BTH=None, allowed_BTS=None,
                         q_chunk=128):
    """(kl [B, T] fp32, has_set [B, T] bool) per query token (arguments as `indexer_kl_loss`): callers
    that hold a share of the queries (a context-parallel shard) sum them across shards themselves."""
    if stage not in STAGES:
        raise ValueError(f"indexer_kl_loss: stage must be one of {STAGES}, got {stage!r}")
    if allowed_BTS is not None and stage != "warmup":
        raise ValueError("indexer_kl_loss: allowed_BTS serves the warm-up form (the sparse stage takes idx_BTK)")
    if stage == "sparse" and (idx_BTK is None or valid_BTK is None):
        raise ValueError("indexer_kl_loss: the sparse stage needs idx_BTK and valid_BTK")
    if lse_BTH is not None and (stage != "warmup" or kv_BSC.ndim != 4):
        raise ValueError("indexer_kl_loss: lse_BTH serves the warm-up stage with per-head keys kv [B, S, H, D]")
    q_BTHC, kv_BSC = jax.lax.stop_gradient(q_BTHC), jax.lax.stop_gradient(kv_BSC)
    B, T = index_q_BTHD.shape[:2]
    n_chunks = -(-T // q_chunk)
    pad = n_chunks * q_chunk - T

    def split(x):  # [B, T, ...] -> [n_chunks, B, q_chunk, ...]; padded queries get segment 0
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n_chunks, q_chunk, *x.shape[2:]), 1, 0)

    if stage == "warmup":
        per_query = (q_BTHC, index_q_BTHD, index_w_BTH, q_pos_BT, q_seg_BT)
        optional = {"lse": None if lse_BTH is None else jax.lax.stop_gradient(lse_BTH), "allowed": allowed_BTS}
        optional = {name: x for name, x in optional.items() if x is not None}
        per_query += tuple(optional.values())

        def chunk_kl(xs, ik):
            return _warmup_chunk(xs[0], kv_BSC, xs[1], ik, xs[2], xs[3], kv_pos_BS, xs[4], kv_seg_BS,
                                 **dict(zip(optional, xs[5:])), scale=scale)
    else:
        given = target_BTK is not None
        per_query = (jax.lax.stop_gradient(target_BTK) if given else q_BTHC, index_q_BTHD, index_w_BTH, idx_BTK,
                     valid_BTK)

        def chunk_kl(xs, ik):
            q_or_p, iq, iw, idx, valid = xs
            # the target has no gradient: it is kept for the backward pass, not rematerialised
            p = q_or_p if given else _sparse_target(q_or_p, kv_BSC, idx, valid, scale=scale)
            return _sparse_chunk_kl(p, iq, ik, iw, idx, valid)

    if stage == "warmup":
        chunk_kl = jax.checkpoint(chunk_kl)

    def step(carry, xs):
        return carry, chunk_kl(xs, index_k_BSD)

    _, (kl, has_set) = jax.lax.scan(step, None, tuple(split(x) for x in per_query))
    return merge_queries(kl, T), merge_queries(has_set, T)
