"""Policy handoff through an orbax CheckpointManager.

Background: docs/training.md#policy-handoff-through-orbax, docs/architecture.md#mtp, #mtp.

One orbax step per policy version ``v`` under ``<workdir>/policy/<v>/`` holds three items committed
together (docs/training.md#params-optimiser-and-meta-commit-together): ``params`` (the model variables {"params",
"moe_bias"}), ``opt_state`` and ``meta``
(JSON: version, watermark, consumed-batch ledger, drop counters, RNG). The learner writes
(`PolicyWriter`); generators and evaluators only read (`PolicyReader`).

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

import orbax.checkpoint as ocp

from glm5_jax import storage

ITEMS = ("params", "opt_state", "meta")
COMMIT_MARKER = "commit_success.txt"
log = logging.getLogger("glm5_jax.rl")


class HandoffError(RuntimeError):
    """The policy directory is not in the state the protocol requires."""


def policy_dir(workdir: str) -> str:
    return storage.join(storage.absolute(workdir), "policy")


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


class PolicyWriter:
    """The learner's side: publish(v, ...) saves one version asynchronously; restore() resumes."""

    def __init__(self, workdir: str, max_to_keep: int):
        self.directory = policy_dir(workdir)
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=ITEMS,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True,
                                                 create=True, cleanup_tmp_directories=True))
        self._last_saved = None

    def latest_version(self) -> int | None:
        versions = committed_versions(self.directory)
        return versions[-1] if versions else None

    def publish(self, version: int, variables, opt_state, meta: dict) -> None:
        """Starts the save of `version`. orbax first waits for the previous save to finish, so on return
        the previous version is durable; that is checked here (docs/training.md#background-save-errors-surface)."""
        self.manager.save(version, args=ocp.args.Composite(
            params=ocp.args.StandardSave(variables), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))
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

    def restore(self, version: int, abstract_variables, abstract_opt_state):
        out = self.manager.restore(version, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_variables),
            opt_state=ocp.args.StandardRestore(abstract_opt_state), meta=ocp.args.JsonRestore()))
        self._last_saved = version
        return out["params"], out["opt_state"], out["meta"]

    def close(self) -> None:
        self.manager.close()


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
        """The model variables of `version`, placed per `abstract_variables`' shardings (this process's mesh)."""
        return retry(lambda: self._restore(version, params=ocp.args.StandardRestore(abstract_variables))["params"],
                     f"params of version {version}")

    def _restore(self, version: int, **items):
        if not is_committed(self.directory, version):
            raise FileNotFoundError(f"version {version} is not committed in {self.directory}")
        return self._checkpointer.restore(storage.join(self.directory, str(version)), args=ocp.args.Composite(**items))
