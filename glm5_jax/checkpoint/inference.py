"""Load a model for inference from any orbax checkpoint this project writes.

* a `train.py` run: ``<workdir>`` or ``<workdir>/checkpoints`` (latest step, or ``step=``), whose ``meta``
  item holds the experiment config and whose ``state`` item holds a TrainState;
* a converter output (``python -m glm5_jax.convert hf-to-orbax``): step 0 with a ``state`` item and the
  ModelConfig in the checkpoint's custom metadata;
* an RL learner's policy: ``<rl workdir>`` or ``<rl workdir>/policy`` (latest committed version, or
  ``step=``), whose ``params`` item holds the variables and whose ``meta`` item the ModelConfig.

`find_checkpoint` is the one place that tells them apart. Only ``params`` and ``moe_bias`` are read
(orbax partial restore: the optimizer state stays on disk), placed on ``sharding`` when given (one
sharding, or one per variable), otherwise on the default device.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.handoff import COMMIT_MARKER
from glm5_jax.checkpoint.placement import variable_shardings
from glm5_jax.checkpoint.stored_config import config_from_json
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.model.config import ModelConfig
from glm5_jax.parallel.sampling import SAMPLING_RULES, check_sampling_fits

COLLECTIONS = ("params", "moe_bias")


@dataclasses.dataclass(frozen=True)
class StoredCheckpoint:
    """One step of an orbax checkpoint directory and where its model variables are."""
    kind: str                 # "train" (a train.py run), "converted" (hf-to-orbax output) or "policy" (RL)
    directory: str            # the CheckpointManager directory (absolute)
    step: int
    item: str                 # the item whose top level holds {"params", "moe_bias"}: "state" or "params"
    cfg: ModelConfig
    custom_metadata: dict     # the step's orbax custom metadata (a converter's hf_config and hf_dtypes)

    @property
    def step_dir(self) -> str:
        return storage.join(self.directory, str(self.step))

    @property
    def item_dir(self) -> str:
        return storage.join(self.step_dir, self.item)


def step_json_meta(step_dir: str, key: str) -> dict | None:
    """The JSON object holding `key` in a step's ``meta`` item (a train.py run's experiment config under
    "config", an RL policy version's ModelConfig under "model_config"), None when there is none."""
    meta_dir = storage.join(step_dir, "meta")
    for name in sorted(storage.listdir(meta_dir)) if storage.isdir(meta_dir) else ():
        try:
            meta = json.loads(storage.read_text(storage.join(meta_dir, name)))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and key in meta:
            return meta
    return None


def _manager_dir(path: str) -> str:
    """A train.py workdir -> its checkpoints/, an RL workdir -> its policy/; else the path itself."""
    for sub in ("checkpoints", "policy"):
        if storage.isdir(storage.join(path, sub)):
            return storage.join(path, sub)
    return path


def _not_a_checkpoint(path: str) -> str:
    if storage.isfile(storage.join(path, "config.json")) and storage.glob(path, "*.safetensors"):
        return (f"{path}: is a Hugging Face checkpoint, not an orbax one; convert it first: "
                f"python -m glm5_jax.convert hf-to-orbax --hf_dir={path} --out_dir=DIR")
    return (f"{path}: is not a checkpoint: expected a train.py workdir or its checkpoints/, an hf-to-orbax "
            f"output, or an RL workdir or its policy/ (found no committed orbax step)")


def find_checkpoint(path: str, step: int | None = None) -> StoredCheckpoint:
    """The step (newest committed one unless given) of a train workdir, its checkpoints/, a converter
    output, an RL workdir or its policy/, with its model config; CheckpointError naming what is missing."""
    path = storage.absolute(path)
    if not storage.isdir(path):
        raise CheckpointError(f"{path}: " + ("not a directory" if storage.exists(path) else "no such directory"))
    path = _manager_dir(path)
    steps = ocp.path.step.checkpoint_steps(storage.path(path))        # finalized steps (a read-only manager would warn)
    if not steps:
        raise CheckpointError(_not_a_checkpoint(path))
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"{path}: no step {step}; committed steps are {sorted(steps)}")
    step_dir = storage.join(path, str(step))
    if storage.isdir(storage.join(step_dir, "state")):
        config = (step_json_meta(step_dir, "config") or {}).get("config")
        if isinstance(config, dict) and "model" in config:            # train.py run
            return StoredCheckpoint("train", path, step, "state", config_from_json(config["model"], step_dir), {})
        # the step's own metadata file: manager.metadata(step) would also ask every item for its metadata and
        # warn that items it has no handler for here ("meta", "data") "could not be restored"
        custom = ocp.metadata.get_step_metadata(storage.path(step_dir)).custom_metadata or {}
        if "model_config" in custom:                                   # converter output
            return StoredCheckpoint("converted", path, step, "state",
                                    config_from_json(custom["model_config"], step_dir), custom)
        raise CheckpointError(f"{step_dir}: found no model config (neither converter metadata nor a train.py "
                              f"'meta' item)")
    if storage.isdir(storage.join(step_dir, "params")):                # RL policy version
        if not storage.isfile(storage.join(step_dir, COMMIT_MARKER)):
            raise CheckpointError(f"{step_dir}: policy version is not committed (no {COMMIT_MARKER})")
        meta = step_json_meta(step_dir, "model_config") or {}
        if "model_config" not in meta:
            raise CheckpointError(f"{step_dir}: the policy's 'meta' item has no model_config (written by a "
                                  f"learner that did not store it)")
        return StoredCheckpoint("policy", path, step, "params", config_from_json(meta["model_config"], step_dir), {})
    raise CheckpointError(f"{step_dir}: neither a 'state' item (train.py run, converter output) nor a 'params' "
                          f"item (RL policy)")


