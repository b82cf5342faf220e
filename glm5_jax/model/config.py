"""`ModelConfig`: every hyper-parameter of GLM-5 (its HF config.json), validated, HF-convertible.

The same dataclass describes GLM-5 (`glm_moe_dsa`), DeepSeek-V3.2 (`deepseek_v32`: half-split indexer
RoPE) and DeepSeek-V3 (`deepseek_v3`: no indexer, dense attention) so their checkpoints can be read
into the one model.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Literal

import jax.numpy as jnp

from pallas_kernels.impls import XLA

Dtype = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["reference", "xla", "pallas", "pallas_interpret"]
MlaForm = Literal["absorbed", "mha"]
AttentionMode = Literal["sparse", "dense"]
DecodeCacheWrite = Literal["layer", "rows"]
DecodeCacheRead = Literal["slice", "xla", "pallas", "pallas_interpret"]   # decode_cache_write="rows" only
DecodeAttention = Literal["xla", "pallas", "pallas_interpret"]            # decode_cache_read other than "slice"
RouterImpl = Literal["xla", "pallas", "pallas_interpret"]
DecodeA2aExchange = Literal["slots", "ragged", "ragged_dense"]
SamplerKernels = Literal["xla", "pallas", "pallas_interpret"]      # glm5_jax/generate/settings.py
SamplerDispatch = Literal["gather", "a2a_decode"]
RopeImpl = Literal["slices", "pair_swap"]
IndexerLoss = Literal["none", "warmup", "sparse"]
MoeImpl = Literal["auto", "ragged_dot", "gmm", "gmm_interpret", "blocked"]
ProjectionImpl = Literal["xla", "cpu_transposed_grad"]   # glm5_jax.model.layers.einsum
MoeEp = Literal["none", "a2a", "ragged_a2a", "gather", "a2a_decode"]
MoeChunkBy = Literal["tokens", "experts"]   # how moe_a2a_chunks splits a shard's expert work
QuantMatmul = Literal["xla", "pallas", "pallas_interpret"]   # glm5_jax/quant: packed INT4 experts
RematPolicy = Literal["none", "full", "selection_saveable", "attention_saveable", "attention_expert_out_saveable",
                      "attention_expert_out_mlp_saveable",
                      "dots_saveable",
                      "dots_with_no_batch_dims_saveable", "dots_attention_saveable", "experts_saveable", "moe_saveable",
                      "moe_attention_saveable",
                      "offload_dots"]

DTYPES = typing.get_args(Dtype)
ATTENTION_IMPLS = typing.get_args(AttentionImpl)
MLA_FORMS = typing.get_args(MlaForm)
ATTENTION_MODES = typing.get_args(AttentionMode)
INDEXER_LOSSES = typing.get_args(IndexerLoss)
MOE_IMPLS = typing.get_args(MoeImpl)
PROJECTION_IMPLS = typing.get_args(ProjectionImpl)
MOE_EP = typing.get_args(MoeEp)
REMAT_POLICIES = typing.get_args(RematPolicy)
QUANT_MATMULS = typing.get_args(QuantMatmul)
Quant = Literal["none", "int4_qat", "int4"]   # routed-expert weights: full precision, fake-quantised, packed
QuantScaleDtype = Literal["bfloat16", "float32"]
QUANT_MODES = typing.get_args(Quant)
QUANT_SCALE_DTYPES = typing.get_args(QuantScaleDtype)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How the model runs, never what it is: numerics, which implementation of each hot spot, remat,
    expert transport, and the DSA stage the forward runs in. None of it changes the parameter tree.

    ``attention_mode`` / ``indexer_loss`` are the DSA stage's facts; `train.py` derives them from
    ``train.stage`` (`glm5_jax.train.stage.StageSpec.model_config`), generation from its own needs.
    """
    dtype: Dtype = "float32"                 # activation / matmul dtype (a JAX/numpy dtype works too)
    param_dtype: Dtype = "float32"           # master weights
    attention_impl: AttentionImpl = "xla"    # pallas_kernels/sparse_mla/ops.py: reference | xla | pallas(_interpret)
    kda_impl: AttentionImpl = "xla"          # KDA layers' chunked core, pallas_kernels/kda/ops.py: same names
    # tokens per KDA chunk (a multiple of 16): the recurrence runs chunk by chunk, exact for any size; the
    # "xla" / Pallas chunk body is unrolled over the chunk's sub-chunks, so a small chunk compiles faster
    kda_chunk: int = 64
    # mHC mixers: the Sinkhorn normalisation's iterations unrolled (elementwise work XLA fuses into a few passes;
    # on TPU a loop runs each iteration as its own ops, forward and backward) or a loop (one body to compile:
    # faster to compile on CPU); the same values either way
    hc_sinkhorn_unroll: bool = False
    mla_form: MlaForm = "absorbed"           # "absorbed" (latent MQA) or "mha" (naive per-head form, a cross-check)
    # routed experts' grouped matmul: "auto" (the Pallas kernel when lowered for TPU, else ragged_dot),
    # "ragged_dot" (XLA reference), "gmm" / "gmm_interpret" (Pallas TPU kernel / its interpreter), "blocked"
    # (glm5_jax/model/moe/blocked.py, fast on CPU)
    moe_impl: MoeImpl = "auto"
    # expert parallelism over the mesh axis of the logical "exp" axis (glm5_jax/model/moe/expert_parallel.py):
    # "none" (GSPMD decides), "a2a" (capacity-padded all_to_all), "ragged_a2a" (ragged_all_to_all, TPU/GPU only),
    # "gather" (decode: the expert group's tokens all-gathered, results reduce-scattered; moe/decode_dispatch.py),
    # "a2a_decode" (decode: each assignment's row sent to its expert's chip and back by all_to_all, capacity per
    # destination chip; moe/decode_a2a.py)
    moe_ep: MoeEp = "none"
    # a2a: slots per (source shard, expert) = factor * fair share; gather: rows a chip's experts take; a2a_decode:
    # send slots per destination chip (each: factor * the expected share, in 16-row tiles)
    moe_capacity_factor: float = 1.25
    # expert parallelism: a shard's tokens cross the all_to_all in this many chunks, each with its own
    # capacity, so one chunk's transport can overlap another's expert matmuls (expert_parallel.py)
    moe_a2a_chunks: int = 1
    # what the chunks split: "tokens" (each chunk a share of the shard's tokens with all its local experts) or
    # "experts" (a2a: each chunk every token's assignments to a share of every shard's local experts, one
    # capacity over the whole shard): a grouped matmul then holds as many rows over fewer experts, so it
    # computes fewer partial row tiles and reads each expert's weights in one call
    moe_a2a_chunk_by: MoeChunkBy = "tokens"
    # a2a: the receiver packs each local expert's rows starting at a multiple of this many rows (the grouped
    # matmul's row tile: no row tile is then shared by two experts, which the kernel computes once per expert);
    # 1 packs them back to back
    moe_group_align: int = 1
    remat_policy: RematPolicy = "full"       # glm5_jax/model/decoder.py REMAT_POLICIES
    # weight projections' gradient (glm5_jax.model.layers.einsum): "xla" (as JAX derives it; TPU/GPU) or
    # "cpu_transposed_grad" (the weight gradient from a materialised x^T: faster on XLA:CPU)
    projection_impl: ProjectionImpl = "xla"
    # the dtype in which each weight projection's gradient leaves its matmul (glm5_jax.model.layers.einsum):
    # "float32" (as JAX derives it: fp32 partial sums, reduced across the batch shards (the FSDP
    # reduce-scatter) in fp32, then rounded to the compute dtype) or the compute dtype: the partial sums
    # rounded to it before the reduction, so the reduce-scatter moves half the bytes. Either way the
    # gradient reaches the fp32 master weights through an fp32 cast and the optimizer accumulates in fp32
    grad_reduce_dtype: Dtype = "float32"
    # packed INT4 experts: dequantise + the moe_impl matmul, or the kernel; with fp experts (quant="none") and
    # decode_moe_kernel, the impl of the one-call bf16 decode kernel (pallas_kernels/bf16_decode_moe)
    quant_matmul: QuantMatmul = "xla"
    attention_q_chunk: int = 512             # queries per chunk in the XLA attention / indexer paths
    # training: the LM head and cross-entropy (main and MTP) computed this many positions of every row at a
    # time, each chunk's logits recomputed in the backward pass, so no [B, T, V] logits are held (0: whole;
    # glm5_jax/model/lm_head.py); a T that is no multiple of it is padded
    loss_chunk_tokens: int = 0
    # Pallas impls, training: the sparse stage attends with the flash kernel (MHA form) over the top-k
    # selection as a [T, S] mask while the keys number at most this x index_topk (glm5_jax/model/attention.py
    # `masked_flash_core`); longer sequences gather each query's rows. 0 always gathers.
    masked_flash_factor: float = 4.0
    # Pallas impls: the flash kernel's query and key block (a power of two >= 128). A causal sweep computes
    # about block / 2 masked keys per query on the diagonal, block / T of the work; smaller blocks re-read
    # the key / value blocks more often
    attention_block: int = 512
    attention_mode: AttentionMode = "sparse"  # "sparse" (DSA top-k) or "dense" (causal: dense / warm-up stage)
    # decoding over a cache: "layer" (each layer writes its rows into its cache and attends to it) or "rows" (each
    # layer reads the cache as it was and returns its new rows, written after the layer scan in place; main stack
    # only: glm5_jax/model/decode_rows.py)
    decode_cache_write: DecodeCacheWrite = "layer"
    # with decode_cache_write="rows", how a layer reads the stacked [layers, B, S, X] cache: "slice" (the layer
    # scan slices the layer's cache out: a copy of the layer's whole cache per layer per step) or the scan hands
    # every layer the stacked cache and its index and the selected latent rows are gathered in place by that
    # impl of pallas_kernels/row_gather ("xla": the slice and XLA's gather; "pallas": the kernel); with the slots
    # split over `context` each shard selects and attends over its own slots (glm5_jax/model/decode_context.py)
    decode_cache_read: DecodeCacheRead = "slice"
    # with a decode_cache_read other than "slice", one token per batch row: the absorbed attention over the selected
    # latent rows. "xla": the rows gathered by decode_cache_read's impl, then XLA's attention over them; a Pallas
    # impl: pallas_kernels/sparse_mla_decode gathers and attends in one kernel (each batch row's layer slice
    # streamed through VMEM, the gathered rows and the probabilities never in HBM), where one slice fits VMEM
    # (longer caches keep the gather and XLA's attention). The same values up to the products' fp32 summation order
    decode_attention: DecodeAttention = "xla"
    # decode with the routed experts read by a Pallas kernel (packed INT4 with moe_ep="gather" / "a2a_decode"; bf16
    # with moe_ep="gather" and decode_moe_kernel): the layer scan hands each layer the main stack's stacked
    # [layers, E, ...] experts and its index, read in place by the kernel instead of a copied per-layer slice
    # (variables from glm5_jax/model/moe/int4_weights.stack_expert_variables)
    decode_stacked_experts: bool = False
    # decoding a few tokens with packed INT4 experts through a Pallas quant_matmul (moe_ep="gather", each chip at
    # most pallas_kernels/int4_decode_moe's MAX_ASSIGNMENTS gathered assignments, all within its capacity): a chip's
    # routed-expert sum as that one kernel (the grid over the assignments, each local one's gate, up and down
    # dequantised and applied in VMEM) instead of the blocked dispatch around three INT4 matmul calls (~25 small XLA
    # ops a layer); the same values up to the products' fp32 summation order. With moe_ep="a2a_decode" (many tokens
    # per chip) the same switch runs the rows each chip receives through pallas_kernels/int4_moe_rows (the rows
    # DMA'd into expert blocks, gate / up / SwiGLU / down in VMEM, each result DMA'd back to its row's place);
    # off, they take the gathers, relayouts and three INT4 calls around the block kernel. With bf16 experts
    # (quant="none", decode_stacked_experts, moe_ep="gather", a Pallas quant_matmul as the impl) a chip's few
    # assignments take pallas_kernels/bf16_decode_moe the same way, its weights in width tiles that fit VMEM,
    # instead of a per-layer copy of the chip's expert weights and the grouped matmul's sort and scatter
    decode_moe_kernel: bool = False
    # how moe_ep="a2a_decode" moves the assignments to their experts' chips and back (glm5_jax/model/moe/decode_a2a.py):
    # "slots", an all_to_all of fixed per-destination slots (moe_capacity_factor x the expected share, in 16-row
    # tiles: the buffer moves whole, filled or not); "ragged", a ragged all-to-all (jax.lax.ragged_all_to_all,
    # XLA:TPU / GPU) that sends each assignment's row alone, each chip receiving at most moe_capacity_factor x
    # its expected rows (slices past it dropped, counted); "ragged_dense" the same exchange built from a dense
    # all_to_all (glm5_jax/parallel/ragged_exchange.py: XLA:CPU has no ragged-all-to-all). The same tokens
    # where nothing is dropped
    decode_a2a_exchange: DecodeA2aExchange = "slots"
    # the MoE router's top-k choice and gates from its scores (no expert groups, no replayed routing, a few tokens
    # per shard): "xla" (top-k, gather, normalisation as XLA ops) or the one-call kernel pallas_kernels/router_topk
    # (the same experts, ties to the lower index; gates within fp32 rounding). The Pallas impls have no gradient:
    # decoding only
    router_impl: RouterImpl = "xla"
    # decoding over a cache: also record, per token, the experts each MoE layer routed it to and the slots each
    # full-indexer layer selected for it, in the cache beside its rows (glm5_jax/model/routing_replay.py), so a
    # learner can replay the sampler's routing and top-k instead of recomputing them
    capture_routing: bool = False
    # with a decode_cache_read other than "slice" (the layer's index given): the main stack's attention kv_b_proj
    # read in place from its stacked array by each of its two products instead of a per-layer copy of the
    # scan's slice (variables from glm5_jax/model/stacked_weights.stack_kv_b_variables)
    decode_stacked_kv_b: bool = False
    # with decode_stacked_kv_b: its two halves stored heads-major, W_UK as [layers, H, R, dn] and W_UV as [layers, H,
    # dv, R] (glm5_jax/model/stacked_weights.heads_major_kv_b), so that each absorbed product's result comes out in
    # the layout the next op reads (no layout copy of the absorbed query or of the attention output)
    decode_kv_b_heads_major: bool = False
    # the decoder layers' norms (input, post-attention, q_a / kv_a, the indexer key's) take their row statistics
    # spread over the row (glm5_jax/model/layers.spread_mean): the same values; at one token XLA then fuses the
    # + eps and rsqrt into the op that applies the norm instead of running them as scalar ops, one top-level
    # instruction each
    decode_spread_norms: bool = False
    # the pair-interleaved rotary embedding (glm5_jax/model/rope.py): "slices" (even / odd channels sliced out,
    # rotated, stacked back) or "pair_swap" (x * cos + swap_pairs(x) * sin over the full width, the swap a
    # permutation matmul: a few fusions instead of strided slices, interleaving stacks and layout copies; the
    # same values). Half-split rope is always "slices"
    rope_impl: RopeImpl = "slices"
    # decoding with rope_impl="pair_swap": the RoPE tables (cos, sin of the step's positions, spread over the rotated
    # channels), the same for every layer, computed once per step before the layer scan and handed to every
    # layer (glm5_jax/model/attention.rope_tables) instead of by each layer; the same values
    decode_rope_tables: bool = False
    # the samplers' decode steps (generate, serve, the RL generators and policy server): "xla", decode_config's
    # settings (XLA's forms, each layer writing its cache slice); a Pallas impl, the decode program's settings
    # (glm5_jax/generate/settings.py `sampler_configs`: the layers read the stacked cache in place, the fused
    # gather + attention kernel, the experts in place through the one-call kernels, the decode MoE dispatch):
    # "pallas" on TPU, "pallas_interpret" to run the same kernels on CPU. Prompts prefill through XLA's forms either
    # way; the same tokens up to the kernels' fp32 summation order
    sampler_kernels: SamplerKernels = "xla"
    # with sampler_kernels other than "xla": the decode MoE dispatch, "gather" (a few tokens a chip: every chip
    # gathers the step's tokens) or "a2a_decode" (many: the ragged all-to-all to the experts' chips)
    sampler_dispatch: SamplerDispatch = "gather"
    # with sampler_kernels other than "xla": the dispatch's moe_capacity_factor; 0 keeps every assignment (each chip's
    # capacity at the worst case, so the tokens are the "xla" steps'); e.g. 2.0, the decode compile report's: each
    # chip takes at most 2x its expected share, the rest dropped and counted
    sampler_capacity: float = 0.0
    indexer_loss: IndexerLoss = "none"       # indexer KL in the model's outputs: "none" | "warmup" | "sparse"

    def __post_init__(self):
        for f in ("dtype", "param_dtype", "grad_reduce_dtype"):     # jnp.float32 / "float32" name one dtype
            value = getattr(self, f)
            if not isinstance(value, str):
                try:
                    value = jnp.dtype(value).name
                except TypeError as e:
                    raise ConfigError(f"RuntimeConfig.{f}={value!r}: not a dtype ({e})") from None
                object.__setattr__(self, f, value)
        hints = typing.get_type_hints(RuntimeConfig)
        for f in dataclasses.fields(self):
            allowed = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None
            if allowed is not None and getattr(self, f.name) not in allowed:
                raise ConfigError(f"RuntimeConfig.{f.name}={getattr(self, f.name)!r}: must be one of {allowed}")
        if self.grad_reduce_dtype not in ("float32", self.dtype):
            raise ConfigError(f"RuntimeConfig.grad_reduce_dtype={self.grad_reduce_dtype!r}: the weight gradients "
                              f"are reduced in fp32 or in the compute dtype ({self.dtype!r})")
        if not (isinstance(self.attention_q_chunk, int) and self.attention_q_chunk > 0):
            raise ConfigError(f"RuntimeConfig.attention_q_chunk={self.attention_q_chunk!r}: must be a positive int")
        if not (isinstance(self.loss_chunk_tokens, int) and self.loss_chunk_tokens >= 0):
            raise ConfigError(f"RuntimeConfig.loss_chunk_tokens={self.loss_chunk_tokens!r}: must be an int >= 0 "
                              "(positions per chunk; 0: the whole sequence)")
        if not (isinstance(self.kda_chunk, int) and self.kda_chunk > 0 and self.kda_chunk % 16 == 0):
            raise ConfigError(f"RuntimeConfig.kda_chunk={self.kda_chunk!r}: must be a positive multiple of 16")
        if not (isinstance(self.attention_block, int) and self.attention_block >= 128
                and self.attention_block & (self.attention_block - 1) == 0):
            raise ConfigError(f"RuntimeConfig.attention_block={self.attention_block!r}: must be a power of two >= 128")
        if not self.masked_flash_factor >= 0:
            raise ConfigError(f"RuntimeConfig.masked_flash_factor={self.masked_flash_factor!r}: must be >= 0")
        if not (isinstance(self.moe_a2a_chunks, int) and self.moe_a2a_chunks >= 1):
            raise ConfigError(f"RuntimeConfig.moe_a2a_chunks={self.moe_a2a_chunks!r}: must be an int >= 1")
        if not (isinstance(self.moe_group_align, int) and self.moe_group_align >= 1):
            raise ConfigError(f"RuntimeConfig.moe_group_align={self.moe_group_align!r}: must be an int >= 1")
        if self.moe_group_align > 1 and self.moe_ep != "a2a":
            raise ConfigError(f"RuntimeConfig.moe_group_align={self.moe_group_align}: aligned expert groups are "
                              f"built by the a2a transport (moe_ep='a2a'), not moe_ep={self.moe_ep!r}")
        if self.moe_a2a_chunk_by == "experts" and self.moe_ep != "a2a":
            raise ConfigError(f"RuntimeConfig.moe_a2a_chunk_by='experts': expert chunks are built by the a2a "
                              f"transport (moe_ep='a2a'), not moe_ep={self.moe_ep!r}")
        if not self.sampler_capacity >= 0:
            raise ConfigError(f"RuntimeConfig.sampler_capacity={self.sampler_capacity!r}: must be >= 0 (0: no drops)")
        if not self.moe_capacity_factor > 0:
            raise ConfigError(f"RuntimeConfig.moe_capacity_factor={self.moe_capacity_factor!r}: must be positive")
        if self.indexer_loss == "sparse" and self.attention_mode != "sparse":
            raise ConfigError("RuntimeConfig.indexer_loss='sparse': the sparse-stage KL needs attention_mode='sparse'")
        if self.decode_cache_read != "slice" and self.decode_cache_write != "rows":
            raise ConfigError(f"RuntimeConfig.decode_cache_read={self.decode_cache_read!r}: reads the stacked cache of "
                              "the read-only decode path; needs decode_cache_write='rows'")
        if self.decode_attention != "xla" and self.decode_cache_read == "slice":
            raise ConfigError(f"RuntimeConfig.decode_attention={self.decode_attention!r}: the fused kernel reads the "
                              "stacked cache in place; needs a decode_cache_read other than 'slice'")
        if self.capture_routing and self.decode_cache_write != "layer":
            raise ConfigError("RuntimeConfig.capture_routing records routing in the per-layer cache writes "
                              "(decode_cache_write='layer'), not decode_cache_write="
                              f"{self.decode_cache_write!r}")

    def replace(self, **changes) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)


RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(RuntimeConfig))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # --- sizes ---
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
    indexer_rope_interleave: bool = True     # GLM: pair-interleaved; DeepSeek-V3.2: half-split
    # GLM-5.3-Flash's pooled indexer (glm5_jax/model/pooled_indexer.py): the indexer scores groups of this many
    # tokens and attends to the index_topk / index_kpool best, plus the incomplete tail group; None: GLM-5's
    # per-token lightning indexer
    index_kpool: int | None = None
    index_kpool_always_select_tail: bool = True
    # --- GLM-5.3-Flash: KDA linear attention layers (glm5_jax/model/kda_layer.py) ---
    layer_types: tuple[str, ...] | None = None   # per layer "mla" | "kda"; None -> all MLA (GLM-5)
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0  # forget-gate lower bound (None: softplus decay)
    # --- GLM-5.3-Flash: mHC hyper-connections (glm5_jax/model/hyper_connections.py); 0: plain residual ---
    hc_mult: int = 0
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # clamped SwiGLU (GLM-5.3-Flash: 10): gate <= limit, |up| <= limit; None: plain SwiGLU
    swiglu_limit: float | None = None
    # --- RoPE ---
    rope_theta: float = 1_000_000.0
    # YaRN parameters as sorted (key, value) pairs (DeepSeek-V3.x); None = plain RoPE (GLM-5)
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_interleave: bool = True             # MLA q_rot / k_rot pair-interleaved
    # --- norms ---
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-6            # q_a_layernorm, kv_a_layernorm (hard-coded upstream)
    indexer_norm_eps: float = 1e-6           # indexer k_norm LayerNorm
    # --- MoE ---
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    # --- MTP ---
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
    # INT4 routed experts: "int4_qat" fake-quantises the fp master weights in the forward (straight-through
    # gradients), "int4" holds packed weights (from glm5_jax.model.moe.int4_weights.quantize_params) for
    # inference; both round with glm5_jax/quant/int4.py, so their forwards are the same numbers
    quant: Quant = "none"
    quant_group_size: int = 32               # input channels per scale
    quant_scale_dtype: QuantScaleDtype = "bfloat16"
    # --- how it runs (not part of the architecture): cfg.runtime.attention_impl; cfg.replace(attention_impl=...)
    # and ModelConfig.from_fields({... "attention_impl": ...}) take these names at the top level ---
    runtime: RuntimeConfig = RuntimeConfig()

    # `--set model.<runtime field>` is `--set model.runtime.<runtime field>`; removed fields say what replaced them
    MOVED_FIELDS: ClassVar[dict[str, str]] = dict.fromkeys(RUNTIME_FIELDS, "runtime")
    REMOVED_FIELDS: ClassVar[dict[str, str]] = {
        "sparse_xla_form": "the XLA sparse attention picks its form itself; choose between attention_impl='xla' "
                           "(tuned) and attention_impl='reference' instead"}

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), also in the absorbed form (not 1/sqrt of the latent width); YaRN models multiply by
        mscale^2 (as DeepSeek-V3's yarn_get_mscale)."""
        from glm5_jax.model.rope import yarn_softmax_mscale

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
    def layer_attention_types(self) -> tuple[str, ...]:
        """Attention of each main layer: "mla" (MLA + DSA) or "kda" (linear attention)."""
        return self.layer_types or ("mla",) * self.num_hidden_layers

    @property
    def jnp_dtype(self):
        return self.runtime.jnp_dtype

    @property
    def jnp_param_dtype(self):
        return self.runtime.jnp_param_dtype

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``; runtime fields (``attention_impl=...``) may be given by name."""
        return dataclasses.replace(self, **self._route_runtime(changes, self.runtime))

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> "ModelConfig":
        """A config from a flat dict of field values (a stored config, a config file's dict); runtime fields
        may stand at the top level, as they did before ``runtime`` held them."""
        return cls(**cls._route_runtime(dict(fields), RuntimeConfig()))

    @classmethod
    def _route_runtime(cls, changes: dict[str, Any], runtime) -> dict[str, Any]:
        for old, why in cls.REMOVED_FIELDS.items():
            if old in changes:
                raise ConfigError(f"ModelConfig.{old} was removed: {why}")
        moved = {k: changes.pop(k) for k in list(changes) if k in RUNTIME_FIELDS}
        if moved:
            runtime = changes.get("runtime", runtime)
            if isinstance(runtime, dict):
                runtime = RuntimeConfig(**runtime)
            changes["runtime"] = runtime.replace(**moved)
        return changes

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        if isinstance(self.runtime, dict):      # a stored config (checkpoint metadata) holds it as a dict
            object.__setattr__(self, "runtime", RuntimeConfig(**self.runtime))
        for f in ("indexer_types", "layer_types"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), tuple):
                object.__setattr__(self, f, tuple(getattr(self, f)))
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
                owner = self.runtime if field in RUNTIME_FIELDS else self
                raise ConfigError(f"{type(owner).__name__}.{field}={getattr(owner, field)!r}: {why}")

        if not isinstance(self.runtime, RuntimeConfig):
            raise ConfigError(f"ModelConfig.runtime={self.runtime!r}: must be a RuntimeConfig")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
        need(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0, "qk_rope_head_dim",
             "must be an int >= 0 (0: NoPE attention, GLM-5.3-Flash)")
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
                 f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (the rope slice comes first)")
            if self.indexer_types is not None:
                need(len(self.indexer_types) == self.num_hidden_layers, "indexer_types",
                     f"needs one entry per layer ({self.num_hidden_layers})")
                need(all(t in ("full", "shared") for t in self.indexer_types), "indexer_types",
                     'entries must be "full" or "shared"')
                need(self.indexer_types[0] == "full", "indexer_types",
                     'layer 0 must be "full" (there is no earlier top-k to share)')
        self._validate_flash(need)
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
        need(self.runtime.indexer_loss == "none" or self.use_indexer, "indexer_loss",
             "needs a model with an indexer")
        for f, allowed in (("quant", QUANT_MODES), ("quant_scale_dtype", QUANT_SCALE_DTYPES)):
            need(getattr(self, f) in allowed, f, f"must be one of {allowed}")
        if self.quant != "none":
            g = self.quant_group_size
            need(isinstance(g, int) and g > 0 and g % 8 == 0, "quant_group_size", "must be a positive multiple of 8")
            for f in ("hidden_size", "moe_intermediate_size"):     # the experts' input widths
                need(getattr(self, f) % (8 * g) == 0, f,
                     f"INT4 packs 8 groups of quant_group_size={g} per chunk: must be a multiple of {8 * g}")
        need(self.runtime.quant_matmul == XLA or self.quant == "int4"
             or (self.runtime.decode_moe_kernel and self.runtime.moe_ep == "gather"), "quant_matmul",
             'the Pallas INT4 matmul runs on packed weights (quant="int4"); fp experts take a Pallas quant_matmul only '
             'as the impl of the one-call decode kernel (decode_moe_kernel with moe_ep="gather")')
        need(self.runtime.quant_matmul == XLA or self.runtime.moe_ep in ("none", "gather", "a2a_decode"),
             "quant_matmul", 'the Pallas INT4 matmul runs without expert parallelism (moe_ep="none") or in a decode '
             'dispatch (moe_ep="gather" or "a2a_decode")')
        need(not self.tie_word_embeddings, "tie_word_embeddings", "GLM-5 has an untied head; tying is unsupported")

    def _validate_flash(self, need) -> None:
        """GLM-5.3-Flash's fields: KDA layers, the pooled indexer, hyper-connections, the SwiGLU clamp."""
        if self.layer_types is not None:
            need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"needs one entry per layer ({self.num_hidden_layers})")
            need(all(t in ("mla", "kda") for t in self.layer_types), "layer_types", 'entries must be "mla" or "kda"')
            for f in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
                need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
            need("kda" not in self.layer_types or self.runtime.decode_cache_write == "layer", "decode_cache_write",
                 '"rows" writes latent rows only; KDA layers carry a recurrent state: use "layer"')
        if self.index_kpool is not None:
            need(isinstance(self.index_kpool, int) and self.index_kpool >= 1, "index_kpool", "must be an int >= 1")
            need(self.use_indexer, "index_kpool", "the pooled indexer needs use_indexer=True")
            need(self.index_topk % self.index_kpool == 0, "index_kpool", f"must divide index_topk={self.index_topk}")
            need(self.qk_rope_head_dim == 0, "index_kpool", "the pooled indexer runs without RoPE (qk_rope_head_dim=0)")
            need(self.indexer_types is None, "index_kpool", "the pooled indexer runs in every MLA layer")
            need(self.runtime.indexer_loss == "none", "index_kpool", "the pooled indexer's KL loss is not implemented")
        need(isinstance(self.hc_mult, int) and self.hc_mult >= 0, "hc_mult", "must be an int >= 0")
        need(self.hc_mult == 0 or self.num_nextn_predict_layers == 0, "hc_mult",
             "an MTP module over hyper-connection streams is not implemented")
        need(self.hc_mult == 0 or self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be >= 1")
        if self.swiglu_limit is not None:
            need(self.swiglu_limit > 0, "swiglu_limit", "must be positive")
            need(self.runtime.moe_impl != "blocked" and self.quant == "none", "swiglu_limit",
                 'the clamped SwiGLU runs in the grouped-matmul experts (moe_impl != "blocked", quant="none")')
