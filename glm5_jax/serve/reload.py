"""Hot reload: poll for a newer committed step and hand its weights to the engine.

Two sources: a checkpoint directory as `load_for_inference` reads it (train.py workdir, its checkpoints/,
a converter output), or an RL run's policy versions (`glm5_jax.checkpoint.handoff`: only versions carrying the
commit marker count). A step is loaded on the watcher's thread, so serving continues meanwhile; the
engine swaps the weights in between two decode steps. A checkpoint step whose model config differs from
the served one is refused (logged and counted) rather than loaded.
"""
from __future__ import annotations

import logging
import threading

import jax

from glm5_jax.checkpoint.handoff import PolicyReader
from glm5_jax.checkpoint.inference import latest_step, load_for_inference

log = logging.getLogger("glm5_jax.serve")


class CheckpointSource:
    def __init__(self, path: str):
        self.path = path

    def latest(self) -> int | None:
        return latest_step(self.path)

    def load(self, step: int):
        """(model config, variables) of `step`."""
        cfg, variables, _ = load_for_inference(self.path, step)
        return cfg, variables


class PolicySource:
    """An RL workdir's policy versions; variables are restored with the served ones' shapes and shardings."""

    def __init__(self, workdir: str, served_variables):
        self.reader = PolicyReader(workdir)
        self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                     served_variables)

    def latest(self) -> int | None:
        return self.reader.latest_version()

    def load(self, step: int):
        return None, self.reader.restore_variables(step, self.abstract)


class WeightsWatcher:
    def __init__(self, engine, source, model_config, step: int, interval_s: float = 5.0):
        self.engine, self.source, self.model_config = engine, source, model_config
        self.step, self.interval_s = step, interval_s
        self.reloads = self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-reload", daemon=True)

    def start(self) -> "WeightsWatcher":
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def poll(self) -> bool:
        """Load the newest step if it is newer than the served one; True when new weights were handed over."""
        newest = self.source.latest()
        if newest is None or newest <= self.step:
            return False
        cfg, variables = self.source.load(newest)
        self.step = newest
        if cfg is not None and cfg != self.model_config:
            self.refused += 1
            log.error("step %d has a different model config; keeping the served weights", newest)
            return False
        self.engine.set_variables(variables, newest)
        self.reloads += 1
        log.info("serving weights of step %d", newest)
        return True

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as e:     # a step deleted or half-visible while listing: try again next time
                log.warning("weights reload failed: %r", e)

    def metrics(self) -> dict:
        return {"weights_reloads": self.reloads, "weights_refused": self.refused}
