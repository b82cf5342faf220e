"""Routing replay: the experts a sampler routed each token to and the slots its DSA indexer selected for it,
recorded while decoding and replayed by a later forward (the RL learner's) instead of recomputed.

A learner that recomputes the router's top-k and the indexer's top-k from its own activations can choose
differently from the sampler wherever the two sides' numbers differ (dtype, INT4 experts, kernels): the
token was then sampled by one sub-network and is trained through another. Replaying the sampler's choices
closes that part of the train / inference mismatch (Rollout Routing Replay: Ma et al. 2025, "Stabilizing
MoE Reinforcement Learning by Aligning Training and Inference Routers"; the same idea for the indexer's
top-k). The gates and the attention weights are still computed by the forward that replays: only the
discrete choices are taken over, so gradients reach the router as usual.

Recording (``RuntimeConfig.capture_routing``): the decode cache gets two more leaves per layer, written at
the token's slot like its latent row, so every path that decodes over a cache (generation, the serving
engine, prefix reuse, mesh layouts) carries them without knowing what they are:

    "routed_experts" [repeats, B, S, K] int32  on MoE layers: the K experts of the token at slot s
    "selected_slots" [repeats, B, S, k] int32  on full-indexer MLA layers: the slots the query at s attended

Replaying: ``Transformer.__call__(..., replay=tree)`` with a tree of the same shape over the forward's T
positions ({segment: {layer_i: {name: [repeats, B, T, X]}}}). A row of -1 (`NOT_RECORDED`) is a token the
sampler never ran (e.g. a row's last token, padding): the layer uses its own choice there. Unselected
entries of a recorded selection are -1 too. Letters: B rows, T / S positions / slots, K experts per token,
k selected slots per query, L layers.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glm5_jax.model import pooled_indexer
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layer_plan import LayerKind, plan_segments
from pallas_kernels.masking import selection_mask

EXPERTS = "routed_experts"
SELECTED = "selected_slots"
NOT_RECORDED = -1


def selection_width(cfg: ModelConfig, num_keys: int) -> int:
    """k of a full layer's selection over ``num_keys`` keys: min(index_topk, keys), or the pooled indexer's."""
    if cfg.index_kpool is not None:
        return pooled_indexer.selection_width(cfg, num_keys)
    return min(cfg.index_topk, num_keys)


def records_selection(cfg: ModelConfig, kind: LayerKind) -> bool:
    return kind.attention == "mla" and kind.indexer == "full" and cfg.use_indexer


def capture_leaves(cfg: ModelConfig, kind: LayerKind, batch: int, max_len: int, lead=()) -> dict:
    """The recording leaves of one layer's decode cache, every entry `NOT_RECORDED`."""
    leaves = {}
    if kind.mlp == "moe":
        leaves[EXPERTS] = jnp.full(lead + (batch, max_len, cfg.num_experts_per_tok), NOT_RECORDED, jnp.int32)
    if records_selection(cfg, kind):
        leaves[SELECTED] = jnp.full(lead + (batch, max_len, selection_width(cfg, max_len)), NOT_RECORDED, jnp.int32)
    return leaves


def _recorded(replay_BTX):
    """[B, T] (or [N]): which tokens' rows were recorded."""
    return replay_BTX[..., 0] != NOT_RECORDED


def replay_experts(own_idx_NK, replay_NK):
    """The experts a token is routed to: the recorded ones where there are, its own elsewhere."""
    return jnp.where(_recorded(replay_NK)[:, None], replay_NK, own_idx_NK).astype(jnp.int32)


def fit_width(idx_BTk, k: int):
    """A recorded selection laid out ``k`` wide: padded with -1, or its recorded entries moved to the front
    (stable) and the rest cut. The recorder's k may exceed this forward's (its cache had more slots than this
    sequence has keys); a query never has more recorded entries than visible keys, so nothing recorded is cut."""
    kr = idx_BTk.shape[-1]
    if kr < k:
        return jnp.pad(idx_BTk, ((0, 0), (0, 0), (0, k - kr)), constant_values=NOT_RECORDED)
    if kr > k:
        order = jnp.argsort(idx_BTk == NOT_RECORDED, axis=-1, stable=True)
        idx_BTk = jnp.take_along_axis(idx_BTk, order, axis=-1)[..., :k]
    return idx_BTk


