"""`ModelConfig`: every hyper-parameter of GLM-5 (spec/ARCHITECTURE.md §1), validated, HF-convertible.

The same dataclass describes GLM-5 (`glm_moe_dsa`), DeepSeek-V3.2 (`deepseek_v32`: half-split indexer
RoPE) and DeepSeek-V3 (`deepseek_v3`: no indexer, dense attention) so their checkpoints can be read
into the one model.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

ATTENTION_IMPLS = ("reference", "xla", "pallas", "pallas_interpret")
MLA_FORMS = ("absorbed", "mha")
ATTENTION_MODES = ("sparse", "dense")
INDEXER_LOSSES = ("none", "warmup", "sparse")
MOE_IMPLS = ("ragged_dot", "blocked")
MOE_EP = ("none", "a2a", "ragged_a2a")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "dots_attention_saveable",
                  "offload_dots")
DTYPES = ("float32", "bfloat16", "float16")
QUANT_MODES = ("none", "int4_qat", "int4")   # routed-expert weights: full precision, fake-quantised, packed
QUANT_MATMULS = ("xla", "pallas", "pallas_interpret")
QUANT_SCALE_DTYPES = ("bfloat16", "float32")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # --- sizes (spec §1.1) ---
    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    first_k_dense_replace: int = 3
    intermediate_size: int = 12288
    num_attention_heads: int = 64
    # --- MLA ---
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    # --- DSA lightning indexer ---
    use_indexer: bool = True                 # False for deepseek_v3 (dense MLA, no indexer weights)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_types: tuple[str, ...] | None = None   # per layer "full" | "shared"; None -> all full
    indexer_rope_interleave: bool = True     # GLM: pair-interleaved; DeepSeek-V3.2: half-split (P1)
    # --- RoPE ---
    rope_theta: float = 1_000_000.0
    # YaRN parameters as sorted (key, value) pairs (DeepSeek-V3.x); None = plain RoPE (GLM-5)
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_interleave: bool = True             # MLA q_rot / k_rot pair-interleaved
    # --- norms (P6) ---
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-6            # q_a_layernorm, kv_a_layernorm (hard-coded upstream)
    indexer_norm_eps: float = 1e-6           # indexer k_norm LayerNorm
    # --- MoE (spec §5.2) ---
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    # --- MTP (spec §6) ---
    num_nextn_predict_layers: int = 1        # MTP modules stored (GLM-5: one, as layer 78)
    mtp_depth: int = 1                       # recursive applications of the shared MTP module
    mtp_use_normed_hidden: bool = True       # h^0 = post-final-norm hidden, as inference engines do
    # --- misc from config.json ---
    max_position_embeddings: int = 202752
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (154820, 154827, 154829)
    pad_token_id: int | None = 154820
    # --- implementation switches (not part of the architecture) ---
    dtype: str = "float32"                   # activation / matmul dtype
    param_dtype: str = "float32"             # master weights
    attention_impl: str = "xla"
    mla_form: str = "absorbed"               # "absorbed" (latent MQA, gather) or "mha" (masked heads)
    attention_mode: str = "sparse"           # "sparse" (DSA top-k) or "dense" (causal, DSA warm-up/dense stage)
    indexer_loss: str = "none"               # DSA indexer KL in aux: "none" | "warmup" | "sparse" (spec §7.1)
    moe_impl: str = "ragged_dot"              # "ragged_dot" (reference) or "blocked" (fast on CPU)
    # expert parallelism over the mesh axis of the logical "exp" axis (glm5_jax/moe_ep.py): "none" (GSPMD
    # decides), "a2a" (capacity-padded all_to_all), "ragged_a2a" (ragged_all_to_all, TPU/GPU only)
    moe_ep: str = "none"
    moe_capacity_factor: float = 1.25        # a2a: slots per (source shard, expert) = factor * fair share
    remat_policy: str = "full"
    attention_q_chunk: int = 512             # queries per chunk in the XLA attention / indexer paths
    # INT4 routed experts (glm5_jax/quant/): "int4_qat" fake-quantises the fp master weights in the forward
    # (straight-through gradients), "int4" holds packed weights (from glm5_jax.quant.quantize_params) for
    # inference; both round with glm5_jax/quant/int4.py, so their forwards are the same numbers
    quant: str = "none"
    quant_group_size: int = 32               # input channels per scale
    quant_scale_dtype: str = "bfloat16"
    quant_matmul: str = "xla"                # "int4": dequantise + the moe_impl matmul, or the Pallas kernel

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), also in the absorbed form (P7); YaRN models multiply by mscale^2 (spec §4.1)."""
        from glm5_jax.rope import yarn_softmax_mscale

        return self.qk_head_dim ** -0.5 * yarn_softmax_mscale(self.rope_scaling_dict)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        """Indexer mode of each main layer; "none" everywhere when the model has no indexer."""
        if not self.use_indexer:
            return ("none",) * self.num_hidden_layers
        return self.indexer_types or ("full",) * self.num_hidden_layers

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        for f in ("dtype", "param_dtype"):     # jnp.float32 / np.dtype / "float32" all name the same dtype
            value = getattr(self, f)
            if not isinstance(value, str):
                try:
                    value = jnp.dtype(value).name
                except TypeError as e:
                    raise ConfigError(f"ModelConfig.{f}={value!r}: not a dtype ({e})") from None
                object.__setattr__(self, f, value)
        if self.indexer_types is not None and not isinstance(self.indexer_types, tuple):
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if not isinstance(self.eos_token_id, tuple):
            eos = self.eos_token_id
            object.__setattr__(self, "eos_token_id", tuple(eos) if isinstance(eos, (list, tuple)) else
                               (() if eos is None else (int(eos),)))
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, field: str, why: str):
            if not ok:
                raise ConfigError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "moe_intermediate_size", "attention_q_chunk"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must lie in [0, num_hidden_layers={self.num_hidden_layers}]")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "RoPE needs an even rotary width")
        if self.num_moe_layers > 0 or self.num_nextn_predict_layers > 0:
            need(self.n_routed_experts > 0, "n_routed_experts", "must be positive when MoE layers exist")
            need(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                 f"must lie in [1, n_routed_experts={self.n_routed_experts}]")
            need(self.n_group > 0 and self.n_routed_experts % self.n_group == 0, "n_group",
                 f"must divide n_routed_experts={self.n_routed_experts}")
            need(0 < self.topk_group <= self.n_group, "topk_group", f"must lie in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            need(self.n_group == 1 or per_group >= 2, "n_group", "group scores need >= 2 experts per group")
            need(self.topk_group * per_group >= self.num_experts_per_tok, "topk_group",
                 f"topk_group * experts per group must be >= num_experts_per_tok={self.num_experts_per_tok}")
            need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        if self.use_indexer:
            for f in ("index_n_heads", "index_head_dim", "index_topk"):
                need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
            need(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
                 f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (the rope slice comes first, P2)")
            if self.indexer_types is not None:
                need(len(self.indexer_types) == self.num_hidden_layers, "indexer_types",
                     f"needs one entry per layer ({self.num_hidden_layers})")
                need(all(t in ("full", "shared") for t in self.indexer_types), "indexer_types",
                     'entries must be "full" or "shared"')
                need(self.indexer_types[0] == "full", "indexer_types", 'layer 0 must be "full" (P15)')
        need(self.num_nextn_predict_layers in (0, 1), "num_nextn_predict_layers",
             "one shared MTP module (GLM-5) or none is supported")
        need(self.mtp_depth >= 0 and (self.mtp_depth == 0 or self.num_nextn_predict_layers == 1), "mtp_depth",
             "needs an MTP module (num_nextn_predict_layers=1) when > 0")
        need(self.rope_theta > 0, "rope_theta", "must be positive")
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            need(rs.get("rope_type") == "yarn", "rope_scaling", 'only rope_type "yarn" is supported')
            need("original_max_position_embeddings" in rs, "rope_scaling",
                 "yarn needs original_max_position_embeddings")
        for f, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES), ("attention_impl", ATTENTION_IMPLS),
                           ("mla_form", MLA_FORMS),
                           ("attention_mode", ATTENTION_MODES),
                           ("indexer_loss", INDEXER_LOSSES),
                           ("moe_impl", MOE_IMPLS), ("moe_ep", MOE_EP), ("remat_policy", REMAT_POLICIES),
                           ("quant", QUANT_MODES), ("quant_matmul", QUANT_MATMULS),
                           ("quant_scale_dtype", QUANT_SCALE_DTYPES)):
            need(getattr(self, f) in allowed, f, f"must be one of {allowed}")
        need(self.indexer_loss != "sparse" or self.attention_mode == "sparse", "indexer_loss",
             'the sparse-stage KL needs attention_mode="sparse"')
        need(self.indexer_loss == "none" or self.use_indexer, "indexer_loss", "needs a model with an indexer")
        need(self.moe_capacity_factor > 0, "moe_capacity_factor", "must be positive")
        if self.quant != "none":
            g = self.quant_group_size
            need(isinstance(g, int) and g > 0 and g % 8 == 0, "quant_group_size", "must be a positive multiple of 8")
            for f in ("hidden_size", "moe_intermediate_size"):     # the experts' input widths
                need(getattr(self, f) % (8 * g) == 0, f,
                     f"INT4 packs 8 groups of quant_group_size={g} per chunk: must be a multiple of {8 * g}")
        need(self.quant_matmul == "xla" or self.quant == "int4", "quant_matmul",
             'the Pallas INT4 matmul runs on packed weights (quant="int4")')
        need(self.quant_matmul == "xla" or self.moe_ep == "none", "quant_matmul",
             'the Pallas INT4 matmul runs without expert parallelism (moe_ep="none")')
        need(not self.tie_word_embeddings, "tie_word_embeddings", "GLM-5 has an untied head; tying is unsupported")

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any], **overrides) -> "ModelConfig":
        """Read an HF ``config.json`` (a dir, the file, or its dict): glm_moe_dsa, deepseek_v32, deepseek_v3."""
        from glm5_jax.hf_config import config_kwargs_from_hf, read_config_json

        hf = path_or_dict if isinstance(path_or_dict, dict) else read_config_json(path_or_dict)
        return cls(**{**config_kwargs_from_hf(hf), **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (model_type glm_moe_dsa) describing this architecture."""
        from glm5_jax.hf_config import config_to_hf

        return config_to_hf(self)
