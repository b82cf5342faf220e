"""A `ModelConfig` as checkpoints store it (JSON-compatible fields), written and read here for every format:
a converter output keeps it in its orbax custom metadata, a train.py run inside its ``meta`` item (as part of
the experiment config). Stored configs from before ``runtime`` existed hold its fields at the top level;
`ModelConfig.from_fields` reads both."""
from __future__ import annotations

import dataclasses
import json

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.model.config import ModelConfig


def config_to_json(cfg: ModelConfig) -> dict:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields["rope_scaling"] = cfg.rope_scaling_dict
    fields["runtime"] = dataclasses.asdict(cfg.runtime)     # config_from_json turns it back into a RuntimeConfig
    return json.loads(json.dumps(fields))


def config_from_json(fields: dict, where: str = "checkpoint") -> ModelConfig:
    """The stored config; a CheckpointError naming ``where`` when it no longer describes a valid model."""
    try:
        return ModelConfig.from_fields(fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: stored model config is invalid: {e}") from None
