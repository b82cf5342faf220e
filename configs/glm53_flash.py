"""GLM-5.3-Flash (transformers' glm5_next, the language model; docs/glm53_flash.md): 45 layers, KDA linear
attention in three of every four, NoPE MLA with the pooled DSA indexer in the fourth, mHC hyper-connections
(4 streams), 288 routed experts (top-8) + 1 shared with a clamped SwiGLU; ~320B parameters.

`model_config()` is Glm5NextTextConfig's defaults (what `glm5_jax.hf.config.config_from_hf` reads from the
hub config.json). `get_config()` is a pod run: 512 v5p chips, FSDP 16 x expert-parallel 32, for an ahead-of-time compile
with `--set=model.kda_impl=pallas --set=model.attention_impl=pallas` (docs/glm53_flash.md#compiled-for-tpu-v5p).
"""
from configs.glm5_744b import EXPERT_GROUP_ALIGN
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig

LAYERS = 45


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=154880, hidden_size=4096, num_hidden_layers=LAYERS, first_k_dense_replace=3,
        intermediate_size=12288, num_attention_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048, index_kpool=16, index_kpool_always_select_tail=True,
        layer_types=tuple("mla" if i % 4 == 3 else "kda" for i in range(LAYERS)),
        linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, swiglu_limit=10.0,
        rms_norm_eps=1e-5, latent_norm_eps=1e-5,
        n_routed_experts=288, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=0, mtp_depth=0, max_position_embeddings=1048576,
        eos_token_id=(), pad_token_id=154820, bos_token_id=None,
        runtime=RuntimeConfig(dtype="bfloat16", param_dtype="float32"),
    )


def get_config() -> ExperimentConfig:
    """512 v5p chips: FSDP 16 x expert-parallel 32 (9 routed experts per chip), no tensor or context split
    (the pooled indexer does not run context-parallel yet); 512 sequences of 4096 tokens per step. Remat keeps
    the routed experts' rows, gate / up products and outputs (`moe_saveable`): with the Pallas impls (the MLA
    layers' masked flash core, the KDA kernels) it needs 95.43 GiB a chip of the 95.74 libtpu allows;
    `--set=model.remat_policy=experts_saveable` recomputes the transport and the down product in about 73 GiB
    (docs/glm53_flash.md#compiled-for-tpu-v5p)."""
    # communication settings (as configs/glm5_744b.py): the all-to-all in two token chunks (one chunk's transport
    # beside the other chunk's expert matmuls; three chunks of 3 of the 9 local experts each hide as much but move
    # 0.25 TB more: 3.73 s), each expert's received rows on a grouped-matmul row tile, weight gradients
    # reduce-scattered in bf16, and the FSDP collectives on the SparseCores: exposed communication 0.94 -> 0.17 s,
    # 4.37 -> 3.62 s (docs/glm53_flash.md#compiled-for-tpu-v5p)
    # kda_chunk=128: the KDA kernels' grids take a step per (head, chunk), ~0.35 us each beside little work; 128-token
    # chunks halve the steps and the saved chunk states (forward + backward per layer 2.25 -> 1.48 ms compiled
    # alone at the per-chip shapes; 256-token chunks: 1.69 ms, the within-chunk products growing with the chunk)
    # hc_sinkhorn_unroll: the mixers' 20 Sinkhorn iterations as straight-line ops XLA fuses, not a loop of small ops
    model = model_config().replace(remat_policy="moe_saveable", moe_ep="a2a", moe_capacity_factor=1.25,
                                   moe_a2a_chunks=2, moe_a2a_chunk_by="tokens", moe_group_align=EXPERT_GROUP_ALIGN,
                                   grad_reduce_dtype="bfloat16", kda_chunk=128,
                                   hc_sinkhorn_unroll=True)
    data = DataConfig(vocab_size=154880, seq_len=4096, batch_size=512)
    train = TrainConfig(steps=10_000, stage="sparse", learning_rate=2e-4, warmup_steps=500, grad_accum=1,
                        tpu_flags="sparsecore_offload")
    return ExperimentConfig(model=model, data=data, train=train,
                            mesh=MeshConfig(data=1, fsdp=16, context=1, expert=32, tensor=1))