def replay_selection(own: tuple, replay_BTk, num_keys: int) -> tuple:
    """A full layer's selection with the recorded rows replayed: ``own`` is (idx, valid[, mask]) as the layer
    computed it ([B, T, k], [B, T, k], the mask [B, T, S] int8 where the core attends over a mask)."""
    if len(own) > 3:
        raise NotImplementedError("routing replay with the top-k's log-sum-exp (the sparse-stage indexer KL on "
                                  "the masked flash core) is not supported: replay in a forward without the KL")
    idx = fit_width(replay_BTk, own[0].shape[-1])
    rec = _recorded(replay_BTk)[..., None]
    valid = idx != NOT_RECORDED
    new = (jnp.where(rec, jnp.maximum(idx, 0), own[0]), jnp.where(rec, valid, own[1]))
    if len(own) == 3:
        mask = selection_mask(new[0], new[1], num_keys).astype(own[2].dtype)
        new += (jnp.where(rec, mask, own[2]),)
    return new


# ---- a whole model's routing: the cache-shaped tree <-> per-layer arrays (records, measurements)

def layer_slots(cfg: ModelConfig, name: str) -> list[tuple[str, str, int, int]]:
    """[(segment, layer_i, repeat, model layer index)] of every main-stack layer that records ``name``, in
    model layer order."""
    rows = []
    for seg in plan_segments(cfg):
        for u, kind in enumerate(seg.unit):
            if (kind.mlp == "moe") if name == EXPERTS else records_selection(cfg, kind):
                rows += [(seg.name, f"layer_{u}", r, seg.layer_index(r, u)) for r in range(seg.repeats)]
    return sorted(rows, key=lambda row: row[3])


def recorded(cache: dict) -> dict | None:
    """The recording leaves of a decode cache's decoder tree ({segment: {layer_i: {name: leaf}}}), None when
    it recorded nothing."""
    tree = {}
    for seg, layers in cache.items():
        for u, leaves in layers.items():
            kept = {name: x for name, x in leaves.items() if name in (EXPERTS, SELECTED)}
            if kept:
                tree.setdefault(seg, {})[u] = kept
    return tree or None


def extract(cfg: ModelConfig, cache: dict, length: int) -> dict:
    """{name: [B, length, L_name, X]} (numpy) from a decode cache's decoder tree that recorded routing: slots
    0 .. length - 1 of every recording layer, in model layer order (L_name: the layers recording ``name``)."""
    out = {}
    for name in (EXPERTS, SELECTED):
        slots = layer_slots(cfg, name)
        if slots:
            out[name] = np.stack([np.asarray(cache[s][u][name][r, :, :length]) for s, u, r, _ in slots], axis=2)
    return out


def record_shapes(cfg: ModelConfig, length: int, names=(EXPERTS, SELECTED)) -> dict:
    """{name: (L_name, X)} of `extract`'s arrays for rows of ``length`` positions: the recording layers and
    the width a forward over that many keys selects (`fit_width` lays a wider record out in it)."""
    width = {EXPERTS: cfg.num_experts_per_tok, SELECTED: selection_width(cfg, length)}
    return {name: (len(layer_slots(cfg, name)), width[name]) for name in names}


def to_tree(cfg: ModelConfig, arrays: dict) -> dict:
    """The replay tree of ``Transformer.__call__`` from `extract`'s arrays ({name: [B, T, L_name, X]})."""
    tree = {}
    for name, a in arrays.items():
        slots = layer_slots(cfg, name)
        if a.shape[2] != len(slots):
            raise ValueError(f"routing replay {name}: {a.shape[2]} layers recorded, the model has {len(slots)}")
        for j, (s, u, r, _) in enumerate(slots):
            tree.setdefault(s, {}).setdefault(u, {}).setdefault(name, {})[r] = a[:, :, j]
    for seg in plan_segments(cfg):
        for layer in tree.get(seg.name, {}).values():
            for name, by_repeat in layer.items():
                layer[name] = jnp.stack([jnp.asarray(by_repeat[r]) for r in range(seg.repeats)])
    return tree
