"""Load a model for inference from either kind of orbax checkpoint this project writes.

* a `train.py` run: ``<workdir>`` or ``<workdir>/checkpoints`` (latest step, or ``step=``), whose ``meta``
  item holds the experiment config and whose ``state`` item holds a TrainState;
* a converter output (``python -m glm5_jax.convert hf-to-orbax``): step 0 with a ``state`` item and the
  ModelConfig in the checkpoint's custom metadata.

Only ``params`` and ``moe_bias`` are read (orbax partial restore: the optimizer state stays on disk),
placed on ``sharding`` when given, otherwise on the default device.
"""
from __future__ import annotations

import glob
import json
import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.stored_config import config_from_json

COLLECTIONS = ("params", "moe_bias")


def locate_checkpoint(path: str, step: int | None):
    """(manager directory, step, ModelConfig) for a train workdir, its checkpoints/ or a converter dir."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    steps = ocp.path.step.checkpoint_steps(path)        # finalized steps (a read-only manager would warn)
    if not steps:
        raise CheckpointError(f"{path}: holds no committed orbax checkpoint step")
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"{path}: no step {step}; committed steps are {sorted(steps)}")
    step_dir = os.path.join(path, str(step))
    if not os.path.isdir(os.path.join(step_dir, "state")):
        raise CheckpointError(f"{step_dir}: no 'state' item")
    # the step's own metadata file: manager.metadata(step) would also ask every item for its metadata and
    # warn that items it has no handler for here ("meta", "data") "could not be restored"
    custom = ocp.metadata.get_step_metadata(step_dir).custom_metadata or {}
    if "model_config" in custom:                                   # converter output
        return path, step, config_from_json(custom["model_config"], step_dir)
    meta_dir = os.path.join(step_dir, "meta")
    meta_files = [f for f in os.listdir(meta_dir)] if os.path.isdir(meta_dir) else []
    for name in meta_files:
        try:
            with open(os.path.join(meta_dir, name)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and "model" in meta.get("config", {}):
            return path, step, config_from_json(meta["config"]["model"], step_dir)
    raise CheckpointError(f"{step_dir}: found no model config (neither converter metadata nor a train.py "
                          f"'meta' item)")


def latest_step(path: str) -> int:
    """The newest committed step of a checkpoint directory (as `load_for_inference` finds it)."""
    return locate_checkpoint(path, None)[1]


def load_for_inference(path: str, step: int | None = None, sharding=None):
    """(ModelConfig, variables {"params", "moe_bias"}, step) from an orbax checkpoint directory."""
    directory, step, cfg = locate_checkpoint(path, step)
    state_dir = os.path.join(directory, str(step), "state")
    # the item's handler, not a Checkpointer: the item directory has no step metadata file of its own
    # (a Checkpointer looks for one and warns "Metadata file does not exist")
    handler = ocp.PyTreeCheckpointHandler()
    tree = handler.metadata(epath.Path(state_dir)).tree
    missing = [c for c in COLLECTIONS if c not in tree and not (c == "moe_bias" and not cfg.n_routed_experts)]
    if missing:
        raise CheckpointError(f"{state_dir}: checkpoint has no {missing} (has {sorted(tree)})")
    wanted = {c: tree[c] for c in COLLECTIONS if c in tree}
    target = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=target), wanted)
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    restored = handler.restore(epath.Path(state_dir), args=ocp.args.PyTreeRestore(
        abstract, restore_args=restore_args, partial_restore=True))
    return cfg, {c: restored[c] for c in wanted}, step


def checkpoint_tokenizer(checkpoint: str) -> str:
    """The tokenizer.json of a checkpoint: the BPE a train.py workdir cached, or one beside a converter output."""
    found = sorted(glob.glob(os.path.join(checkpoint, "tokenizer", "*", "tokenizer.json")))
    if os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        found.append(os.path.join(checkpoint, "tokenizer.json"))
    if len(found) != 1:
        raise CheckpointError(f"--tokenizer is required: found {len(found)} tokenizer.json under {checkpoint}")
    return found[0]


def cast_variables(cfg, variables, dtype: str):
    """(config, variables) computing in `dtype`, the params cast once."""
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    return cfg, {"params": jax.tree.map(lambda x: x.astype(dtype), variables["params"]),
                 **{k: v for k, v in variables.items() if k != "params"}}
