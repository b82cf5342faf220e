"""The DSA stage table (glm5_jax/train/stage.py): what each stage trains, runs and counts."""
import jax.numpy as jnp
import pytest

from glm5_jax.model.config import ConfigError, ModelConfig
from glm5_jax.train.stage import STAGES, stage_spec

PARAMS = {"embed": jnp.zeros((4, 2)),
          "decoder": {"attn": {"q_a_proj": jnp.zeros((2, 2)),
                               "indexer": {"wk": jnp.zeros((2, 2)), "weights_proj": jnp.zeros((2, 1))}}}}


def _labels(stage):
    labels = stage_spec(stage).trainable_labels(PARAMS)
    return labels["embed"], labels["decoder"]["attn"]["q_a_proj"], labels["decoder"]["attn"]["indexer"]


def test_trainable_labels_per_stage():
    assert _labels("dense") == ("train", "train", {"wk": "frozen", "weights_proj": "frozen"})
    assert _labels("warmup") == ("frozen", "frozen", {"wk": "train", "weights_proj": "train"})
    assert _labels("sparse") == ("train", "train", {"wk": "train", "weights_proj": "train"})


def test_model_config_and_loss_switches():
    cfg = ModelConfig()
    got = {s: (stage_spec(s).model_config(cfg).runtime.attention_mode,
               stage_spec(s).model_config(cfg).runtime.indexer_loss,
               stage_spec(s).lm_loss, stage_spec(s).updates_routing_bias) for s in STAGES}
    assert got == {"dense": ("dense", "none", True, True), "warmup": ("dense", "warmup", False, False),
                   "sparse": ("sparse", "sparse", True, True)}
    # no indexer (deepseek_v3's dense MLA): top-k attention without an indexer KL
    assert stage_spec("sparse").model_config(cfg.replace(use_indexer=False)).runtime.indexer_loss == "none"


def test_unknown_stage():
    with pytest.raises(ConfigError, match="train.stage='sprase'"):
        stage_spec("sprase")
