"""The XLA form of sparse MLA decode: one new token per batch row attends, in the absorbed (latent) form, over
the latent rows its DSA top-k selected from one layer of a stacked cache.

Shapes: cache [L, B, S, C], idx / valid [B, K], q [B, H, C], new [B, C], pos [B] -> [B, H, V]. Letters: L
stacked layers, B batch rows, S cache slots per batch row, C latent row width (kv_lora + rope), K selected
slots, H heads (those of the shard), V value width (the first V channels of a row: kv_lora).

The row at slot pos[b] is the token's own new row, not yet written to the cache: it replaces the cached row
there. Row k of batch row b is r_k = new[b] if idx[b, k] == pos[b] else cache[layer, b, idx[b, k]] (indices and
the layer clamped into range); logits[h, k] = scale * (q[b, h] . r_k) in fp32, -inf where not valid[b, k];
out[b, h] = sum_k softmax(logits)[h, k] r_k[:V], the probabilities rounded to the cache dtype for the product
(the computation of glm5_jax/model/decode_rows.attend_with_new_rows at one token).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.row_gather.reference import stacked_row_gather


def sparse_mla_decode(cache_LBSC, layer, idx_BK, valid_BK, q_BHC, new_BC, pos_B, *, scale, v_dim):
    cached_BKC = stacked_row_gather(cache_LBSC, layer, idx_BK)
    is_new = (idx_BK == pos_B[:, None])[..., None]
    rows_BKC = jnp.where(is_new, new_BC[:, None, :].astype(cached_BKC.dtype), cached_BKC)
    logits = jnp.einsum("bkc,bhc->bhk", rows_BKC, q_BHC.astype(rows_BKC.dtype), preferred_element_type=jnp.float32)
    logits = jnp.where(valid_BK[:, None, :], logits * scale, -jnp.inf)
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bhk,bkv->bhv", probs.astype(rows_BKC.dtype), rows_BKC[..., :v_dim],
                     preferred_element_type=jnp.float32)
    return out.astype(q_BHC.dtype)
