"""Experiment configuration: model + data + training + mesh, and typed ``--set key=value`` overrides.

A config file in ``configs/`` defines ``get_config() -> ExperimentConfig``. Overrides address nested
fields with dots (``train.steps=100``, ``model.hidden_size=128``, ``mesh.fsdp=2``); values are parsed
as Python literals and checked against the field's type; unknown keys are errors listing valid ones.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import types
import typing
from typing import Any, Literal

from glm5_jax.data import DataConfig
from glm5_jax.model.config import ConfigError, ModelConfig
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.stage import Stage, stage_spec
from glm5_jax.platforms.tpu_flags import FLAG_SETS as TPU_FLAG_SETS

Optimizer = Literal["adamw", "muon"]
OPTIMIZERS = typing.get_args(Optimizer)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    stage: Stage = "sparse"                # DSA training stage (glm5_jax/train/stage.py)
    seed: int = 0
    # starting point of a new run (ignored once the workdir holds a checkpoint: that resumes): a train.py
    # workdir of any stage, a converter output (hf-to-orbax) or a Hugging Face directory; params and
    # routing bias are taken, the optimizer and step start fresh unless kept (train.py sources only)
    init_from: str | None = None
    init_keep_optimizer: bool = False
    init_keep_step: bool = False
    # optimisation
    optimizer: Optimizer = "adamw"         # Muon Split: per-head orthogonalisation
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1              # cosine decays to learning_rate * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8                      # Adam epsilon (AdamW, and Muon's Adam part)
    clip_norm: float = 1.0
    # dtype of the first moment (AdamW's mu, Muon's momentum): None keeps the parameters' dtype;
    # "bfloat16" halves it (at 744B: 3.0 -> 1.5 TB of optimizer state)
    mu_dtype: str | None = None
    grad_accum: int = 1                    # micro-batches per step (the global batch is split into these)
    # loss weights (docs/architecture.md#balance-and-bias-update, docs/training.md#losses-and-weights,
    # docs/architecture.md#dsa-training-stages-and-the-indexer-kl)
    mtp_loss_weight: float = 0.3           # λ
    balance_loss_weight: float = 1e-4      # α, sequence-wise balance loss
    bias_update_rate: float = 1e-3         # γ, auxiliary-loss-free routing-bias step
    indexer_loss_weight: float = 1.0
    # bookkeeping
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    max_to_keep: int = 3
    async_checkpointing: bool = True
    # TPU compiler flags by name (glm5_jax/platforms/tpu_flags.py): "collective_overlap" runs collectives inside
    # the compute around them; "none" keeps libtpu's defaults. Applied by train.py before libtpu starts.
    tpu_flags: str = "collective_overlap"
    # jax.profiler trace of steps [profile_start, profile_start + profile_steps) (0-based step indices) into
    # <workdir>/tb/plugins/profile/, for TensorBoard's profile plugin / XProf; profile_steps=0: no trace
    profile_start: int = 10
    profile_steps: int = 0

    def validate(self):
        stage_spec(self.stage)                             # a ConfigError for an unknown stage
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer={self.optimizer!r}: must be one of {OPTIMIZERS}")
        if self.tpu_flags not in TPU_FLAG_SETS:
            raise ConfigError(f"train.tpu_flags={self.tpu_flags!r}: must be one of {sorted(TPU_FLAG_SETS)}")
        if self.mu_dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"train.mu_dtype={self.mu_dtype!r}: must be None, 'float32' or 'bfloat16'")
        if (self.init_keep_optimizer or self.init_keep_step) and not self.init_from:
            raise ConfigError("train.init_keep_optimizer / train.init_keep_step need train.init_from")
        if self.profile_start < 0 or self.profile_steps < 0:
            raise ConfigError(f"train.profile_start={self.profile_start}, train.profile_steps={self.profile_steps}: "
                             "must be >= 0")
        for f in ("steps", "grad_accum", "log_every", "eval_every", "checkpoint_every", "max_to_keep"):
            if getattr(self, f) < 1:
                raise ConfigError(f"train.{f}={getattr(self, f)}: must be >= 1")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()

    def validate(self):
        self.model.validate()
        self.data.validate()
        self.train.validate()
        if self.model.quant == "int4":
            raise ConfigError('model.quant="int4" holds packed integer inference weights and cannot be '
                             'trained; train with model.quant="int4_qat" and quantise afterwards')
        if self.data.batch_size % self.train.grad_accum:
            raise ConfigError(f"data.batch_size={self.data.batch_size} is not divisible by "
                             f"train.grad_accum={self.train.grad_accum}")
        return self


def load_config_file(path: str, expected_type: type = ExperimentConfig):
    """The ``get_config()`` of a Python config file, checked to be an ``expected_type``."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"glm5_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config()")
    cfg = module.get_config()
    if not isinstance(cfg, expected_type):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not {expected_type.__name__}")
    return cfg


