"""GLM-5.2's 1M context: the 744B model with IndexShare, one 1,048,576-token training step on 2048 v5p chips.

GLM-5.2 keeps GLM-5's architecture and shares the DSA indexer across layers ("IndexShare"): only 21 of
the 78 main layers own an indexer, in the pattern ``FFF`` + 18 x ``SSSF`` + ``SSS`` (HF's rule with
``index_topk_freq`` = 4, ``index_skip_topk_offset`` = 3: a "shared" layer reuses the top-k of the most recent
full layer, glm5_jax/hf/config.py), RoPE ``rope_theta`` = 8e6 and 1,048,576 positions.

AOT check of the 1M step (bench/results/compile_744b_1m.json):

    python train.py --config=configs/glm52_744b_1m.py --compile_only --topology=v5p:8x16x16 --workdir=DIR

The step, our choice: 8 sequences of 1,048,576 tokens (8.4M tokens), each over ``context`` = 256 chips in the
zig-zag layout (4,096 tokens per chip, as in every stage of configs/glm5_744b_long.py), expert-parallel 8
(batch rows must divide data x fsdp x expert, and fsdp x context x expert = 2048), weights FSDP-sharded
over fsdp x context = 256 chips.
"""
from configs.glm5_744b import EXPERT_GROUP_ALIGN, model_config
from glm5_jax.data import DataConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig

CHIPS = 2048
SEQ_LEN = 1_048_576
CONTEXT = SEQ_LEN // 4096          # 4,096 tokens per chip
EXPERT = CHIPS // CONTEXT          # 8
INDEX_SHARE_FREQ, INDEX_SHARE_OFFSET = 4, 3
INDEX_SHARE_PATTERN = "FFF" + "SSSF" * 18 + "SSS"


def index_share_types(num_layers: int, freq: int = INDEX_SHARE_FREQ, offset: int = INDEX_SHARE_OFFSET):
    """HF's IndexShare rule: layer i owns an indexer iff max(i - offset + 1, 0) % freq == 0."""
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def glm52_model_config():
    base = model_config()
    return base.replace(indexer_types=index_share_types(base.num_hidden_layers), rope_theta=8_000_000.0,
                        max_position_embeddings=SEQ_LEN)


def get_config() -> ExperimentConfig:
    # remat "selection_saveable": every layer's forward is recomputed but the DSA selection ([4,096 x 2,048] slots
    # per full-indexer layer and chip), so the backward reruns no indexer scores or top-k over up to 1M keys
    # (indexer 3.40 -> 1.70 s). Keeping the attention outputs too ("attention_saveable") needs 112.6 GiB per chip.
    # moe_a2a_chunks=2 by experts (16 of the 32 local experts each) hides one chunk's all-to-all behind the
    # other's expert matmuls (exposed communication 2.95 -> 1.90 s, 19.67 -> 18.92 s, 65.5 -> 80.2 GiB);
    # grad_reduce_dtype="bfloat16" as the 4K run (bench/results/compile_744b_1m.md)
    model = glm52_model_config().replace(remat_policy="selection_saveable", moe_ep="a2a", moe_capacity_factor=1.25,
                                         attention_impl="pallas", moe_group_align=EXPERT_GROUP_ALIGN,
                                         moe_a2a_chunks=2, moe_a2a_chunk_by="experts", grad_reduce_dtype="bfloat16")
    data = DataConfig(vocab_size=154880, seq_len=SEQ_LEN, batch_size=CHIPS // CONTEXT)
    train = TrainConfig(steps=200, stage="sparse", learning_rate=1e-5, warmup_steps=20, min_lr_ratio=1.0,
                        tpu_flags="sparsecore_offload")
    mesh = MeshConfig(data=1, fsdp=1, context=CONTEXT, expert=EXPERT, tensor=1)
    return ExperimentConfig(model=model, data=data, train=train, mesh=mesh)
