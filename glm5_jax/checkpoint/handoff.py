"""Policy handoff through an orbax CheckpointManager.

Background: docs/training.md#policy-handoff-through-orbax, docs/architecture.md#mtp, #mtp.

One orbax step per policy version ``v`` under ``<workdir>/policy/<v>/`` holds what sampling needs and
nothing else (docs/rl.md#weights-only-policy-handoff): ``params`` (the model variables {"params", "moe_bias"}
in the sampler's dtype, the routed experts optionally INT4-packed: `sampler_variables`) and ``meta`` (JSON:
version, watermark, ledger, counters, the model config, the ``handoff`` format). The learner writes it sharded
from its own mesh (`PolicyWriter`); generators and evaluators only read (`PolicyReader`), each onto its own
mesh: orbax reads every target shard from the saved ones, whatever the two meshes' shapes and device counts.

The learner's resume state (fp32 variables, optimizer state, meta) is not part of a version: it is saved in
its own manager under ``<workdir>/learner/`` (`LearnerCheckpoints`), every ``k``-th version.

Guards, each a pitfall measured in docs/training.md#policy-handoff-through-orbax:
* absolute paths only (a relative one made the background commit fail with only a log line);
* a version counts only once its step directory holds orbax's ``commit_success.txt``
(docs/training.md#committed-versions-only) — partial
  saves (``<v>.orbax-checkpoint-tmp-*``) and any step without the marker are never read;
* every read is retried: ``max_to_keep`` deletion races with ``restore()``;
* after each save the previous version must be on disk and committed
(docs/training.md#background-save-errors-surface), and background errors are
  surfaced with ``check_for_errors()``.
"""
from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from glm5_jax import storage
from glm5_jax.model.moe.int4_weights import EXPERT_WEIGHTS, quantize_params

ITEMS = ("params", "meta")
LEARNER_ITEMS = ("variables", "opt_state", "meta")
COMMIT_MARKER = "commit_success.txt"
log = logging.getLogger("glm5_jax.rl")


class HandoffError(RuntimeError):
    """The policy directory is not in the state the protocol requires."""


def policy_dir(workdir: str) -> str:
    return storage.join(storage.absolute(workdir), "policy")


def learner_dir(workdir: str) -> str:
    return storage.join(storage.absolute(workdir), "learner")


def sampler_variables(variables, dtype, int4_cfg=None):
    """The variables a version carries: every floating ``params`` leaf cast to `dtype`; with `int4_cfg` (a
    ModelConfig whose quant_group_size / quant_scale_dtype apply) the routed experts are first packed from
    the learner's own weights by `int4_weights.quantize_params` (the rounding QAT trains against), so the
    tree is the ``quant="int4"`` model's. ``moe_bias`` keeps its dtype: it only selects experts (top-k),
    and a rounded bias could select other experts than the learner's."""
    params = quantize_params(variables["params"], int4_cfg) if int4_cfg is not None else variables["params"]
    cast = jax.jit(lambda x: x.astype(dtype))
    params = jax.tree.map_with_path(lambda path, x: cast(x) if _in_sampler_dtype(path, x, dtype) else x, params)
    return {**variables, "params": params}


def sampler_abstract_variables(abstract_variables, dtype):
    """`abstract_variables` (a generator's, with its own shardings) with the leaves `sampler_variables`
    casts in `dtype`: the restore target that reads a version without a cast."""
    def retype(path, a):
        return jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding) if _in_sampler_dtype(path, a, dtype) else a
    return {**abstract_variables, "params": jax.tree.map_with_path(retype, abstract_variables["params"])}


INT4_SCALES = tuple(f"{name}_scale" for name in EXPERT_WEIGHTS)


def _in_sampler_dtype(path, leaf, dtype) -> bool:
    """A floating weight other than an INT4 scale (those keep ModelConfig.quant_scale_dtype)."""
    is_scale = getattr(path[-1], "key", None) in INT4_SCALES
    return jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != dtype and not is_scale


def is_committed(directory: str, version: int) -> bool:
    return storage.isfile(storage.join(directory, str(version), COMMIT_MARKER))


def committed_versions(directory: str) -> list[int]:
    """Versions whose step directory is final (plain integer name) and carries the commit marker."""
    try:
        names = storage.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and is_committed(directory, int(n)))


