"""A small GLM-5.3-Flash (KDA linear attention in three of every four layers, NoPE MLA + the pooled DSA
indexer in the fourth, mHC hyper-connections, clamped SwiGLU, MoE) that trains on 2 CPU cores on the
embedded corpus (docs/glm53_flash.md):

    python train.py --config=configs/tiny_flash.py --workdir=/tmp/glm5_tiny_flash
"""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    # 8 layers: KDA x3, MLA, KDA x3, MLA (layer 0 dense, the rest MoE); pools of 16 tokens, 4 pools + the tail
    # per query (index_topk 64) out of up to 256 keys. No MTP: transformers' Glm5Next defines none.
    layers = 8
    model = ModelConfig(
        vocab_size=4096, hidden_size=128, num_hidden_layers=layers, first_k_dense_replace=1, intermediate_size=384,
        num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=0,
        v_head_dim=32, index_n_heads=16, index_head_dim=24, index_topk=64, index_kpool=16,
        layer_types=tuple("mla" if i % 4 == 3 else "kda" for i in range(layers)),
        linear_num_heads=4, linear_head_dim=32, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        num_nextn_predict_layers=0, mtp_depth=0, max_position_embeddings=4096, initializer_range=0.02,
        rms_norm_eps=1e-5, latent_norm_eps=1e-5, eos_token_id=(1,), pad_token_id=0, bos_token_id=None,
        runtime=RuntimeConfig(remat_policy="none", moe_impl="ragged_dot", projection_impl="cpu_transposed_grad"))
    data = DataConfig(source="stdlib", vocab_size=4096, seq_len=256, batch_size=8, max_corpus_bytes=8_000_000)
    train = TrainConfig(steps=200, stage="sparse", learning_rate=3e-3, warmup_steps=20, log_every=10,
                        bias_update_rate=1e-2, eval_every=50, eval_batches=4, checkpoint_every=100)
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
