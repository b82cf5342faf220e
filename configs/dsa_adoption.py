"""DSA adoption by continued training, as GLM-5 did it: a dense-attention run, then a short warm-up that
trains only the lightning indexer to match the dense attention (KL), then sparse training of everything.
A tiny GLM-5 on the embedded corpus with T = 4 x index_topk, so the top-k really drops keys.

Three train.py runs, each starting from the previous one's workdir (`train.init_from`: weights and
routing bias; fresh optimizer, step 0; the tokenizer is reused):

    python train.py --config=configs/dsa_adoption.py --workdir=/tmp/dsa/dense
    python train.py --config=configs/dsa_adoption.py --workdir=/tmp/dsa/warmup \
        --set=train.stage=warmup --set=train.steps=40 --set=train.learning_rate=1e-3 \
        --set=train.warmup_steps=5 --set=train.init_from=/tmp/dsa/dense
    python train.py --config=configs/dsa_adoption.py --workdir=/tmp/dsa/sparse \
        --set=train.stage=sparse --set=train.steps=120 --set=train.learning_rate=1e-3 \
        --set=train.warmup_steps=10 --set=train.init_from=/tmp/dsa/warmup

`stage_overrides(stage, init_from)` gives those --set lists (bench/dsa_quality.py uses it).
"""
from glm5_jax.data import DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig

# per stage: steps, peak learning rate, LR warm-up steps. The indexer warm-up is short (it fits a small
# module to a fixed target); the sparse stage continues at a lower peak than the dense one.
STAGE_SCHEDULE = {
    "dense": dict(steps=240, learning_rate=3e-3, warmup_steps=30),
    "warmup": dict(steps=40, learning_rate=1e-3, warmup_steps=5),
    "sparse": dict(steps=120, learning_rate=1e-3, warmup_steps=10),
}


def stage_overrides(stage: str, init_from: str | None = None) -> list[str]:
    """The --set list of one stage of the chain (`init_from`: the previous stage's workdir)."""
    sets = [f"train.stage={stage}"] + [f"train.{k}={v}" for k, v in STAGE_SCHEDULE[stage].items()]
    return sets + ([f"train.init_from={init_from}"] if init_from else [])


def get_config() -> ExperimentConfig:
    model = ModelConfig(
        vocab_size=2048, hidden_size=96, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=256,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, index_n_heads=4, index_head_dim=16,
        index_topk=32,                         # T = 128 = 4 x index_topk
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=96,
        num_nextn_predict_layers=0, mtp_depth=0, max_position_embeddings=1024, initializer_range=0.02,
        eos_token_id=(1,), pad_token_id=0, bos_token_id=None,
        runtime=RuntimeConfig(remat_policy="none", moe_impl="blocked"))
    data = DataConfig(source="stdlib", vocab_size=2048, seq_len=128, batch_size=8, max_corpus_bytes=3_000_000)
    train = TrainConfig(stage="dense", **STAGE_SCHEDULE["dense"], log_every=20, eval_every=60, eval_batches=4,
                        checkpoint_every=60, bias_update_rate=1e-2)
    return ExperimentConfig(model=model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=-1))
