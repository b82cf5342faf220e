"""A new run's starting weights from another checkpoint (``train.init_from``).

Three kinds of source, told apart by what the directory holds:

* a ``train.py`` workdir (or its ``checkpoints/``), of any DSA stage: its latest step's ``state`` item;
* a converter output (``python -m glm5_jax.convert hf-to-orbax``): step 0 with ``{params, moe_bias}``;
* an RL run (or its ``policy/``): its latest committed policy version;
* a Hugging Face checkpoint directory (``config.json`` + safetensors): read leaf by leaf with the
  converter's slice reader, each device reading only its shard.

Only ``params`` and ``moe_bias`` are taken by default, restored straight onto the run's shardings and
dtypes; the optimizer state is fresh (the stages train different parameter subsets, so their optimizer
trees differ) and the step is 0. ``train.init_keep_optimizer`` / ``train.init_keep_step`` also take the
source run's optimizer state / step where its trees match this run's.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp

from glm5_jax import storage
from glm5_jax.checkpoint.inference import find_checkpoint, step_json_meta

log = logging.getLogger("glm5_jax.train")
WEIGHTS = ("params", "moe_bias")


class ArchitectureMismatch(ValueError):
    """The source checkpoint's parameters do not fit the run's model."""


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str                    # "train" | "converted" | "policy" | "hf"
    path: str                    # the directory orbax reads (or the HF directory)
    step: int | None = None      # the orbax step read
    stage: str | None = None     # a train.py source's DSA stage
    item: str = "state"          # the orbax item holding {params, moe_bias}

    def describe(self) -> str:
        if self.kind == "train":
            return f"train.py run {self.path} (stage {self.stage}, step {self.step})"
        if self.kind == "policy":
            return f"RL policy {self.path} (version {self.step})"
        return {"converted": "converted checkpoint", "hf": "Hugging Face checkpoint"}[self.kind] + f" {self.path}"


def _is_hf_dir(path: str) -> bool:
    return storage.isfile(storage.join(path, "config.json")) and bool(storage.glob(path, "*.safetensors"))


def find_source(path: str) -> Source:
    path = storage.absolute(path)
    if not storage.isdir(path):
        raise FileNotFoundError(f"train.init_from={path}: no such directory")
    if _is_hf_dir(path):
        return Source("hf", path)
    found = find_checkpoint(path, None)
    if found.kind != "train":
        return Source(found.kind, found.directory, found.step, item=found.item)
    meta = step_json_meta(found.step_dir, "config")
    return Source("train", found.directory, found.step, meta["config"].get("train", {}).get("stage"))


# ---------------------------------------------------------------------------------------- shape check
def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def check_same_architecture(stored: dict[str, tuple], wanted: dict[str, tuple], source: str) -> None:
    """Raise `ArchitectureMismatch` naming the first parameter (in the run's order) that is missing,
    has another shape, or is extra in the source."""
    for name, shape in wanted.items():
        if name not in stored:
            raise ArchitectureMismatch(f"train.init_from={source}: the checkpoint has no {name} (this run's model "
                                       f"has it with shape {list(shape)})")
        if tuple(stored[name]) != tuple(shape):
            raise ArchitectureMismatch(f"train.init_from={source}: {name} has shape {list(stored[name])} in the "
                                       f"checkpoint but {list(shape)} in this run's model")
    extra = [n for n in stored if n not in wanted]
    if extra:
        raise ArchitectureMismatch(f"train.init_from={source}: the checkpoint has {extra[0]} (shape "
                                   f"{list(stored[extra[0]])}) which this run's model lacks"
                                   + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


# ---------------------------------------------------------------------------------------- readers
def _stored_tree(source: Source):
    state_dir = storage.join(source.path, str(source.step), source.item)
    return ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata.tree


def _restore_orbax(source: Source, abstract: dict) -> dict:
    """The items of `abstract` (ShapeDtypeStructs with target shardings) from the source's state; orbax
    casts each leaf to the target dtype."""
    state_dir = storage.join(source.path, str(source.step), source.item)
    return ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True))


def _read_hf(reader, plan, abstract: dict) -> dict:
    from glm5_jax.convert.hub_reader import read_leaf_slice

    reader.check(plan)
    out: dict = {}
    for leaf in plan:
        target = abstract[leaf.collection]
        for p in leaf.path:
            target = target[p]
        array = jax.make_array_from_callback(
            leaf.shape, target.sharding, lambda index, leaf=leaf, dtype=np.dtype(target.dtype):
            read_leaf_slice(reader, leaf, index, dtype))
        node = out.setdefault(leaf.collection, {})
        for p in leaf.path[:-1]:
            node = node.setdefault(p, {})
        node[leaf.path[-1]] = array
    return out


# ---------------------------------------------------------------------------------------- entry points
def load_weights(path: str, wanted: dict) -> tuple[dict, Source]:
    """({"params", "moe_bias"} from `path`, placed and cast per `wanted`'s ShapeDtypeStructs, source)."""
    source = find_source(path)
    wanted = {c: wanted[c] for c in WEIGHTS if c in wanted and jax.tree.leaves(wanted[c])}
    if source.kind == "hf":
        from glm5_jax.convert.hf_to_orbax import open_hub

        _, _, reader, plan = open_hub(source.path, "float32")
        stored = {"/".join((leaf.collection,) + leaf.path): leaf.shape for leaf in plan}
        check_same_architecture(stored, _leaf_shapes(wanted), path)
        return _read_hf(reader, plan, wanted), source
    stored_tree = _stored_tree(source)
    stored = _leaf_shapes({c: stored_tree[c] for c in WEIGHTS if c in stored_tree})
    check_same_architecture(stored, _leaf_shapes(wanted), path)
    return _restore_orbax(source, wanted), source


def initial_state(trainer, path: str, *, keep_optimizer: bool = False, keep_step: bool = False, seed: int = 0):
    """(TrainState on the trainer's mesh, start step) for a new run initialised from `path`."""
    abstract = trainer.abstract_state
    if keep_optimizer or keep_step:
        source = find_source(path)
        if source.kind != "train":
            raise ValueError(f"train.init_from: {source.describe()} has no optimizer state or step, only a "
                             f"train.py run has (unset train.init_keep_optimizer / train.init_keep_step)")
    weights, source = load_weights(path, {c: getattr(abstract, c) for c in WEIGHTS})
    state = trainer.state_from_weights(weights["params"], weights.get("moe_bias", {}), seed)
    if keep_optimizer or keep_step:
        state = _keep_from_train_run(trainer, source, state, keep_optimizer, keep_step)
    log.info("initialised from %s%s%s", source.describe(),
             "; optimizer state kept" if keep_optimizer else "; fresh optimizer",
             f"; step {int(state.step)} kept" if keep_step else "; step 0")
    return state, int(state.step)


def _keep_from_train_run(trainer, source: Source, state, keep_optimizer: bool, keep_step: bool):
    abstract = trainer.abstract_state
    wanted = {}
    if keep_optimizer:
        stored = _leaf_shapes(_stored_tree(source).get("opt_state", {}))
        mine = _leaf_shapes(abstract.opt_state)
        if sorted(stored.values()) != sorted(mine.values()) or len(stored) != len(mine):
            raise ValueError(f"train.init_keep_optimizer: the optimizer state of {source.describe()} does not "
                             f"match this run's (stage {trainer.stage.name}, optimizer "
                             f"{trainer.exp.train.optimizer}): {len(stored)} vs {len(mine)} arrays; the DSA "
                             f"stages train different parameter subsets, so keep it only within a stage")
        wanted["opt_state"] = abstract.opt_state
    if keep_step:
        wanted["step"] = abstract.step
    restored = _restore_orbax(source, wanted)
    return state.replace(**restored)


def reuse_tokenizer(init_from: str, workdir: str) -> None:
    """Copy a train.py source run's trained BPE into a new workdir, so the run reads the same token ids."""
    src_root = storage.absolute(init_from)
    if storage.basename(src_root) == "checkpoints":
        src_root = storage.dirname(src_root)
    src, dst = storage.join(src_root, "tokenizer"), storage.join(workdir, "tokenizer")
    if storage.isdir(src) and not storage.exists(dst):
        for folder, _, names in storage.walk(src):
            for name in names:
                file = storage.join(folder, name)
                storage.copy_file(file, storage.join(dst, file[len(src) + 1:]))
        log.info("reusing the tokenizer of %s", src_root)