def locate_checkpoint(path: str, step: int | None):
    """(manager directory, step, ModelConfig); see `find_checkpoint`."""
    found = find_checkpoint(path, step)
    return found.directory, found.step, found.cfg


def latest_step(path: str) -> int:
    """The newest committed step of a checkpoint directory (as `load_for_inference` finds it)."""
    return find_checkpoint(path, None).step


def stored_leaves(item_dir: str) -> dict:
    """The metadata tree of an orbax PyTree item (through the item's handler, not a Checkpointer: the item
    directory has no step metadata file of its own, and a Checkpointer warns "Metadata file does not exist")."""
    return ocp.PyTreeCheckpointHandler().metadata(storage.path(item_dir)).tree


def load_for_inference(path: str, step: int | None = None, sharding=None):
    """(ModelConfig, variables {"params", "moe_bias"}, step) from an orbax checkpoint directory."""
    found = find_checkpoint(path, step)
    return found.cfg, load_variables(found, sharding), found.step


def load_variables(found: StoredCheckpoint, sharding=None) -> dict:
    """The variables {"params", "moe_bias"} of a checkpoint step `find_checkpoint` found."""
    cfg, state_dir = found.cfg, found.item_dir
    tree = stored_leaves(state_dir)
    missing = [c for c in COLLECTIONS if c not in tree and not (c == "moe_bias" and not cfg.n_routed_experts)]
    if missing:
        raise CheckpointError(f"{state_dir}: checkpoint has no {missing} (has {sorted(tree)})")
    wanted = {c: tree[c] for c in COLLECTIONS if c in tree}
    if isinstance(sharding, dict):        # one sharding per variable ({"params": {...}, "moe_bias": {...}})
        abstract = {c: jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=s),
                                    wanted[c], sharding[c]) for c in wanted}
    else:
        target = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=target), wanted)
    restored = ocp.PyTreeCheckpointHandler().restore(storage.path(state_dir), args=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True))
    return {c: restored[c] for c in wanted}


def checkpoint_tokenizer(checkpoint: str) -> str:
    """The tokenizer.json of a checkpoint: the BPE a train.py workdir cached under tokenizer/ (found from the
    workdir or its checkpoints/), or one beside a converter output or an export."""
    checkpoint = storage.absolute(checkpoint)
    roots = [checkpoint]
    if storage.basename(checkpoint) in ("checkpoints", "policy"):
        roots.append(storage.dirname(checkpoint))
    found = []
    for root in roots:
        found += sorted(f for d in storage.glob(storage.join(root, "tokenizer"), "*")
                        for f in storage.glob(d, "tokenizer.json"))
        if storage.isfile(storage.join(root, "tokenizer.json")):
            found.append(storage.join(root, "tokenizer.json"))
    if len(found) != 1:
        raise CheckpointError(f"--tokenizer is required: found {len(found)} tokenizer.json under {checkpoint}"
                              + (f" ({', '.join(found)})" if found else " (a train.py workdir keeps its BPE in "
                                                                        "tokenizer/bpe-*/)"))
    return found[0]


@dataclasses.dataclass(frozen=True)
class InferenceModel:
    """What generate and serve run: the model config and variables of one checkpoint step, and its tokenizer."""
    cfg: ModelConfig
    variables: dict
    step: int
    tokenizer: Any                # glm5_jax.data.tokenizer.Tokenizer
    tokenizer_path: str


def load_model_and_tokenizer(checkpoint: str, step: int | None = None, tokenizer: str | None = None,
                             dtype: str | None = None, mesh=None) -> InferenceModel:
    """The checkpoint is checked first (a wrong path is named as such, not as a missing tokenizer), then the
    tokenizer (`tokenizer`, default the checkpoint's own) is loaded, then the variables, cast to `dtype`.

    With a sampling ``mesh`` (`glm5_jax.parallel.sampling.sampling_mesh`) the model is checked against it
    (MeshError) and every weight is restored straight onto it, laid out by SAMPLING_RULES; without one,
    onto the default device."""
    found = find_checkpoint(checkpoint, step)
    if mesh is not None:
        check_sampling_fits(mesh, found.cfg)
    tokenizer_path = tokenizer or checkpoint_tokenizer(checkpoint)
    loaded = load_tokenizer(tokenizer_path)
    shardings = None if mesh is None else variable_shardings(found.cfg, mesh, SAMPLING_RULES)
    cfg, variables = found.cfg, load_variables(found, shardings)
    if dtype:
        cfg, variables = cast_variables(cfg, variables, dtype)
    return InferenceModel(cfg, variables, found.step, loaded, tokenizer_path)


def cast_variables(cfg, variables, dtype: str):
    """(config, variables) computing in `dtype`, the params cast once."""
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    return cfg, {"params": jax.tree.map(lambda x: x.astype(dtype), variables["params"]),
                 **{k: v for k, v in variables.items() if k != "params"}}
