"""A small but complete GLM-5 (MLA + DSA with a real top-k + MoE + MTP) that trains on 2 CPU cores in
minutes on the embedded corpus (the Python standard library's source, BPE-tokenised in the workdir)."""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    # 16 indexer heads: a key that every head scores <= 0 (ReLU) gets index score exactly 0 and torch / XLA
    # break such top-k ties differently; with 16 heads that is ~1 key in 65k (with 4, 1 in 16), so the
    # exported model's logits match transformers' past index_topk too. Narrow heads keep the run fast.
    model = ModelConfig(
        vocab_size=4096, hidden_size=128, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=384,
        num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_n_heads=16, index_head_dim=24, index_topk=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        num_nextn_predict_layers=1, mtp_depth=1, max_position_embeddings=4096, initializer_range=0.02,
        eos_token_id=(1,), pad_token_id=0, bos_token_id=None,
        runtime=RuntimeConfig(remat_policy="none", moe_impl="blocked", projection_impl="cpu_transposed_grad"))
    data = DataConfig(source="stdlib", vocab_size=4096, seq_len=256, batch_size=8, max_corpus_bytes=8_000_000)
    train = TrainConfig(steps=300, stage="sparse", learning_rate=3e-3, warmup_steps=30, log_every=10, bias_update_rate=1e-2,
                        eval_every=50, eval_batches=4, checkpoint_every=100)
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
