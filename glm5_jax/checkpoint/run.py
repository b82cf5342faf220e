"""Orbax checkpoints of a training run: state, data-iterator position and config, saved together.

Layout: ``<workdir>/checkpoints/<step>/{state, data, meta}``; orbax writes each step to a temporary
directory and commits it atomically (on object storage: writes the step in place and its commit_success.txt
last, and readers take only committed steps), so a kill at any moment leaves only whole steps. Restoring takes
an abstract state whose leaves carry the *target* shardings, so a run resumes onto any mesh.
"""
from __future__ import annotations

import dataclasses

import grain
import orbax.checkpoint as ocp

from glm5_jax import storage

ITEMS = ("state", "data", "meta")


class RunCheckpoints:
    def __init__(self, workdir: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = storage.absolute(storage.join(workdir, "checkpoints"))   # orbax needs absolute paths
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=ITEMS,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iterator, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator),
            meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state, data_iterator):
        """(state placed per abstract_state's shardings, meta); the iterator is moved to the saved position."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iterator),
            meta=ocp.args.JsonRestore()))
        return restored["state"], restored["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def config_as_json(cfg) -> dict:
    def convert(x):
        if dataclasses.is_dataclass(x):
            return {f.name: convert(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (tuple, list)):
            return [convert(v) for v in x]
        return x
    return convert(cfg)
