"""GLM-5.3-Flash (transformers' ``glm5_next``) ``config.json`` <-> `ModelConfig` fields.

The hub file comes nested (``text_config`` + ``vision_config``, `Glm5NextConfig`) or flat (the text
fields at the top level); only the language model is read: the vision tower is out of scope.
transformers' Glm5Next has no MTP layer (it ignores the hub's ``model.layers.{L}.*``), so none is built.
"""
from __future__ import annotations

from typing import Any

MODEL_TYPES = ("glm5_next", "glm5_next_text")
LAYER_TYPES = {"linear_attention": "kda", "indexed_attention": "mla", "full_attention": "mla"}

# HF key -> ModelConfig field, the same meaning
_SAME_NAME = ("index_kpool", "index_kpool_always_select_tail", "linear_num_heads", "linear_head_dim",
              "linear_conv_kernel_dim", "linear_lower_bound", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "swiglu_limit")
# Glm5NextTextConfig's defaults where config.json leaves a key out
_DEFAULTS = dict(index_kpool=16, index_kpool_always_select_tail=True, linear_num_heads=64, linear_head_dim=128,
                 linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
                 swiglu_limit=10.0, qk_rope_head_dim=0, rms_norm_eps=1e-5)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys: ``text_config`` of a nested file, else the file itself."""
    text = hf.get("text_config")
    return dict(hf if text is None else text)


def _linear_attn_config(text: dict[str, Any]) -> dict[str, Any]:
    """The older ``linear_attn_config`` dict form, as Glm5NextTextConfig.__post_init__ reads it."""
    sub = text.get("linear_attn_config") or {}
    out = {k: sub[h] for k, h in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                                  ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                                  ("linear_lower_bound", "gate_lower_bound")) if h in sub}
    if sub and sub.get("safe_gate", True) and out.get("linear_lower_bound", text.get("linear_lower_bound")) is None:
        out["linear_lower_bound"] = -5.0
    return out


def flash_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The GLM-5.3-Flash-only `ModelConfig` fields of a text config dict."""
    n = int(text["num_hidden_layers"])
    fields = {k: text.get(k, _DEFAULTS[k]) for k in _SAME_NAME}
    fields.update(_linear_attn_config(text))
    types = text.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json layer_types {unknown} are not supported ({sorted(LAYER_TYPES)})")
    fields["layer_types"] = tuple(LAYER_TYPES[t] for t in types)
    if text.get("qk_rope_head_dim", 0):
        raise ValueError("config.json: GLM-5.3-Flash's MLA layers are NoPE (qk_rope_head_dim must be 0)")
    indexer_types = text.get("indexer_types")
    if indexer_types is not None and any(t != "full" for t, a in zip(indexer_types, fields["layer_types"])
                                         if a == "mla"):
        raise ValueError("config.json indexer_types: shared indexer layers are not supported with the pooled indexer")
    if text.get("index_topk_pattern") is not None or text.get("index_topk_freq", 1) != 1:
        raise ValueError("config.json: shared indexer layers (index_topk_pattern / index_topk_freq) are not supported "
                         "with the pooled indexer")
    mlp = text.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - min(3, n))
    fields["mlp_layer_types"] = mlp
    # the latent norms (q_a_layernorm, kv_a_layernorm) take rms_norm_eps here, not GLM-5's fixed 1e-6
    fields["latent_norm_eps"] = text.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])
    return fields


def is_flash(cfg) -> bool:
    """Whether ``cfg`` is a GLM-5.3-Flash architecture (what only a glm5_next config.json describes)."""
    return cfg.layer_types is not None or cfg.hc_mult > 0 or cfg.index_kpool is not None


def flash_to_hf(cfg, base: dict[str, Any]) -> dict[str, Any]:
    """A nested ``glm5_next`` config.json (`Glm5NextConfig`, text_config only) for ``cfg``; ``base``: the
    GLM-5 keys `config_to_hf` writes for it."""
    text = {k: v for k, v in base.items() if k not in ("architectures", "rope_parameters", "rope_interleave",
                                                       "indexer_rope_interleave", "num_nextn_predict_layers",
                                                       "dtype", "first_k_dense_replace")}
    text.update({k: getattr(cfg, k) for k in _SAME_NAME})
    text["layer_types"] = ["linear_attention" if t == "kda" else "indexed_attention"
                           for t in cfg.layer_attention_types]
    text["indexer_types"] = ["full"] * cfg.num_hidden_layers
    text["model_type"] = "glm5_next_text"
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "tie_word_embeddings": False, "dtype": base["dtype"]}
