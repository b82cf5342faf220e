"""The decode cache: per layer only what MLA + DSA need to attend to past tokens.

Background: docs/architecture.md#notation-and-sizes, #mla-attention, #lightning-indexer.

Per layer and token a slot holds the MLA latent row ``[c_kv (kv_lora_rank); k_rot (qk_rope_head_dim)]``
(post-norm, post-RoPE: 512 + 64 for GLM-5) and, on layers with their own indexer, the indexer key
(``index_head_dim``, 128). Keys and values are never expanded per head: attention runs in the absorbed
form against the latent rows. Slot s holds position s, so a batch of prompts of different lengths
shares one static-size cache and each row writes at its own positions.

Layout (a plain pytree, so it can be donated, sharded or inspected):

    {"decoder": {segment: {"layer_i": {"latent": [repeats, B, S, C], "index_key": [repeats, B, S, d_I]}}},
     "mtp": ({"latent": [B, S, C], "index_key": [B, S, d_I]},) * mtp_depth}

Shared-index layers have no ``index_key`` (they reuse the previous full layer's selection). With the pooled
indexer (GLM-5.3-Flash) ``index_key`` holds [key; pool gate score], 2 x d_I. A GLM-5.3-Flash KDA layer keeps
no slots but a fixed-size state (glm5_jax/model/kda_layer.py): ``kda_conv`` [B, W-1, 3 H K] (the conv's last
inputs), ``kda_state`` [B, H, K, V] fp32 (the recurrent state) and ``kda_seen`` [B] (positions absorbed). Each MTP
depth applies the one shared MTP block to different hidden states, so each depth has its own cache. With
``RuntimeConfig.capture_routing`` a layer also records its experts and top-k per slot
(glm5_jax/model/routing_replay.py: ``routed_experts`` [B, S, K], ``selected_slots`` [B, S, k] int32).

Every leaf's logical axes are ``([layers,] batch, cache_seq, None)``: `constrain_cache` lays a cache out
by the rules in context, `cache_shardings` gives its NamedShardings. Mapping ``cache_seq`` to a mesh axis
splits each row's slots across chips; what a decode step then moves between chips is in
docs/long_context.md.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layer_plan import LayerKind, plan_segments
from glm5_jax.model import routing_replay
from glm5_jax.parallel.axes import BATCH, CACHE_SEQ, LAYERS
from glm5_jax.parallel.shard_map import logical_axis_shards, logical_shard_map, logical_shard_start

# Logical axes of one layer's [B, S, X] leaf; decoder leaves carry their segment's repeats in front
# ("layers"). The slot axis is "cache_seq": mapped to a mesh axis, each chip holds S / n slots of every
# row (docs/long_context.md#a-sequence-sharded-decode-cache).
LAYER_AXES = (BATCH, CACHE_SEQ, None)


def _index_key_width(cfg: ModelConfig) -> int:
    return cfg.index_head_dim * (1 if cfg.index_kpool is None else 2)


def _layer_cache(cfg: ModelConfig, kind: LayerKind, batch, max_len, dtype, lead=()):
    layer = _attention_cache(cfg, kind, batch, max_len, dtype, lead)
    if cfg.runtime.capture_routing:     # glm5_jax/model/routing_replay.py
        layer.update(routing_replay.capture_leaves(cfg, kind, batch, max_len, lead))
    return layer


def _attention_cache(cfg: ModelConfig, kind: LayerKind, batch, max_len, dtype, lead=()):
    if kind.attention == "kda":
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        return {"kda_conv": jnp.zeros(lead + (batch, cfg.linear_conv_kernel_dim - 1, 3 * H * K), dtype),
                "kda_state": jnp.zeros(lead + (batch, H, K, K), jnp.float32),
                "kda_seen": jnp.zeros(lead + (batch,), jnp.int32)}
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layer = {"latent": jnp.zeros(lead + (batch, max_len, width), dtype)}
    if kind.indexer == "full":
        layer["index_key"] = jnp.zeros(lead + (batch, max_len, _index_key_width(cfg)), dtype)
    return layer


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, *, mtp: bool = False) -> dict:
    """A zero cache with ``max_len`` slots per row; ``dtype`` defaults to the model's compute dtype."""
    dtype = jnp.dtype(dtype or cfg.jnp_dtype)
    decoder = {seg.name: {f"layer_{u}": _layer_cache(cfg, kind, batch, max_len, dtype, (seg.repeats,))
                          for u, kind in enumerate(seg.unit)}
               for seg in plan_segments(cfg)}
    cache = {"decoder": decoder}
    if mtp:
        kind = LayerKind("moe", "full" if cfg.use_indexer else "none")
        cache["mtp"] = tuple(_layer_cache(cfg, kind, batch, max_len, dtype) for _ in range(cfg.mtp_depth))
    return cache


