"""The real GLM-5 (zai-org/GLM-5; docs/architecture.md#notation-and-sizes): 743.9B parameters, ~40B active per token.

`get_config()` is the pod run checked by ahead-of-time compilation (bench/results/compile_744b.md):

    python train.py --config=configs/glm5_744b.py --compile_only --topology=v5p:8x16x16 --workdir=DIR
"""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig
from pallas_kernels.grouped_matmul.kernel import GMM_TILING, TGMM_TILING

# the a2a transport starts each local expert's rows on this many rows: the grouped matmul's row tile, which the
# forward and weight-gradient kernels must share for no tile to be computed twice
assert GMM_TILING[0] == TGMM_TILING[0], "aligned expert groups need one row tile for both kernels"
EXPERT_GROUP_ALIGN = GMM_TILING[0]


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=154880, hidden_size=6144, num_hidden_layers=78, first_k_dense_replace=3,
        intermediate_size=12288, num_attention_heads=64,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048, indexer_rope_interleave=True,
        rope_theta=1_000_000.0, rope_interleave=True, rms_norm_eps=1e-5,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=1, mtp_depth=1, max_position_embeddings=202752,
        eos_token_id=(154820, 154827, 154829), pad_token_id=154820,
        runtime=RuntimeConfig(dtype="bfloat16", param_dtype="float32"),
    )


def get_config() -> ExperimentConfig:
    """2048 v5p chips: FSDP 32 x context 2 x expert-parallel 32, no tensor split; 1024 sequences of 4096
    tokens (4.2M) per step, each sequence over 2 chips. The mesh sweeps (bench/mesh_sweep.py, docs/scaling.md)
    chose it: no tensor split (against fsdp 128 x expert 8 x tensor 2 it drops the tensor all-reduces and the
    per-chip copies of tensor-replicated activations: 9.1 s vs 18.7 s then), and 32 experts' worth of chips
    per expert group, so each chip holds 8 routed experts instead of 32: the experts' weight gathers,
    gradient reduce-scatters and weight re-reads shrink 4x for a wider all-to-all. Dense stage: est. 5.02 s
    against 6.63 s at expert 8 (bench/results/mesh_sweep_dense.md); sparse stage: 5.32 s against 7.01 s
    (bench/results/compile_744b.md). Under the stricter start-to-done overlap rule of docs/cost_model.md
    those are 5.13 and 5.45 s, and with the async all-to-all in two token chunks (below) 4.72 s dense and
    5.04 s sparse."""
    # remat: "moe_attention_saveable" keeps each MoE layer's expert input rows, gate / up products and outputs
    # (the backward reruns no expert product and moves no rows) and each layer's attention core residuals,
    # query and block output (the backward reruns only the key / value up-projection); 84-87 GiB per chip in
    # the dense and sparse steps (bench/results/compile_744b_pretrain.md, compile_744b.md)
    # moe_a2a_chunks=2, moe_a2a_chunk_by="experts": the (async) all-to-all runs in two chunks, each every token's
    # assignments to half of each chip's local experts, so one chunk's transport runs beside the other chunk's
    # expert matmuls; each grouped matmul holds ~8,192 rows over 4 experts instead of 8 (token halves): fewer
    # row tiles cut by an expert boundary (1.13x -> 1.06x the routed rows' MXU work), no sum of the two halves'
    # weight gradients
    # moe_group_align: each local expert's received rows start on a row tile of the grouped matmul (forward and
    # weight-gradient kernels: 256 rows), so no tile is computed twice by two experts (1.22x -> ~1.13x the
    # routed rows' MXU work at 8 experts per chip; the buffer stays 10,240 rows per chunk: 32 sources x 80
    # slots per expert is a whole number of tiles)
    # attention_block=512: the flash kernel's causal sweep computes about block / 2 masked keys per query on the
    # diagonal (12.5% of a 4K sequence's pairs at 512, 6.25% at 256), but its grid has a step for every (query
    # block, key block) pair, needed or not, and each costs ~0.35 us; at a context shard's 2,048 queries over
    # 4,096 keys and 64 heads, the forward and backward kernels take 16,384 steps a layer at 256 and 4,096 at
    # 512: 5.47 -> 3.47 ms a layer under the conservative cost rules (bench/results/flash_blocks.json), dense
    # step 3.88 -> 3.72 s. 1024-blocks would save 0.23 ms more a layer for 11% more kernel FLOPs (masked
    # diagonal pairs) and [1024, 1024] fp32 score blocks (4 MiB each) in VMEM
    # grad_reduce_dtype="bfloat16": each weight projection's gradient leaves its matmul in bf16 (fp32 accumulation,
    # one rounding), so the FSDP reduce-scatters of the attention, shared-expert, dense-MLP, MTP and LM-head
    # gradients move bf16 instead of fp32 (the routed experts' already did; docs/training.md): sparse step
    # 4.59 -> 3.98 s, dense 4.39 -> 3.88 s, both with 256-blocks (bench/results/compile_744b.md,
    # compile_744b_pretrain.md)
    model = model_config().replace(remat_policy="moe_attention_saveable", moe_ep="a2a", moe_capacity_factor=1.25,
                                   moe_a2a_chunks=2, moe_a2a_chunk_by="experts", moe_group_align=EXPERT_GROUP_ALIGN,
                                   attention_block=512, grad_reduce_dtype="bfloat16")
    data = DataConfig(vocab_size=154880, seq_len=4096, batch_size=1024)
    # tpu_flags "sparsecore_offload": the FSDP weight all-gathers and gradient reduce-scatters / all-reduces run
    # on the v5p SparseCores, asynchronously beside the TensorCore's compute (glm5_jax/platforms/tpu_flags.py)
    train = TrainConfig(steps=10_000, stage="sparse", learning_rate=2e-4, warmup_steps=500, grad_accum=1,
                        tpu_flags="sparsecore_offload")
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=32, context=2, expert=32,
                                                                                         tensor=1))
