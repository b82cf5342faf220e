"""The one table between hub checkpoint keys (spec §8.1, PyTorch ``[out, in]``) and our parameter tree.

Each `TensorMap` names a tensor of one decoder layer on both sides and how its layout changes:
HF linear weights are ``[out, in]`` and ours ``[in, ...out]`` with heads split out where the model
indexes them. Routed experts are per-expert keys on the hub and one stacked ``[E, in, out]`` array here.
Both the loader and the converters use this table in both directions.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from glm5_jax.layer_plan import LayerKind, plan_segments


@dataclasses.dataclass(frozen=True)
class TensorMap:
    ours: tuple[str, ...]      # path below the layer module
    hf: str                    # key suffix below "model.layers.{i}."
    layout: str                # "vector" | "linear" | "linear_heads" | "o_proj" | "experts" | "experts_down"
    collection: str = "params"


def to_ours(w_OI: np.ndarray, layout: str, heads: int | None = None) -> np.ndarray:
    """One HF tensor (any non-expert layout) in our layout."""
    if layout == "vector":
        return w_OI
    if layout == "linear":
        return w_OI.T
    if layout == "linear_heads":              # [H*dh, in] -> [in, H, dh]
        return w_OI.T.reshape(w_OI.shape[1], heads, -1)
    if layout == "o_proj":                    # [d, H*dv] -> [H, dv, d]
        return w_OI.T.reshape(heads, -1, w_OI.shape[0])
    raise ValueError(layout)


def to_hf(w: np.ndarray, layout: str) -> np.ndarray:
    """Inverse of `to_ours`."""
    if layout == "vector":
        return w
    if layout == "linear":
        return w.T
    if layout == "linear_heads":              # [in, H, dh] -> [H*dh, in]
        return w.reshape(w.shape[0], -1).T
    if layout == "o_proj":                    # [H, dv, d] -> [d, H*dv]
        return w.reshape(-1, w.shape[-1]).T
    raise ValueError(layout)


def layer_tensor_maps(cfg, kind: LayerKind) -> list[TensorMap]:
    """Every tensor of one decoder layer of this kind (attention, indexer, dense FFN or MoE)."""
    maps = [
        TensorMap(("input_norm", "scale"), "input_layernorm.weight", "vector"),
        TensorMap(("post_attention_norm", "scale"), "post_attention_layernorm.weight", "vector"),
        TensorMap(("attention", "q_a_proj"), "self_attn.q_a_proj.weight", "linear"),
        TensorMap(("attention", "q_a_norm", "scale"), "self_attn.q_a_layernorm.weight", "vector"),
        TensorMap(("attention", "q_b_proj"), "self_attn.q_b_proj.weight", "linear_heads"),
        TensorMap(("attention", "kv_a_proj"), "self_attn.kv_a_proj_with_mqa.weight", "linear"),
        TensorMap(("attention", "kv_a_norm", "scale"), "self_attn.kv_a_layernorm.weight", "vector"),
        TensorMap(("attention", "kv_b_proj"), "self_attn.kv_b_proj.weight", "linear_heads"),
        TensorMap(("attention", "o_proj"), "self_attn.o_proj.weight", "o_proj"),
    ]
    if kind.indexer == "full":
        maps += [
            TensorMap(("attention", "indexer", "wq_b"), "self_attn.indexer.wq_b.weight", "linear_heads"),
            TensorMap(("attention", "indexer", "wk"), "self_attn.indexer.wk.weight", "linear"),
            TensorMap(("attention", "indexer", "k_norm", "scale"), "self_attn.indexer.k_norm.weight", "vector"),
            TensorMap(("attention", "indexer", "k_norm", "bias"), "self_attn.indexer.k_norm.bias", "vector"),
            TensorMap(("attention", "indexer", "weights_proj"), "self_attn.indexer.weights_proj.weight", "linear"),
        ]
    if kind.mlp == "dense":
        maps += [TensorMap(("mlp", p), f"mlp.{p}.weight", "linear") for p in ("gate_proj", "up_proj", "down_proj")]
    else:
        maps += [
            TensorMap(("moe", "router"), "mlp.gate.weight", "linear"),
            TensorMap(("moe", "e_score_correction_bias"), "mlp.gate.e_score_correction_bias", "vector", "moe_bias"),
            TensorMap(("moe", "gate_proj"), "mlp.experts.{e}.gate_proj.weight", "experts"),
            TensorMap(("moe", "up_proj"), "mlp.experts.{e}.up_proj.weight", "experts"),
            TensorMap(("moe", "down_proj"), "mlp.experts.{e}.down_proj.weight", "experts"),
        ]
        if cfg.n_shared_experts:
            maps += [TensorMap(("moe", "shared_expert", p), f"mlp.shared_experts.{p}.weight", "linear")
                     for p in ("gate_proj", "up_proj", "down_proj")]
    return maps


def heads_for(tmap: TensorMap, cfg) -> int | None:
    if tmap.layout == "linear_heads":
        return cfg.index_n_heads if "indexer" in tmap.ours else cfg.num_attention_heads
    if tmap.layout == "o_proj":
        return cfg.num_attention_heads
    return None


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """Where HF layer `hf_layer` lives in our tree: path prefix and (optional) index on the stacked axis."""
    hf_layer: int
    prefix: tuple[str, ...]
    stack_index: int | None
    kind: LayerKind


def layer_slots(cfg) -> list[LayerSlot]:
    """Every HF layer index (main stack, then MTP as layer num_hidden_layers) and its place in our tree."""
    slots = []
    for seg in plan_segments(cfg):
        for r in range(seg.repeats):
            for u, kind in enumerate(seg.unit):
                slots.append(LayerSlot(seg.layer_index(r, u), ("decoder", seg.name, f"layer_{u}"), r, kind))
    if cfg.num_nextn_predict_layers:
        kind = LayerKind("moe", "full" if cfg.use_indexer else "none")
        slots.append(LayerSlot(cfg.num_hidden_layers, ("mtp", "block"), None, kind))
    return slots


GLOBAL_TENSORS = (
    # (our path, hf key, layout)
    (("embed",), "model.embed_tokens.weight", "vector"),
    (("final_norm", "scale"), "model.norm.weight", "vector"),
    (("lm_head",), "lm_head.weight", "linear"),
)


def mtp_extra_tensors(cfg):
    """MTP tensors outside its decoder block (spec §8.1), keyed under model.layers.{L}."""
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return (
        (("mtp", "enorm", "scale"), prefix + "enorm.weight", "vector"),
        (("mtp", "hnorm", "scale"), prefix + "hnorm.weight", "vector"),
        (("mtp", "eh_proj"), prefix + "eh_proj.weight", "linear"),
        (("mtp", "shared_head_norm", "scale"), prefix + "shared_head.norm.weight", "vector"),
    )
