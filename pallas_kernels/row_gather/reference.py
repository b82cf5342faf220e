"""The XLA form of the stacked row gather: rows idx[b, k] of layer ``layer`` of a stacked cache.

Shapes: cache [L, B, S, C], idx [B, K] int32 -> [B, K, C]. Letters: L stacked layers, B batch rows, S slots
(rows) per batch row, C row width, K gathered rows per batch row. Out-of-range indices (and a layer outside
[0, L)) are clamped into range, as XLA's gather clamps its start indices: the caller masks what it must not
use (decode masks the logits of unselected rows, glm5_jax/model/decode_rows.py).
"""
import jax
import jax.numpy as jnp


def stacked_row_gather(cache_LBSC, layer, idx_BK):
    L, _, S, _ = cache_LBSC.shape
    rows_BSC = jax.lax.dynamic_index_in_dim(cache_LBSC, jnp.clip(layer, 0, L - 1), axis=0, keepdims=False)
    return jax.vmap(lambda rows, i: jnp.take(rows, jnp.clip(i, 0, S - 1), axis=0))(rows_BSC, idx_BK)
