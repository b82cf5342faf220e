"""GLM-5 (744B) context extension with DSA, 4K -> 32K -> 128K -> 200K, on 2048 v5p chips (v5p:8x16x16).

The 4K stage is configs/glm5_744b.py. `get_config()` is the last stage, 202,752 tokens; the earlier
stages are the same config with the overrides `stage_overrides(name)` gives (`STAGES`, `STAGE_REMAT`),
e.g. the 32K stage:

    python train.py --config=configs/glm5_744b_long.py --workdir=DIR_32K \
        --set=model.remat_policy=attention_saveable --set=data.seq_len=32768 --set=data.batch_size=256 \
        --set=mesh.context=8 --set=mesh.fsdp=8 --set=train.steps=2000 --set=train.init_from=DIR_4K

and each stage starts from the previous one with ``--set=train.init_from=<previous workdir>``.
AOT check of the 200K step:

    python train.py --config=configs/glm5_744b_long.py --compile_only --topology=v5p:8x16x16 --workdir=DIR

Where the numbers come from:

* stage lengths: the GLM-5 report (arXiv:2602.15763) grows the context from 4K to 200K in mid-training;
  the intermediate 32K and 128K stages are our choice (the report's summaries name no intermediate
  lengths); 200K is taken as ``max_position_embeddings`` = 202,752 of the released config.json
  (zai-org/GLM-5);
* RoPE: ``rope_theta`` = 1e6 and no scaling in every stage, the released config.json's values (the
  model is served at 202,752 tokens with them); the report names no per-stage RoPE change for us to copy;
* global batch, steps, learning rate: our choice. Every stage keeps about 4K tokens per chip (3,168
  at 200K) so activation memory stays that of the 4K run; tokens per step are 8.4M (32K, 128K) and
  6.5M (200K);
* mesh: our choice. ``context`` = T / 4096 sequence shards (the zig-zag layout, docs/training.md#context-
  parallelism), ``expert`` = 32 as in the 4K run (fewer local experts per chip: smaller expert-weight
  gathers and gradient reduce-scatters for a wider all-to-all; expert 8 -> 32 took the 200K step from
  12.6 to 12.0 s and 70.0 to 53.7 GiB per chip, bench/results/compile_744b_200k.md, and the 32K step from
  27.5% to 29.0% MFU), ``tensor`` = 1 (the context-parallel attention runs all heads per shard),
  ``fsdp`` takes the rest; weights are FSDP-sharded over fsdp x context = 64 chips in every stage.
"""
import dataclasses

from configs.glm5_744b import EXPERT_GROUP_ALIGN, model_config
from glm5_jax.data import DataConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig

CHIPS = 2048
EXPERT = 32
# stage: (seq_len, global batch in sequences, context shards, steps)
STAGES = {
    "32k": (32768, 256, 8, 2000),
    "128k": (131072, 64, 32, 1000),
    "200k": (202752, 32, 64, 500),
}

# remat "attention_saveable": the backward reruns neither the indexer's top-k over every earlier key nor the
# attention and KL forward kernels (the 200K step 16.7 -> 14.0 s for 41.9 -> 70.0 GiB per chip at expert 8).
# At 200K "attention_expert_out_saveable" also keeps the routed experts' outputs: no down product or combine
# in the backward, 10.7 -> 10.1 s for 55.3 -> 76.5 GiB per chip (bench/results/compile_744b_200k.md); at 128K
# (4,096 tokens per chip) it needs 102.9 GiB (13.47 -> 12.97 s; attention_saveable: 71.0 GiB). At 200K
# "attention_expert_out_mlp_saveable" also keeps the query's latent and the shared expert's gate / up products:
# 7.94 -> 7.76 s for 86.9 -> 93.2 GiB per chip (3,168 tokens per chip), 88.2 GiB with the gradients reduced in
# bf16 (below); "moe_attention_saveable" (also the experts' rows and gate / up products) needs 117.6 GiB.
STAGE_REMAT = {"200k": "attention_expert_out_mlp_saveable"}
# one all-to-all chunk in every stage: the 4K run's two expert chunks (configs/glm5_744b.py) add routed-expert
# traffic and hide nothing more here, compiled with the bf16 reductions below: 32K 11.49 -> 11.70 s, 128K 13.47 ->
# 13.72 s, 200K 10.50 -> 10.67 s (bench/results/compile_744b_midtrain_32k.md, compile_744b_200k.md)


def stage_config(name: str) -> ExperimentConfig:
    seq_len, batch, context, steps = STAGES[name]
    # grad_reduce_dtype="bfloat16": the weight gradients reduce-scattered in bf16, as the 4K run (32K: 11.92 ->
    # 11.49 s; 200K: 10.57 -> 10.50 s and 93.20 -> 88.19 GiB per chip)
    model = model_config().replace(remat_policy=STAGE_REMAT.get(name, "attention_saveable"), moe_ep="a2a",
                                   moe_capacity_factor=1.25, attention_impl="pallas",
                                   moe_group_align=EXPERT_GROUP_ALIGN, grad_reduce_dtype="bfloat16")
    data = DataConfig(vocab_size=154880, seq_len=seq_len, batch_size=batch)
    train = TrainConfig(steps=steps, stage="sparse", learning_rate=2e-5, warmup_steps=50, min_lr_ratio=1.0,
                        tpu_flags="sparsecore_offload")    # FSDP collectives on the SparseCores, as glm5_744b.py
    mesh = MeshConfig(data=1, fsdp=CHIPS // (context * EXPERT), context=context, expert=EXPERT, tensor=1)
    return ExperimentConfig(model=model, data=data, train=train, mesh=mesh)


def stage_overrides(name: str) -> list[str]:
    """The ``--set`` items that turn `get_config()` into stage ``name``."""
    final, cfg = get_config(), stage_config(name)
    a, b = final.model.runtime, cfg.model.runtime
    out = [f"model.{f.name}={getattr(b, f.name)}" for f in dataclasses.fields(b) if getattr(a, f.name) != getattr(b, f.name)]
    for group in ("data", "train", "mesh"):
        a, b = getattr(final, group), getattr(cfg, group)
        out += [f"{group}.{f.name}={getattr(b, f.name)}" for f in dataclasses.fields(b)
                if getattr(a, f.name) != getattr(b, f.name)]
    return out


def get_config() -> ExperimentConfig:
    return stage_config("200k")
