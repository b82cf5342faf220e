"""The line train.py prints before its first step names exactly the terms `lm_losses` adds to `loss`."""
import os

from glm5_jax.train.experiment import apply_overrides, load_config_file
from glm5_jax.train.losses import loss_legend
from glm5_jax.train.stage import stage_spec

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.py")


def _legend(*overrides):
    exp = apply_overrides(load_config_file(TINY), list(overrides))
    stage = stage_spec(exp.train.stage)
    return loss_legend(exp.train, stage.model_config(exp.model), stage)


def test_the_legend_names_each_weighted_term():
    assert _legend().startswith("loss = lm + 0.3*mtp + 0.0001*balance + 1*indexer_kl (summed over layers")
    assert _legend().endswith("see docs/training.md#losses-and-weights")
    assert _legend("train.stage=dense").startswith("loss = lm + 0.3*mtp + 0.0001*balance; ")
    assert _legend("train.stage=warmup", "train.indexer_loss_weight=2").startswith("loss = 2*indexer_kl (summed")
    assert _legend("train.stage=dense", "train.mtp_loss_weight=0", "train.balance_loss_weight=0") == \
        "loss = lm; see docs/training.md#losses-and-weights"