def retry(fn, what: str, attempts: int = 50, delay: float = 0.05):
    """fn() retried on the errors a concurrent writer's deletion/finalisation causes."""
    for i in range(attempts):
        try:
            return fn()
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:   # orbax wraps some as ValueError
            if i == attempts - 1:
                raise HandoffError(f"{what} failed {attempts} times; last error: {e!r}") from e
            time.sleep(delay)


class _AsyncSteps:
    """An async orbax CheckpointManager whose every save checks that the previous one committed."""

    def __init__(self, directory: str, items, max_to_keep: int):
        self.directory = directory
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=items,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True,
                                                 create=True, cleanup_tmp_directories=True))
        self._last_saved = None

    def latest_version(self) -> int | None:
        versions = committed_versions(self.directory)
        return versions[-1] if versions else None

    def _save(self, version: int, **items) -> None:
        """Starts the save of `version`. orbax first waits for the previous save to finish, so on return
        the previous version is durable; that is checked here (docs/training.md#background-save-errors-surface)."""
        self.manager.save(version, args=ocp.args.Composite(**items))
        self.manager.check_for_errors()
        if self._last_saved is not None and not is_committed(self.directory, self._last_saved):
            raise HandoffError(f"version {self._last_saved} was saved but is not committed in {self.directory}")
        self._last_saved = version

    def wait(self) -> None:
        """Blocks until every started save is committed, and checks it is."""
        self.manager.wait_until_finished()
        self.manager.check_for_errors()
        if self._last_saved is not None and not is_committed(self.directory, self._last_saved):
            raise HandoffError(f"version {self._last_saved} did not commit in {self.directory}")

    def close(self) -> None:
        self.manager.close()


class PolicyWriter(_AsyncSteps):
    """The learner's side: publish(v, variables, meta) saves one version (sampler form) asynchronously."""

    def __init__(self, workdir: str, max_to_keep: int):
        super().__init__(policy_dir(workdir), ITEMS, max_to_keep)

    def publish(self, version: int, variables, meta: dict) -> None:
        """`variables` as `sampler_variables` made them; `meta` should name their form under ``handoff``."""
        self._save(version, params=ocp.args.StandardSave(variables), meta=ocp.args.JsonSave(meta))


class LearnerCheckpoints(_AsyncSteps):
    """The learner's resume state (its variables, optimizer state and meta), in its own manager: versions
    are read by every generator and carry weights only; this is read by the learner alone, on restart."""

    def __init__(self, workdir: str, max_to_keep: int = 2):
        super().__init__(learner_dir(workdir), LEARNER_ITEMS, max_to_keep)

    def save(self, version: int, variables, opt_state, meta: dict) -> None:
        self._save(version, variables=ocp.args.StandardSave(variables), opt_state=ocp.args.StandardSave(opt_state),
                   meta=ocp.args.JsonSave(meta))

    def restore(self, version: int, abstract_variables, abstract_opt_state):
        out = self.manager.restore(version, args=ocp.args.Composite(
            variables=ocp.args.StandardRestore(abstract_variables),
            opt_state=ocp.args.StandardRestore(abstract_opt_state), meta=ocp.args.JsonRestore()))
        self._last_saved = version
        return out["variables"], out["opt_state"], out["meta"]


class PolicyReader:
    """A generator's (read-only) side. Every call retries across the writer's concurrent deletions.

    A version is read straight from its committed step directory, not through a CheckpointManager:
    the manager's reload() reads the metadata of every step listed, and a step the writer is
    finalising or deleting at that moment has none (orbax logs "Metadata file does not exist")."""

    def __init__(self, workdir: str):
        self.directory = policy_dir(workdir)
        self._checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())

    def latest_version(self) -> int | None:
        versions = committed_versions(self.directory)
        return versions[-1] if versions else None

    def has_version(self, version: int) -> bool:
        return is_committed(self.directory, version)

    def read_meta(self, version: int) -> dict:
        return retry(lambda: self._restore(version, meta=ocp.args.JsonRestore())["meta"], f"meta of version {version}")

    def restore_variables(self, version: int, abstract_variables):
        """The model variables of `version`, placed per `abstract_variables`' shardings (this process's mesh:
        any shape and device count) and cast to their dtypes (`sampler_abstract_variables`: none)."""
        return retry(lambda: self._restore(version, params=ocp.args.StandardRestore(abstract_variables))["params"],
                     f"params of version {version}")

    def _restore(self, version: int, **items):
        if not is_committed(self.directory, version):
            raise FileNotFoundError(f"version {version} is not committed in {self.directory}")
        return self._checkpointer.restore(storage.join(self.directory, str(version)), args=ocp.args.Composite(**items))
