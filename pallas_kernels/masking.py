"""Which keys a query may see: same (non-padding) segment and not in the future.

Positions, not array indices, decide causality, so the same rule serves packed documents
(positions restart per document), right padding (segment 0) and a decode cache whose empty
slots carry segment 0.
"""
import jax
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
    # The batch and query axes are the scatter's batching dimensions (vmap), not iota index columns. XLA's SPMD
    # partitioner (jax 0.10.2), scattering indices whose batch splits over one mesh axis into an operand whose
    # batch splits over another, pads a batch that does not divide its shards with zeros: index (0, 0, 0) and,
    # for an update computed after the padding (valid = score > -inf), True, so a pad row marks slot 0 of row 0.
    # With batching dimensions a pad row can only write into its own (pad) row.
    def one_query(idx_K, valid_K):
        return jnp.zeros((num_keys,), bool).at[idx_K].max(valid_K, mode="drop")

    return jax.vmap(jax.vmap(one_query))(idx_BTK, valid_BTK)


def top_k_mask(scores_BTS, top_scores_BTK, top_idx_BTK):
    """Boolean [B, T, S]: the keys ``lax.top_k(scores, k)`` picked, from the scores and the values and
    indices it returned, without a scatter: every key scoring above the k-th value, and of the keys scoring
    exactly the k-th value those at or below the highest index top_k took among them (lax.top_k puts the
    lower index first among equal values, so the tied keys it takes are the lowest-indexed ones). Keys at
    -inf (not visible) are never picked. Equals ``selection_mask`` of the top-k's (idx, valid). Elementwise
    over [T, S] plus a reduction over k: no scan along S."""
    kth = top_scores_BTK[..., -1:]
    last_tied = jnp.max(jnp.where(top_scores_BTK == kth, top_idx_BTK, -1), axis=-1, keepdims=True)
    key = jnp.arange(scores_BTS.shape[-1], dtype=top_idx_BTK.dtype)
    tied_and_taken = (scores_BTS == kth) & (key <= last_tied)
    return ((scores_BTS > kth) | tied_and_taken) & (scores_BTS > -jnp.inf)
