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
