"""The train-step benchmark model (bench/train_step.py): a ~50M-parameter GLM-5 with every part of the
architecture (MLA + DSA top-k + MoE with a shared expert + MTP), small enough to step on a CPU."""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    model = ModelConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=8, first_k_dense_replace=1, intermediate_size=1408,
        num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=48, qk_rope_head_dim=16,
        v_head_dim=64, index_n_heads=4, index_head_dim=32, index_topk=256,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=256,
        num_nextn_predict_layers=1, mtp_depth=1, max_position_embeddings=8192, initializer_range=0.02,
        eos_token_id=(1,), pad_token_id=0, bos_token_id=None,
        # CPU speed settings (bench/train_step.py docstring): grouped matmul as padded blocks, absorbed
        # (latent) sparse attention over the gathered top-k rows; remat keeps projection and attention outputs
        runtime=RuntimeConfig(moe_impl="blocked", mla_form="absorbed", remat_policy="dots_attention_saveable",
                              projection_impl="cpu_transposed_grad"))
    data = DataConfig(source="stdlib", vocab_size=8192, seq_len=1024, batch_size=2)
    train = TrainConfig(stage="sparse", optimizer="adamw")
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
