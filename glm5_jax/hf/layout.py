"""The one table between hub checkpoint keys (PyTorch ``[out, in]``) and our parameter tree
(docs/architecture.md#checkpoint-layout-hf-keys).

Each `TensorMap` names a tensor of one decoder layer on both sides and how its layout changes:
HF linear weights are ``[out, in]`` and ours ``[in, ...out]`` with heads split out where the model
indexes them. Routed experts are per-expert keys on the hub and one stacked ``[E, in, out]`` array here.
Both the loader and the converters use this table in both directions.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from glm5_jax.model.layer_plan import LayerKind, plan_segments


@dataclasses.dataclass(frozen=True)
class TensorMap:
    ours: tuple[str, ...]      # path below the layer module
    hf: str                    # key suffix below "model.layers.{i}."
    layout: str                # "vector" | "linear" | "linear_heads" | "o_proj" | "experts" | "experts_down"
    collection: str = "params"


# How each layout turns a hub tensor into ours: the hub tensor (``[out, in]`` or a vector) is split
# into `row_dims` x `col_dims` (a head count splits one of them), then transposed by `perm`. Both steps
# are numpy views, so a slice of our layout reads only the hub rows/columns it needs.
#   layout        hub          split to            ours
#   vector        [n], [V, d]  unchanged           unchanged
#   linear        [out, in]    [out, in]           [in, out]
#   linear_heads  [H*dh, in]   [H, dh, in]         [in, H, dh]
#   o_proj        [d, H*dv]    [d, H, dv]          [H, dv, d]
#   experts       [out, in]    per expert e        [E, in, out] (stacked over e)
LAYOUT_PERM = {"linear": (1, 0), "experts": (1, 0), "linear_heads": (2, 0, 1), "o_proj": (1, 2, 0)}


def layout_perm(layout: str, ndim: int) -> tuple[int, ...]:
    """Axis permutation from the split hub tensor to ours ("vector" tensors keep their axes)."""
    return tuple(range(ndim)) if layout == "vector" else LAYOUT_PERM[layout]


def split_dims(hub_shape, layout: str, heads: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(row_dims, col_dims) of a hub tensor of `hub_shape` under `layout` (see the table above)."""
    if layout == "vector":
        return tuple(hub_shape[:1]), tuple(hub_shape[1:])
    out, inp = hub_shape
    if layout in ("linear", "experts"):
        return (out,), (inp,)
    if layout == "linear_heads":
        return (heads, out // heads), (inp,)
    if layout == "o_proj":
        return (out,), (heads, inp // heads)
    raise ValueError(layout)


def to_ours(w_OI: np.ndarray, layout: str, heads: int | None = None) -> np.ndarray:
    """One HF tensor (any non-expert layout; one expert for "experts") in our layout, as a view."""
    rows, cols = split_dims(w_OI.shape, layout, heads)
    return w_OI.reshape(rows + cols).transpose(layout_perm(layout, len(rows + cols)))


def to_hf(w: np.ndarray, layout: str) -> np.ndarray:
    """Inverse of `to_ours`."""
    return w.transpose(np.argsort(layout_perm(layout, w.ndim))).reshape(hub_shape(w.shape, layout))


def hub_shape(our_shape, layout: str) -> tuple[int, ...]:
    """Shape of the hub tensor whose `to_ours` has `our_shape` (one expert for "experts")."""
    if layout == "vector":
        return tuple(our_shape)
    split = [our_shape[a] for a in np.argsort(LAYOUT_PERM[layout])]
    n_rows = 2 if layout == "linear_heads" else 1
    return (int(np.prod(split[:n_rows])), int(np.prod(split[n_rows:])))


def kda_tensor_maps() -> list[TensorMap]:
    """A GLM-5.3-Flash KDA layer's attention (glm5_jax/model/kda_layer.py): flat heads, conv taps as stored."""
    linear = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
    return ([TensorMap(("attention", p), f"self_attn.{p}.weight", "linear") for p in linear]
            + [TensorMap(("attention", f"{c}_conv"), f"self_attn.{c}_conv1d.weight", "vector") for c in "qkv"]
            + [TensorMap(("attention", p), f"self_attn.{p}", "vector") for p in ("dt_bias", "A_log")]
            + [TensorMap(("attention", "o_norm"), "self_attn.o_norm.weight", "vector")])


def hyper_connection_maps() -> list[TensorMap]:
    """A layer's two mHC mixers (glm5_jax/model/hyper_connections.py)."""
    blocks = ("attn", "ffn")
    return [TensorMap((f"{block}_hc", "fn"), f"hc_{block}_fn", "linear") for block in blocks] + [
        TensorMap((f"{block}_hc", p), f"hc_{block}_{p}", "vector") for block in blocks for p in ("base", "scale")]


def layer_tensor_maps(cfg, kind: LayerKind) -> list[TensorMap]:
    """Every tensor of one decoder layer of this kind (attention, indexer, dense FFN or MoE)."""
    maps = [
        TensorMap(("input_norm", "scale"), "input_layernorm.weight", "vector"),
        TensorMap(("post_attention_norm", "scale"), "post_attention_layernorm.weight", "vector"),
    ] + (hyper_connection_maps() if cfg.hc_mult else [])
    if kind.attention == "kda":
        maps += kda_tensor_maps()
    else:
        maps += mla_tensor_maps(cfg, kind)
    return maps + ffn_tensor_maps(cfg, kind)


def mla_tensor_maps(cfg, kind: LayerKind) -> list[TensorMap]:
    """An MLA layer's attention and indexer."""
    maps = [
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
        if cfg.index_kpool is not None:   # GLM-5.3-Flash's pooled indexer
            maps += [
                TensorMap(("attention", "indexer", "kpool_gate"), "self_attn.indexer.index_kpool_compress_gate",
                          "linear"),
                TensorMap(("attention", "indexer", "kpool_ape"), "self_attn.indexer.index_kpool_compress_ape",
                          "vector"),
            ]
    return maps


def ffn_tensor_maps(cfg, kind: LayerKind) -> list[TensorMap]:
    """A layer's dense FFN or MoE."""
    maps = []
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
    """MTP tensors outside its decoder block, keyed under model.layers.{L}.

    Background: docs/architecture.md#checkpoint-layout-hf-keys.
    """
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return (
        (("mtp", "enorm", "scale"), prefix + "enorm.weight", "vector"),
        (("mtp", "hnorm", "scale"), prefix + "hnorm.weight", "vector"),
        (("mtp", "eh_proj"), prefix + "eh_proj.weight", "linear"),
        (("mtp", "shared_head_norm", "scale"), prefix + "shared_head.norm.weight", "vector"),
    )


# DeepSeek-V3.x hub checkpoints give the MTP layer its own copies of the embedding and the output head
# (the DeepSeek-V3 technical report, arXiv:2412.19437, section 2.2, shares both with the main model; vLLM's
# DeepSeek MTP reads the copies).
DEEPSEEK_MODEL_TYPES = ("deepseek_v3", "deepseek_v32")


def mtp_copies(cfg) -> tuple[tuple[str, str], ...]:
    """(MTP copy key, main key) of the tensors a DeepSeek-V3.x MTP layer repeats; our MTP shares the main ones."""
    if not cfg.num_nextn_predict_layers:
        return ()
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return ((prefix + "embed_tokens.weight", "model.embed_tokens.weight"),
            (prefix + "shared_head.head.weight", "lm_head.weight"))


def empty_shared_experts(cfg) -> tuple[tuple[str, tuple[int, int]], ...]:
    """(key, shape) of the 0-size tensors transformers saves for ``n_shared_experts=0``: its MoE layers build
    ``shared_experts`` with intermediate size ``moe_intermediate_size * n_shared_experts`` (GlmMoeDsaMoE,
    DeepseekV3MoE), which then add exactly 0. They carry no parameter of ours."""
    if cfg.n_shared_experts or not cfg.n_routed_experts:
        return ()
    d, out = cfg.hidden_size, []
    for slot in layer_slots(cfg):
        if slot.kind.mlp == "moe":
            prefix = f"model.layers.{slot.hf_layer}.mlp.shared_experts."
            out += [(prefix + "gate_proj.weight", (0, d)), (prefix + "up_proj.weight", (0, d)),
                    (prefix + "down_proj.weight", (d, 0))]
    return tuple(out)
