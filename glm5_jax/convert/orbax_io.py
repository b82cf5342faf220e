"""Our orbax checkpoint, written and read one leaf (or a few) at a time.

Layout (a `CheckpointManager` directory holding step 0)::

    <ckpt_dir>/0/state/                  orbax PyTree {"params": {...}, "moe_bias": {...}} (OCDBT)
    <ckpt_dir>/0/_CHECKPOINT_METADATA    custom_metadata: {"hf_config": <source config.json>,
                                         "model_config": <ModelConfig fields>, "hf_dtypes": {leaf: dtype}}

Written with orbax's partial save (each call adds leaves; `finalize` commits the step atomically), so
the converter never holds more than one flush worth of arrays. Restore in training code with
``ocp.CheckpointManager(ckpt_dir).restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))``
where ``abstract = {"params": ..., "moe_bias": ...}`` of ShapeDtypeStructs with target shardings.
"""
from __future__ import annotations


import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental import v1 as ocp_v1
from orbax.checkpoint.experimental.v1 import partial as ocp_partial

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError

STEP = 0
STATE_ITEM = "state"
FLUSH_BYTES = 64 * 2**20


def step_dir(ckpt_dir: str) -> str:
    return storage.join(ckpt_dir, str(STEP))


def _nest(collection: str, path: tuple[str, ...], value) -> dict:
    tree = value
    for p in reversed((collection,) + path):
        tree = {p: tree}
    return tree


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = _merge(a.get(k, {}), v) if isinstance(v, dict) else v
    return a


def _save_context():
    """Replica-parallel saving slices every replicated shard with a freshly compiled jit (seconds per
    leaf on a mesh); each replica group's first device writes whole shards instead. Weights barely
    compress, so zstd is off (restore reads either)."""
    context = ocp_v1.Context()
    context.array.saving.use_replica_parallel = False
    context.array.saving.use_compression = False
    return context


class LeafWriter:
    """Adds leaves to step 0 of a new checkpoint in batches of about `flush_bytes`. One batch is written
    in the background while the caller builds the next, so at most two batches are alive at once."""

    def __init__(self, ckpt_dir: str, custom_metadata: dict, flush_bytes: int = FLUSH_BYTES):
        self.path = step_dir(ckpt_dir)
        self.custom_metadata = custom_metadata          # stored with the first batch
        self.flush_bytes = flush_bytes
        self._pending: dict = {}
        self._pending_bytes = 0
        self._in_flight = None

    def add(self, collection: str, path: tuple[str, ...], array: jax.Array) -> None:
        _merge(self._pending, _nest(collection, path, array))
        self._pending_bytes += array.nbytes
        if self._pending_bytes >= self.flush_bytes:
            self.flush()

    def _wait(self) -> None:
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None

    def flush(self) -> None:
        if self._pending:
            self._wait()
            with _save_context():
                self._in_flight = ocp_partial.save_async(self.path, self._pending, custom_metadata=self.custom_metadata)
            self.custom_metadata = None
        self._pending, self._pending_bytes = {}, 0

    def finalize(self) -> None:
        self.flush()
        self._wait()
        if self.custom_metadata is not None:
            raise ValueError("LeafWriter.finalize: no leaves were added")
        with _save_context():
            ocp_partial.finalize(self.path)


def state_dir(ckpt_dir: str) -> str:
    """The ``state`` item of a converter output (step 0)."""
    path = storage.join(step_dir(ckpt_dir), STATE_ITEM)
    if not storage.isdir(path):
        raise CheckpointError(f"{ckpt_dir}: not a converted orbax checkpoint (no step {STEP} with item "
                              f"{STATE_ITEM!r} at {path})")
    return path


def read_custom_metadata(ckpt_dir: str) -> dict:
    state_dir(ckpt_dir)
    manager = ocp.CheckpointManager(storage.absolute(ckpt_dir), options=ocp.CheckpointManagerOptions(read_only=True))
    metadata = manager.metadata(STEP).custom_metadata or {}
    if "model_config" not in metadata:
        raise CheckpointError(f"{ckpt_dir}: checkpoint metadata lacks 'model_config'; was it written by "
                              f"glm5_jax.convert?")
    return metadata


def leaf_metadata(item_dir: str, collections=None) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    """(collection, *path) -> (shape, dtype) of every leaf stored in an orbax PyTree item directory
    (`state_dir` of a converter output; `glm5_jax.checkpoint.inference.find_checkpoint` finds it for
    every kind of checkpoint), only under the top-level `collections` when given."""
    tree = ocp.PyTreeCheckpointer().metadata(item_dir).item_metadata.tree
    if collections is not None:
        tree = {c: tree[c] for c in collections if c in tree}
    return {tuple(k.key for k in path): (tuple(m.shape), np.dtype(m.dtype))
            for path, m in jax.tree_util.tree_leaves_with_path(tree)}


def restore_leaf(item_dir: str, collection: str, path: tuple[str, ...], shape, dtype) -> np.ndarray:
    """One stored leaf as a host numpy array (orbax reads only that leaf)."""
    return restore_leaves(item_dir, [((collection,) + tuple(path), shape, dtype)])[0]


def restore_leaves(item_dir: str, leaves) -> list[np.ndarray]:
    """Several stored leaves, ``[((collection, *path), shape, dtype), ...]``, as host numpy arrays in
    that order, with one partial restore (orbax reads only those leaves). Each restore call costs
    ~20 ms of metadata and handler setup, so restoring small leaves together is several times faster."""
    abstract, restore_args = {}, {}
    for key, shape, dtype in leaves:
        _merge(abstract, _nest(key[0], key[1:], jax.ShapeDtypeStruct(shape, dtype)))
        _merge(restore_args, _nest(key[0], key[1:], ocp.RestoreArgs(restore_type=np.ndarray)))
    tree = ocp.PyTreeCheckpointer().restore(
        item_dir, args=ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=True))
    out = []
    for key, _, _ in leaves:
        node = tree
        for p in key:
            node = node[p]
        out.append(node)
    return out
