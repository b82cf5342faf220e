"""DSA decode over a slot-split cache: the cache's slots over the `context` mesh axes (``cache_seq``), each
chip holding S / n of every row's slots, read in place from the stacked [layers, B, S, X] cache.

Left to XLA's sharding propagation, the read-only decode layer (glm5_jax/model/decode_rows.py) all-gathers
every layer's slot-split cache each step (a 204,800-slot cache over 2 chips: ~18 GB of ICI a step). Here each
shard works on its own slots and only per-query candidates and partial results cross the context axes:

* selection: each shard scores its S / n slots (global slot ids; the step's new keys at their slots) and keeps
  its top k; the n x k candidates (scores, slots) are all-gathered and their top k is the selection. A slot in
  the global top k is in its own shard's top k, and ties fall to the lower slot either way (a shard's
  candidates come in score order, lower slots first among equals, the shards in slot order), so the
  selection equals the top k over all slots;
* attention: each shard gathers the selected rows it holds (pallas_kernels/row_gather's ``decode_cache_read``
  impl on its stacked shard; the new row where the step's slot is its own) and attends over them alone:
  per query and head its max logit m, its sum of exponentials l and its unnormalised output o; the shards'
  parts combine as o = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M = max_c m_c (a psum and a pmax over
  the context axes of [B, T, H, v] and [B, T, H]).

Shapes as decode_rows': q_i [B, T, H_I, d_I], index keys [L, B, S, d_I] / new [B, T, d_I], w [B, T, H_I];
q_abs [B, T, H, C], latent [L, B, S, C] / new [B, T, C]; idx / valid [B, T, k]; positions [B, T].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model import decode_rows
from glm5_jax.parallel.axes import ACT_HEADS, BATCH, CACHE_SEQ, LAYERS
from glm5_jax.parallel.shard_map import logical_mesh_axes, logical_shard_map, logical_shard_start
from pallas_kernels.row_gather import ops as row_gather_ops

_STACKED = (LAYERS, BATCH, CACHE_SEQ, None)
_ROWS = (BATCH, None, None)


def topk(q_BTHD, keys_LBSD, layer, new_keys_BTD, w_BTH, positions_BT, k: int):
    """(idx [B, T, min(k, S)] int32, valid bool): each query's top-k visible slots of the slot-split stacked index
    keys of layer ``layer`` (module docstring), the same selection as decode_rows.topk_with_new_rows over all
    slots."""
    S = keys_LBSD.shape[2]

    def shard(q, keys_L, layer_, new, w, pos):
        keys = jax.lax.dynamic_index_in_dim(keys_L, layer_, axis=0, keepdims=False, allow_negative_indices=False)
        top, idx = decode_rows.topk_scores_with_new_rows(q, keys, new, w, pos, k,
                                                         logical_shard_start(CACHE_SEQ, keys.shape[1]))
        axes = logical_mesh_axes(CACHE_SEQ)
        top, idx = (jax.lax.all_gather(a, axes, axis=2, tiled=True) for a in (top, idx))
        best, at = jax.lax.top_k(top, min(k, S))
        return jnp.take_along_axis(idx, at, axis=2), best > -jnp.inf

    return logical_shard_map(
        shard, in_axes=((BATCH, None, None, None), _STACKED, (), _ROWS, _ROWS, (BATCH, None)),
        out_axes=(_ROWS, _ROWS))(q_BTHD, keys_LBSD, layer, new_keys_BTD, w_BTH, positions_BT)


def attend(q_BTHC, latent_LBSC, layer, new_latent_BTC, idx_BTK, valid_BTK, positions_BT, *, scale, v_dim,
           gather_impl):
    """[B, T, H, v_dim] in q's dtype: the absorbed attention of every head over its query's selected rows of the
    slot-split stacked latent cache of layer ``layer`` (module docstring), as decode_rows.attend_with_new_rows
    over all slots up to the fp32 summation order."""
    def shard(q, latent_L, layer_, new, idx, valid, pos):
        B, T, K = idx.shape
        S_local = latent_L.shape[2]
        local = idx - logical_shard_start(CACHE_SEQ, S_local)
        mine = valid & (local >= 0) & (local < S_local)
        cached = row_gather_ops.stacked_row_gather(latent_L, layer_, jnp.clip(local, 0, S_local - 1).reshape(B, T * K),
                                                   impl=gather_impl).reshape(B, T, K, -1)
        rows = decode_rows.rows_with_new_rows(cached, new, idx, pos)
        logits = jnp.einsum("btkc,bthc->bthk", rows, q.astype(rows.dtype), preferred_element_type=jnp.float32)
        logits = jnp.where(mine[:, :, None, :], logits * scale, -jnp.inf)
        m = jnp.max(logits, axis=-1)                                                   # -inf: none held here
        axes = logical_mesh_axes(CACHE_SEQ)
        top = jax.lax.pmax(m, axes)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        p = jnp.exp(logits - top[..., None])                                           # 0 where -inf
        o = jnp.einsum("bthk,btkc->bthc", p.astype(rows.dtype), rows[..., :v_dim], preferred_element_type=jnp.float32)
        o, l = jax.lax.psum((o, jnp.sum(p, axis=-1)), axes)
        return (o / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)

    heads = (BATCH, None, ACT_HEADS, None)
    return logical_shard_map(
        shard, in_axes=(heads, _STACKED, (), _ROWS, _ROWS, _ROWS, (BATCH, None)), out_axes=heads)(
        q_BTHC, latent_LBSC, layer, new_latent_BTC, idx_BTK, valid_BTK, positions_BT)
