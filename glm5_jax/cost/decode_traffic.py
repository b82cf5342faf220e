"""Bytes one decode step reads per token (batch 1), with routed experts in bf16 or packed INT4.

Decode at small batch is bound by memory reads: every weight a token uses is read once per step (the
head and every layer's attention, shared expert and dense FFN; K of E routed experts per MoE layer;
one embedding row), plus the latent cache of the context.
"""
from __future__ import annotations

import jax.numpy as jnp

from glm5_jax.model.kv_cache import cache_bytes_per_token
from glm5_jax.model.param_count import count_params


def decode_bytes_per_token(cfg, experts: str = "bf16", context: int = 0, weight_dtype="bfloat16") -> dict:
    """{"routed_experts", "other_weights", "cache", "total"} bytes read to decode one token.

    experts: "bf16" (weights in `weight_dtype`) or "int4" (half a byte per value plus one
    ``cfg.quant_scale_dtype`` scale per ``cfg.quant_group_size`` values). Excludes the MTP module."""
    if experts not in ("bf16", "int4"):
        raise ValueError(f"experts={experts!r}: choose 'bf16' or 'int4'")
    counts = count_params(cfg)
    wbytes = jnp.dtype(weight_dtype).itemsize
    routed_active = cfg.num_moe_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    other = counts["active_without_embeddings"] - routed_active + cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    if experts == "int4":
        routed = routed_active // 2 + routed_active // cfg.quant_group_size * jnp.dtype(cfg.quant_scale_dtype).itemsize
    else:
        routed = routed_active * wbytes
    cache = context * cache_bytes_per_token(cfg)
    out = {"routed_experts": int(routed), "other_weights": int(other * wbytes), "cache": int(cache)}
    out["total"] = sum(out.values())
    return out
