"""A run small enough to start, compile and train a few steps in seconds (resume tests)."""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    model = ModelConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                        intermediate_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16,
                        index_topk=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        num_nextn_predict_layers=1, mtp_depth=1, eos_token_id=(1,), pad_token_id=0,
                        bos_token_id=None, runtime=RuntimeConfig(remat_policy="none"))
    data = DataConfig(vocab_size=512, seq_len=32, batch_size=4, max_corpus_bytes=150_000, min_eval_docs=2)
    train = TrainConfig(steps=8, log_every=1, eval_every=4, eval_batches=1, checkpoint_every=2, warmup_steps=2)
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
