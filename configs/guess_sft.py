"""SFT for the multi-turn RL demo: a tiny GLM-5 (MLA + DSA + MoE) clones a noisy number-guessing teacher
(binary search, but a random guess in agentic.teacher_noise of its turns; glm5_jax.rl.agentic_sft).
Made by `python -m glm5_jax.rl.run --config=configs/rl_guess.py` on first use; not a train.py config
(data.source "number_guess" names the teacher, not a corpus).
"""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.rl.number_guess import GuessTokens
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    tokens = GuessTokens()
    model = ModelConfig(
        vocab_size=tokens.invalid + 1, hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1,
        intermediate_size=128, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16,
        index_topk=16,                     # every prediction in an episode sees <= 16 keys: the frozen indexer drops none
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        num_nextn_predict_layers=0, mtp_depth=0, max_position_embeddings=64, initializer_range=0.02,
        quant_group_size=8,                # INT4 groups that divide the 64-wide experts (rl.handoff_int4_experts)
        eos_token_id=(tokens.end,), pad_token_id=0, bos_token_id=None,
        runtime=RuntimeConfig(remat_policy="none", moe_impl="blocked", mla_form="mha"))
    data = DataConfig(source="number_guess", seq_len=16, batch_size=64)
    train = TrainConfig(steps=400, stage="sparse", learning_rate=3e-3, warmup_steps=20, log_every=50)
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
