"""DSA decode against a cache that is read, not rewritten, by each layer (``decode_cache_write="rows"``).

With the default ``"layer"`` write each layer writes its new rows into its [B, S, X] cache and attends to the
result: inside the layer scan that makes a new copy of every layer's cache per decode step (read and written
whole, and the old and new stacked caches both live). Here a layer reads the cache as it was before the step
and returns only its new rows [B, T, X]; the decoder writes every layer's rows into the stacked cache after
its scan (`glm5_jax.model.kv_cache.write_stacked_rows`), in place. The new rows take part as if they were
already written:

* selection: indexer scores of the cached keys (slots outside the new rows) and of the new keys (placed at
  their slots), then top-k over the slots: the same scores, so the same selection, as over the written cache;
* attention: the selected latent rows gathered from the cache (`take_rows`, or in place from the stacked
  cache by pallas_kernels/row_gather with ``decode_cache_read``), those at new slots taken from the new rows.

Indexer score: I[t, s] = sum_h w[t, h] ReLU(q[t, h] . k[s]) (docs/architecture.md#lightning-indexer), fp32.
Shapes: q_i [B, T, H_I, d_I], keys [B, S, d_I] / new [B, T, d_I], w [B, T, H_I]; q_abs [B, T, H, C], latent
[B, S, C] / new [B, T, C]; idx / valid [B, T, k]; cached rows [B, T, k, C] (the cache's rows at idx).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _scores(q_BTHD, k_BSD, w_BTH):
    dots = jnp.einsum("bthd,bsd->bths", q_BTHD.astype(k_BSD.dtype), k_BSD, preferred_element_type=jnp.float32)
    return jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w_BTH.astype(jnp.float32))


def _new_slot_index(positions_BT, S, first_slot=0):
    """(j [B, 1, S]: the new row the slot first_slot + s holds (clipped), is_new [B, 1, S])."""
    j = first_slot + jnp.arange(S, dtype=jnp.int32)[None, None, :] - positions_BT[:, :1, None]
    T = positions_BT.shape[1]
    return jnp.clip(j, 0, T - 1), (j >= 0) & (j < T)


def topk_scores_with_new_rows(q_BTHD, keys_BSD, new_keys_BTD, w_BTH, positions_BT, topk: int, first_slot=0):
    """(top scores [B, T, k] fp32, -inf where not visible; their slots [B, T, k] int32), k = min(topk, S): each
    query's top-k visible slots among the S slots first_slot .. first_slot + S - 1 (slot s visible from
    position p iff s <= p), the new rows at slots positions[b, 0] ..."""
    S = keys_BSD.shape[1]
    j, is_new = _new_slot_index(positions_BT, S, first_slot)
    slot = first_slot + jnp.arange(S, dtype=jnp.int32)
    visible = slot[None, None, :] <= positions_BT[:, :, None]
    new_at_slot = jnp.take_along_axis(_scores(q_BTHD, new_keys_BTD, w_BTH),
                                      jnp.broadcast_to(j, (*positions_BT.shape, S)), axis=2)
    scores = jnp.where(is_new, new_at_slot, _scores(q_BTHD, keys_BSD, w_BTH))
    top, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(topk, S))
    return top, idx.astype(jnp.int32) + first_slot


def topk_with_new_rows(q_BTHD, keys_BSD, new_keys_BTD, w_BTH, positions_BT, topk: int):
    """(idx [B, T, k] int32, valid [B, T, k] bool), k = min(topk, S): each query's top-k visible slots
    (slot s visible from position p iff s <= p), the new rows at slots positions[b, 0] ..."""
    top, idx = topk_scores_with_new_rows(q_BTHD, keys_BSD, new_keys_BTD, w_BTH, positions_BT, topk)
    return idx, top > -jnp.inf


def take_rows(latent_BSC, idx_BTK):
    """[B, T, k, C]: the cache's rows at the selected slots (XLA's gather)."""
    return jax.vmap(lambda rows, i: rows[i])(latent_BSC, idx_BTK)


def rows_with_new_rows(cached_BTKC, new_latent_BTC, idx_BTK, positions_BT):
    """[B, T, k, C]: ``cached`` (the cache's rows at idx, as it was before the step), those at new slots replaced
    by the step's new rows."""
    T = positions_BT.shape[1]
    j = idx_BTK - positions_BT[:, :1, None]
    new = new_latent_BTC.astype(cached_BTKC.dtype)
    # one new row per batch row (T = 1) of several: broadcast it, no gather of it into every selected slot (XLA
    # fuses the select into both matmuls). A single batch row keeps the gather: XLA then writes the selected
    # rows once, small enough to stay on chip, and both matmuls read them there (one HBM read, not two).
    B = positions_BT.shape[0]
    new_BTKC = new[:, :, None, :] if T == 1 and B > 1 else take_rows(new, jnp.clip(j, 0, T - 1))
    return jnp.where(((j >= 0) & (j < T))[..., None], new_BTKC, cached_BTKC)


def attend_with_new_rows(q_BTHC, cached_BTKC, new_latent_BTC, idx_BTK, valid_BTK, positions_BT, *, scale, v_dim):
    """Absorbed attention of every head over its query's selected rows -> [B, T, H, v_dim] in q's dtype;
    ``cached`` the cache's rows at idx (as it was before the step), those at new slots replaced by new rows."""
    rows = rows_with_new_rows(cached_BTKC, new_latent_BTC, idx_BTK, positions_BT)
    logits = jnp.einsum("btkc,bthc->bthk", rows, q_BTHC.astype(rows.dtype), preferred_element_type=jnp.float32)
    logits = jnp.where(valid_BTK[:, :, None, :], logits * scale, -jnp.inf)
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bthk,btkc->bthc", probs.astype(rows.dtype), rows[..., :v_dim],
                     preferred_element_type=jnp.float32)
    return out.astype(q_BTHC.dtype)
