"""Which keys a query may see: same (non-padding) segment and not in the future.

Positions, not array indices, decide causality, so the same rule serves packed documents
(positions restart per document), right padding (segment 0) and a decode cache whose empty
slots carry segment 0.
"""
import jax.numpy as jnp


def visible_mask(q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS):
    """Boolean [B, T, S]: key s is visible from query t."""
    same_segment = q_seg_BT[:, :, None] == kv_seg_BS[:, None, :]
    not_padding = (q_seg_BT != 0)[:, :, None]
    causal = kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None]
    return same_segment & not_padding & causal


def selection_mask(idx_BTK, valid_BTK, num_keys):
    """Boolean [B, T, num_keys]: key s is among query t's valid selected slots (DSA top-k); slots
    pointing past num_keys are dropped."""
    B, T, _ = idx_BTK.shape
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(T)[None, :, None]
    return jnp.zeros((B, T, num_keys), bool).at[b, t, idx_BTK].max(valid_BTK, mode="drop")


def top_k_mask(scores_BTS, top_scores_BTK):
    """Boolean [B, T, S]: the keys ``lax.top_k(scores, k)`` picked, from the scores and the k values it
    returned, without a scatter: every key scoring above the k-th value, and of the keys scoring exactly
    the k-th value the lowest-indexed ones, as many as top_k took (lax.top_k puts the lower index first
    among equal values). Keys at -inf (not visible) are never picked. Equals ``selection_mask`` of the
    top-k's (idx, valid)."""
    kth = top_scores_BTK[..., -1:]
    at_kth = scores_BTS == kth
    taken_at_kth = jnp.sum(top_scores_BTK == kth, axis=-1, keepdims=True)
    rank_at_kth = jnp.cumsum(at_kth.astype(jnp.int32), axis=-1)
    return ((scores_BTS > kth) | (at_kth & (rank_at_kth <= taken_at_kth))) & (scores_BTS > -jnp.inf)
