"""SFT for the RL demo (docs/training.md#the-sort-task): a tiny GLM-5 (MLA + DSA top-k + MoE) learns to sort 6 digits
from a noisy teacher that swaps two adjacent answer tokens in half its demos, so sampled exact match
plateaus near the teacher's quality (~0.6) and RL (configs/rl_sort.py) has room to improve it.

    python train.py --config=configs/sort_sft.py --workdir=/tmp/glm5_sort_sft
"""
from glm5_jax.data import DataConfig
from glm5_jax.data.sort_task import EOS_ID, PAD_ID, SORT
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    model = ModelConfig(
        vocab_size=16, hidden_size=128, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=256,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, index_n_heads=2, index_head_dim=16,
        index_topk=10,                     # < the 15-token example: the top-k selection is real
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        num_nextn_predict_layers=0, mtp_depth=0, max_position_embeddings=64, initializer_range=0.02,
        eos_token_id=(EOS_ID,), pad_token_id=PAD_ID, bos_token_id=None,
        runtime=RuntimeConfig(remat_policy="none", moe_impl="blocked", mla_form="mha"))
    data = DataConfig(source=SORT, seq_len=16, batch_size=128)
    train = TrainConfig(steps=300, stage="sparse", learning_rate=1e-3, warmup_steps=20, log_every=20,
                        eval_every=100, eval_batches=4, checkpoint_every=100, bias_update_rate=1e-3,
                        balance_loss_weight=1e-4)
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
