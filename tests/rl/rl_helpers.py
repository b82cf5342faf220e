"""A tiny sort-task GLM-5 (MLA + DSA top-k + MoE) for the RL tests, and its config file."""
import textwrap

from glm5_jax.data.sort_task import EOS_ID, PAD_ID
from glm5_jax.model.config import ModelConfig

TINY_MODEL = dict(
    vocab_size=16, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=64,
    num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    index_n_heads=2, index_head_dim=8, index_topk=10, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=32, num_nextn_predict_layers=0, mtp_depth=0,
    max_position_embeddings=64, eos_token_id=(EOS_ID,), pad_token_id=PAD_ID, bos_token_id=None,
    remat_policy="none", moe_impl="blocked", mla_form="mha")


def tiny_model_config(**changes) -> ModelConfig:
    return ModelConfig.from_fields({**TINY_MODEL, **changes})


def write_tiny_configs(folder, *, sft_steps=3, num_versions=6, tau=1, lockstep=True, eval_every=0, extra_rl="") -> str:
    """Writes tiny_sft.py and tiny_rl.py into `folder`; returns the RL config path."""
    sft = folder / "tiny_sft.py"
    sft.write_text(textwrap.dedent(f"""
        import dataclasses
        from configs.sort_sft import get_config as base
        from glm5_jax.model.config import ModelConfig

        def get_config():
            cfg = base()
            return dataclasses.replace(
                cfg, model=ModelConfig.from_fields({TINY_MODEL!r}),
                data=dataclasses.replace(cfg.data, batch_size=16),
                train=dataclasses.replace(cfg.train, steps={sft_steps}, log_every=1, eval_every={sft_steps},
                                          eval_batches=1, checkpoint_every={sft_steps}, warmup_steps=1))
    """))
    rl = folder / "tiny_rl.py"
    rl.write_text(textwrap.dedent(f"""
        from glm5_jax.rl.config import RLConfig, RLExperiment

        def get_config():
            return RLExperiment(rl=RLConfig(num_versions={num_versions}, tau={tau}, lockstep={lockstep},
                                            prompts_per_batch=4, group_size=2, eval_every={eval_every}, eval_prompts=8,
                                            learning_rate=1e-3,
                                            {extra_rl}),
                                sft_config={str(sft)!r})
    """))
    return str(rl)