def _field_names(obj) -> list[str]:
    names = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            names += [f"{f.name}.{n}" for n in _field_names(value)]
        else:
            names.append(f.name)
    return names


def _matches(value, annotation) -> bool:
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple or annotation is tuple:
        return isinstance(value, tuple)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, annotation)


def _parse(raw: str, annotation):
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw                                      # bare strings: --set=train.stage=warmup
    if isinstance(value, list):
        value = tuple(value)
    if not _matches(value, annotation) and _matches(raw, annotation):
        value = raw
    if not _matches(value, annotation):
        raise ConfigError(f"expected {annotation}, got {value!r}")
    if annotation is float or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                               and float in typing.get_args(annotation) and isinstance(value, int)):
        value = float(value)
    return value


def apply_overrides(cfg, overrides: list[str]):
    """Return `cfg` with each ``a.b.c=value`` applied (typed). Every override is parsed first and each
    config object is then rebuilt once with all of its changes, so it is validated once, with every
    override in place: fields that must agree (model.quant and model.quant_group_size) may be set in any
    order. A key set twice takes its last value."""
    changes: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        path, value = _resolve_path(cfg, key.strip().split("."), raw, key, "")
        node = changes
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return _apply_changes(cfg, changes)


def _apply_changes(obj, changes: dict):
    """`obj` with `changes` ({field: value, or {sub-field: ...} for a nested config}): one replace per object."""
    if not changes:
        return obj
    return dataclasses.replace(obj, **{name: _apply_changes(getattr(obj, name), value) if isinstance(value, dict)
                                       and dataclasses.is_dataclass(getattr(obj, name)) else value
                                       for name, value in changes.items()})


def _resolve_path(obj, path, raw, full_key, prefix) -> tuple[tuple[str, ...], Any]:
    """(field names from `obj` down to the field that `path` names, moved fields followed, and its typed value)."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = path[0]
    moved_to = getattr(type(obj), "MOVED_FIELDS", {}).get(name)
    removed = getattr(type(obj), "REMOVED_FIELDS", {}).get(name)
    if removed is not None:
        raise ConfigError(f"--set {full_key}: {name!r} was removed: {removed}")
    if name not in fields and moved_to is not None:       # e.g. model.attention_impl -> model.runtime.attention_impl
        return _resolve_path(obj, [moved_to, *path], raw, full_key, prefix)
    if name not in fields:
        valid = ", ".join(prefix + n for n in _field_names(obj))
        raise ConfigError(f"--set {full_key}: unknown key {name!r}; valid keys: {valid}")
    current = getattr(obj, name)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"--set {full_key}: {name!r} has no sub-keys")
        sub_path, value = _resolve_path(current, path[1:], raw, full_key, f"{prefix}{name}.")
        return (name, *sub_path), value
    if dataclasses.is_dataclass(current):
        valid = ", ".join(f"{prefix}{name}.{n}" for n in _field_names(current))
        raise ConfigError(f"--set {full_key}: {name!r} is a group; set one of its keys: {valid}")
    hints = typing.get_type_hints(type(obj))
    try:
        value = _parse(raw, hints[name])
    except ValueError as e:
        raise ConfigError(f"--set {full_key}={raw}: {e}") from None
    return (name,), value
