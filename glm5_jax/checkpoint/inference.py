"""Load a model for inference from either kind of orbax checkpoint this project writes.

* a `train.py` run: ``<workdir>`` or ``<workdir>/checkpoints`` (latest step, or ``step=``), whose ``meta``
  item holds the experiment config and whose ``state`` item holds a TrainState;
* a converter output (``python -m glm5_jax.convert hf-to-orbax``): step 0 with a ``state`` item and the
  ModelConfig in the checkpoint's custom metadata.

Only ``params`` and ``moe_bias`` are read (orbax partial restore: the optimizer state stays on disk),
placed on ``sharding`` when given, otherwise on the default device.
"""
from __future__ import annotations

import json

import jax
import orbax.checkpoint as ocp

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.stored_config import config_from_json

COLLECTIONS = ("params", "moe_bias")


def locate_checkpoint(path: str, step: int | None):
    """(manager directory, step, ModelConfig) for a train workdir, its checkpoints/ or a converter dir."""
    path = storage.absolute(path)
    if not storage.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if storage.isdir(storage.join(path, "checkpoints")):
        path = storage.join(path, "checkpoints")
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
    steps = manager.all_steps()
    if not steps:
        raise CheckpointError(f"{path}: holds no committed orbax checkpoint step")
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"{path}: no step {step}; committed steps are {sorted(steps)}")
    step_dir = storage.join(path, str(step))
    if not storage.isdir(storage.join(step_dir, "state")):
        raise CheckpointError(f"{step_dir}: no 'state' item")
    custom = manager.metadata(step).custom_metadata or {}
    if "model_config" in custom:                                   # converter output
        return path, step, config_from_json(custom["model_config"], step_dir)
    meta_dir = storage.join(step_dir, "meta")
    meta_files = [f for f in storage.listdir(meta_dir)] if storage.isdir(meta_dir) else []
    for name in meta_files:
        try:
            meta = json.loads(storage.read_text(storage.join(meta_dir, name)))
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
    state_dir = storage.join(directory, str(step), "state")
    tree = ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata.tree
    missing = [c for c in COLLECTIONS if c not in tree and not (c == "moe_bias" and not cfg.n_routed_experts)]
    if missing:
        raise CheckpointError(f"{state_dir}: checkpoint has no {missing} (has {sorted(tree)})")
    wanted = {c: tree[c] for c in COLLECTIONS if c in tree}
    target = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=target), wanted)
    restored = ocp.PyTreeCheckpointer().restore(
        state_dir, args=ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(
            abstract), partial_restore=True))
    return cfg, {c: restored[c] for c in wanted}, step


def checkpoint_tokenizer(checkpoint: str) -> str:
    """The tokenizer.json of a checkpoint: the BPE a train.py workdir cached, or one beside a converter output."""
    found = sorted(f for d in storage.glob(storage.join(checkpoint, "tokenizer"), "*")
                   for f in storage.glob(d, "tokenizer.json"))
    if storage.isfile(storage.join(checkpoint, "tokenizer.json")):
        found.append(storage.join(checkpoint, "tokenizer.json"))
    if len(found) != 1:
        raise CheckpointError(f"--tokenizer is required: found {len(found)} tokenizer.json under {checkpoint}")
    return found[0]


def cast_variables(cfg, variables, dtype: str):
    """(config, variables) computing in `dtype`, the params cast once."""
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    return cfg, {"params": jax.tree.map(lambda x: x.astype(dtype), variables["params"]),
                 **{k: v for k, v in variables.items() if k != "params"}}