def cache_bytes_per_token(cfg: ModelConfig, dtype=None, *, mtp: bool = False) -> int:
    """Bytes one token occupies in the cache across all layers (~110 KB for GLM-5 in bf16)."""
    itemsize = np.dtype(jnp.dtype(dtype or cfg.jnp_dtype)).itemsize
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    per_layer = [width + (_index_key_width(cfg) if t == "full" else 0)
                 for t, a in zip(cfg.layer_indexer_types, cfg.layer_attention_types) if a == "mla"]
    if mtp and cfg.num_nextn_predict_layers:
        per_layer += [width + (cfg.index_head_dim if cfg.use_indexer else 0)] * cfg.mtp_depth
    return int(sum(per_layer) * itemsize)


def write_rows(cache_BSX, rows_BTX, positions_BT):
    """Write each row's T new entries at slots positions[b, 0] .. positions[b, 0] + T - 1 (contiguous)."""
    def one(c, r, start):
        return jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), start, axis=0)
    return jax.vmap(one)(cache_BSX, rows_BTX, positions_BT[:, 0])


def write_stacked_rows(cache, rows, positions_BT):
    """A segment's cache ({layer_i: {name: [repeats, B, S, X]}}) with every layer's new rows ({layer_i: {name:
    [repeats, B, T, X]}}) written at slots positions[b, 0] .. + T - 1 (``decode_cache_write="rows"``). With the
    slots split over `context` each shard writes the rows that fall in its slots (a write at a run-time slot of a
    sharded axis would otherwise gather the whole cache to every chip first)."""
    if logical_axis_shards(CACHE_SEQ) > 1:
        return jax.tree.map(lambda c, r: _write_slot_split(c, r, positions_BT[:, 0]), cache, rows)

    def one(c_RSX, r_RTX, start):
        return jax.lax.dynamic_update_slice(c_RSX, r_RTX.astype(c_RSX.dtype), (0, start, 0))
    write = jax.vmap(one, in_axes=(1, 1, 0), out_axes=1)
    return jax.tree.map(lambda c, r: write(c, r, positions_BT[:, 0]), cache, rows)


def _write_slot_split(cache_RBSX, rows_RBTX, start_B):
    """`write_stacked_rows` of one leaf per slot shard (`logical_shard_start`: a shard's first slot); rows outside
    its slots are dropped there."""
    def shard(c, r, start):
        S_local, T = c.shape[2], r.shape[2]
        slot = start[:, None] - logical_shard_start(CACHE_SEQ, S_local) + jnp.arange(T, dtype=jnp.int32)[None, :]
        slot = jnp.where((slot >= 0) & (slot < S_local), slot, S_local)                  # S_local: dropped
        return c.at[:, jnp.arange(c.shape[1])[:, None], slot].set(r.astype(c.dtype), mode="drop")

    stacked = (LAYERS,) + LAYER_AXES
    return logical_shard_map(shard, in_axes=(stacked, (LAYERS, BATCH, None, None), (BATCH,)), out_axes=stacked)(
        cache_RBSX, rows_RBTX, start_B)


def record_routing(cache_in: dict, cache_out: dict, positions_BT, expert_idx_BTK=None, selection=None) -> dict:
    """``cache_out`` (a layer's updated cache) with this step's routing (experts [B, T, K], the top-k selection)
    written at the tokens' slots into the recording leaves ``cache_in`` holds (glm5_jax/model/routing_replay.py);
    unchanged when it holds none."""
    out = dict(cache_out)
    if routing_replay.EXPERTS in cache_in and expert_idx_BTK is not None:
        out[routing_replay.EXPERTS] = write_rows(cache_in[routing_replay.EXPERTS], expert_idx_BTK, positions_BT)
    if routing_replay.SELECTED in cache_in and selection is not None:
        idx, valid = selection[:2]
        recorded = jnp.where(valid, idx, routing_replay.NOT_RECORDED)
        out[routing_replay.SELECTED] = write_rows(cache_in[routing_replay.SELECTED], recorded, positions_BT)
    return out


def cache_slots(cache_BSX):
    """(positions, segment ids) of a decode cache's slots: slot s holds position s, all in segment 1."""
    B, S = cache_BSX.shape[:2]
    return (jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)), jnp.ones((B, S), jnp.int32))


# a KDA layer's state leaves (no slot axis): batch, then unsharded state dims
KDA_LEAF_AXES = {"kda_conv": (BATCH, None, None), "kda_state": (BATCH, None, None, None), "kda_seen": (BATCH,)}


def leaf_axes(x, name: str | None = None) -> tuple:
    """Logical axis names of one cache leaf: [repeats,] B, S, X (a KDA leaf ``name``: `KDA_LEAF_AXES`)."""
    axes = KDA_LEAF_AXES.get(name, LAYER_AXES)
    return (LAYERS,) * (x.ndim - len(axes)) + axes


def _leaf_name(path):
    return getattr(path[-1], "key", None) if path else None


def constrain_cache(cache):
    """``cache`` laid out by the logical rules in context (``cache_seq`` on the slot axis); a no-op
    without a mesh and rules."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: nn.with_logical_constraint(x, leaf_axes(x, _leaf_name(p))), cache)


def cache_shardings(cache, mesh, rules) -> dict:
    """NamedShardings of every cache leaf under ``rules`` (e.g. to ``jax.device_put`` a cache)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, nn.logical_to_mesh_axes(leaf_axes(x, _leaf_name(p)), rules)), cache)
