"""Mapping between HF ``config.json`` dicts and `ModelConfig` fields.

Background: docs/architecture.md#notation-and-sizes, #cross-layer-index-sharing.
"""
from __future__ import annotations

import json
import os
from typing import Any

from glm5_jax import storage
from glm5_jax.hf import flash_config
from glm5_jax.model.config import ConfigError, ModelConfig

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3") + flash_config.MODEL_TYPES

# HF key -> ModelConfig field, identical meaning in all three families.
_SAME_NAME = (
    "vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
    "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps",
    "max_position_embeddings", "initializer_range", "tie_word_embeddings", "bos_token_id", "pad_token_id",
)
_INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")


def _derive_indexer_types(hf: dict[str, Any], n_layers: int) -> tuple[str, ...] | None:
    """HF's rule: explicit list, else an F/S pattern, else freq/offset; None when all full.

    Background: docs/architecture.md#cross-layer-index-sharing.
    """
    if hf.get("indexer_types") is not None:
        types = tuple(hf["indexer_types"])
    elif hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = tuple({"F": "full", "S": "shared"}[c] for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    else:
        freq = max(int(hf.get("index_topk_freq", 1)), 1)
        offset = int(hf.get("index_skip_topk_offset", 2))
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))
    return None if all(t == "full" for t in types) else types


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has no rope_theta (rope_parameters.rope_theta): refusing to guess")
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": None}
    if rope_type == "yarn":
        scaling = {**legacy, **params}
        scaling.pop("rope_theta", None)
        scaling.pop("type", None)
        scaling["rope_type"] = "yarn"
        fields["rope_scaling"] = scaling
    elif rope_type != "default":
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported (default or yarn)")
    return fields


def config_kwargs_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    flash = model_type in flash_config.MODEL_TYPES
    if flash:          # GLM-5.3-Flash: the language model's keys (nested text_config or flat)
        hf = {**flash_config.text_config(hf), "model_type": model_type}
        hf.setdefault("qk_rope_head_dim", 0)
        hf.setdefault("rms_norm_eps", 1e-5)
        for key, default in (("bos_token_id", None), ("eos_token_id", None), ("pad_token_id", 154820)):
            hf.setdefault(key, default)     # Glm5NextTextConfig's defaults
        extra = flash_config.flash_fields(hf)
        hf["mlp_layer_types"] = extra.pop("mlp_layer_types")
    nullable = ("bos_token_id", "pad_token_id")
    kwargs: dict[str, Any] = {k: hf[k] for k in _SAME_NAME if k in hf and (hf[k] is not None or k in nullable)}
    if "num_key_value_heads" in hf and hf["num_key_value_heads"] != hf.get("num_attention_heads"):
        raise ValueError("config.json: MLA needs num_key_value_heads == num_attention_heads, got "
                         f"{hf['num_key_value_heads']} vs {hf.get('num_attention_heads')}")
    for key, want in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if key in hf and hf[key] != want:
            raise ValueError(f"config.json {key}={hf[key]!r}: only {want!r} is supported")
    if hf.get("attention_bias"):
        raise ValueError("config.json attention_bias=true is not supported (GLM-5 has no attention biases)")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json moe_layer_freq={hf['moe_layer_freq']} is not supported (only 1)")
    # DeepseekV3Config has no mlp_layer_types (DeepseekV3DecoderLayer reads first_k_dense_replace)
    mlp_types = hf.get("mlp_layer_types") if model_type != "deepseek_v3" else None
    if mlp_types is not None:
        n_dense = sum(t == "dense" for t in mlp_types)
        if list(mlp_types) != ["dense"] * n_dense + ["sparse"] * (len(mlp_types) - n_dense):
            raise ValueError("config.json mlp_layer_types must be dense layers followed by sparse ones")
        kwargs["first_k_dense_replace"] = n_dense
    kwargs.update(_rope_fields(hf) if not flash else {})   # NoPE: no RoPE parameters
    # RoPE layout as each transformers class runs it: DeepseekV3Attention honours `rope_interleave` (default
    # true); GlmMoeDsaAttention and DeepseekV32Attention always interleave and ignore the key, and their
    # indexers ignore `indexer_rope_interleave` (GLM: interleaved, DeepSeek-V3.2: half-split;
    # docs/architecture.md#rope, docs/architecture.md#indexer-rope-interleaved-not-half-split).
    kwargs["rope_interleave"] = bool(hf.get("rope_interleave", True)) if model_type == "deepseek_v3" else True
    if "eos_token_id" in hf:
        kwargs["eos_token_id"] = hf["eos_token_id"]
    kwargs["num_nextn_predict_layers"] = 0 if flash else int(hf.get("num_nextn_predict_layers", 0) or 0)
    kwargs["mtp_depth"] = kwargs["num_nextn_predict_layers"]
    if model_type == "deepseek_v3":
        kwargs["use_indexer"] = False
    else:
        kwargs.update({k: hf[k] for k in _INDEXER_KEYS if k in hf})
        # Cross-layer index sharing is GlmMoeDsaConfig's; DeepseekV32Config has no such field and runs the
        # indexer in every layer, whatever indexer_types / index_topk_* keys the file holds.
        glm = model_type == "glm_moe_dsa"
        kwargs["indexer_types"] = _derive_indexer_types(hf, hf["num_hidden_layers"]) if glm else None
        kwargs["indexer_rope_interleave"] = glm
    if flash:
        kwargs.update(extra, indexer_types=None, indexer_rope_interleave=True)
    elif model_type != "glm_moe_dsa":
        kwargs.setdefault("rms_norm_eps", 1e-6)
    return kwargs


