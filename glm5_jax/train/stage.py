"""The DSA training stages (docs/training.md#dsa-stages), as in DeepSeek-V3.2-Exp's continued pre-training:

    stage    attention  indexer loss                   trains               LM / MTP / balance loss  routing bias
    dense    dense      none                           all but the indexer  yes                      updated
    warmup   dense      warmup (towards dense attn.)   the indexer only     no                       kept
    sparse   top-k      sparse (on the selected keys)  everything           yes                      updated

`StageSpec` is one row; `stage_spec(train.stage)` looks it up once and the trainer passes it around.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax

from glm5_jax.model.config import ConfigError

Stage = Literal["dense", "warmup", "sparse"]
STAGES = typing.get_args(Stage)


def is_indexer_param(path) -> bool:
    """Whether the parameter at a pytree ``path`` belongs to a DSA indexer."""
    return "indexer" in [getattr(k, "key", str(k)) for k in path]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    name: Stage
    attention_mode: str          # model.attention_mode: "dense" or "sparse" (top-k)
    indexer_loss: str            # model.indexer_loss where the model has an indexer
    trains: Literal["all", "indexer", "all_but_indexer"]
    lm_loss: bool                # the LM, MTP and balance terms count in the total loss
    updates_routing_bias: bool   # the auxiliary-loss-free routing-bias step runs

    def model_config(self, model_cfg):
        """`model_cfg` with this stage's attention and indexer-loss settings."""
        indexer_loss = self.indexer_loss
        if self.name == "sparse" and not model_cfg.use_indexer:      # no indexer (deepseek_v3): nothing to train
            indexer_loss = "none"
        if model_cfg.index_kpool is not None:   # the pooled indexer (GLM-5.3-Flash) has no KL loss yet: untrained
            indexer_loss = "none"
        return model_cfg.replace(attention_mode=self.attention_mode, indexer_loss=indexer_loss)

    def trainable_labels(self, params):
        """'train' / 'frozen' per leaf of ``params`` (or of any tree with its structure, e.g. gradients)."""

        def label(path, _):
            if self.trains == "all":
                return "train"
            return "train" if is_indexer_param(path) == (self.trains == "indexer") else "frozen"

        return jax.tree_util.tree_map_with_path(label, params)


_SPECS = {
    "dense": StageSpec("dense", "dense", "none", "all_but_indexer", lm_loss=True, updates_routing_bias=True),
    "warmup": StageSpec("warmup", "dense", "warmup", "indexer", lm_loss=False, updates_routing_bias=False),
    "sparse": StageSpec("sparse", "sparse", "sparse", "all", lm_loss=True, updates_routing_bias=True),
}


def stage_spec(name: str) -> StageSpec:
    """The stage called `name` (``train.stage``); a `ConfigError` for an unknown one."""
    if name not in _SPECS:
        raise ConfigError(f"train.stage={name!r}: must be one of {STAGES}")
    return _SPECS[name]
