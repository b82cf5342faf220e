"""A two-stage context extension of configs/tiny.py on the embedded corpus, on CPU: 256 -> 1024 tokens,
the second stage with the sequence split over 2 devices (context parallelism, zig-zag layout).

`get_config()` is the second (long) stage; the first is the same config with the overrides below:

    python train.py --config=configs/tiny_long.py --workdir=/tmp/tiny_long/256 \
        --set=data.seq_len=256 --set=data.batch_size=8 --set=mesh.context=1 --set=train.steps=60
    python train.py --config=configs/tiny_long.py --workdir=/tmp/tiny_long/1024 --host_devices=2 \
        --set=train.init_from=/tmp/tiny_long/256

The long stage takes the short stage's weights and tokenizer (train.init_from); its eval loss on
1024-token rows is logged next to the short stage's. Sizes, steps and rates are our choice (a run of
a few minutes on two cores); index_topk = 64 is a sixteenth of the long stage's rows.
"""
from configs.tiny import get_config as tiny_config
from glm5_jax.data import DataConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig


def get_config() -> ExperimentConfig:
    tiny = tiny_config()
    data = DataConfig(source="stdlib", vocab_size=4096, seq_len=1024, batch_size=2, max_corpus_bytes=8_000_000)
    train = TrainConfig(steps=30, stage="sparse", learning_rate=1e-3, warmup_steps=5, log_every=10,
                        bias_update_rate=1e-2, eval_every=30, eval_batches=2, checkpoint_every=30)
    return ExperimentConfig(model=tiny.model, data=data, train=train, mesh=MeshConfig(data=1, fsdp=1, context=2))