def config_from_hf(path_or_dict: str | os.PathLike | dict[str, Any], **overrides) -> ModelConfig:
    """`ModelConfig` from an HF ``config.json`` (a directory, the file, or its dict): glm_moe_dsa,
    deepseek_v32, deepseek_v3. ``overrides`` replace fields afterwards (runtime fields by name too)."""
    hf = path_or_dict if isinstance(path_or_dict, dict) else read_config_json(path_or_dict)
    cfg = ModelConfig(**config_kwargs_from_hf(hf))
    return cfg.replace(**overrides) if overrides else cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict (model_type glm_moe_dsa, or glm5_next for GLM-5.3-Flash) describing this
    architecture."""
    if not cfg.use_indexer:
        raise ValueError("to_hf writes glm_moe_dsa configs; a model without an indexer has no such form")
    if not cfg.indexer_rope_interleave:
        raise ValueError("to_hf writes glm_moe_dsa configs, whose indexer RoPE is interleaved; "
                         "this config uses half-split (DeepSeek-V3.2)")
    if not cfg.rope_interleave:
        raise ValueError("to_hf writes glm_moe_dsa configs, whose attention RoPE is interleaved (transformers "
                         "ignores rope_interleave there); this config uses half-split")
    hf: dict[str, Any] = {k: getattr(cfg, k) for k in _SAME_NAME + _INDEXER_KEYS}
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}
    eos = list(cfg.eos_token_id)
    hf.update({
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "num_key_value_heads": cfg.num_attention_heads, "qk_head_dim": cfg.qk_head_dim,
        "head_dim": cfg.qk_rope_head_dim, "hidden_act": "silu", "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "attention_bias": False, "attention_dropout": 0.0, "moe_layer_freq": 1,
        "rope_parameters": rope,
        # transformers' GlmMoeDsa ignores both keys (always interleaved), but serving engines read them:
        # vLLM's and SGLang's DeepSeek-V3.2 indexer take `indexer_rope_interleave` (default: half-split), as in
        # zai-org/GLM-5's config.json. Only `true` can be written: a half-split config is refused above.
        "rope_interleave": True, "indexer_rope_interleave": True,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "mlp_layer_types": ["dense"] * cfg.first_k_dense_replace + ["sparse"] * cfg.num_moe_layers,
        "dtype": "bfloat16" if cfg.runtime.param_dtype == "bfloat16" else "float32",
    })
    if cfg.indexer_types is not None:
        hf["indexer_types"] = list(cfg.indexer_types)
    return flash_config.flash_to_hf(cfg, hf) if flash_config.is_flash(cfg) else hf


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The dict in an HF ``config.json`` (``path`` is the file or its directory); the one reader that
    config_from_hf, load_hf and the converter share. ConfigError names the problem and the path."""
    path = os.fspath(path)
    if storage.isdir(path):
        path = storage.join(path, "config.json")
    if not storage.isfile(path):
        raise ConfigError(f"no HF config at {path} (missing config.json)")
    try:
        hf = json.loads(storage.read_text(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON (invalid JSON: {e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return hf
