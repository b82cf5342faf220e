"""Hot reload: poll a checkpoint directory and hand a newer committed step's weights to the engine.

Only committed orbax steps are listed (in-progress saves are not), and a step is loaded on this thread,
so serving continues meanwhile; the engine swaps the weights in between two decode steps. A step whose
model config differs from the served one is refused (logged and counted) rather than loaded.
"""
from __future__ import annotations

import logging
import threading

from glm5_jax.inference_checkpoint import latest_step, load_for_inference

log = logging.getLogger("glm5_jax.serve")


class WeightsWatcher:
    def __init__(self, engine, checkpoint: str, model_config, step: int, interval_s: float = 5.0):
        self.engine, self.checkpoint, self.model_config = engine, checkpoint, model_config
        self.step, self.interval_s = step, interval_s
        self.reloads = self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-reload", daemon=True)

    def start(self) -> "WeightsWatcher":
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()

    def poll(self) -> bool:
        """Load the newest step if it is newer than the served one; True when new weights were handed over."""
        newest = latest_step(self.checkpoint)
        if newest <= self.step:
            return False
        cfg, variables, step = load_for_inference(self.checkpoint, newest)
        self.step = step
        if cfg != self.model_config:
            self.refused += 1
            log.error("step %d of %s has a different model config; keeping the served weights", step, self.checkpoint)
            return False
        self.engine.set_variables(variables, step)
        self.reloads += 1
        log.info("serving weights of step %d", step)
        return True

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as e:     # a step deleted or half-visible while listing: try again next time
                log.warning("weights reload from %s failed: %r", self.checkpoint, e)

    def metrics(self) -> dict:
        return {"weights_reloads": self.reloads, "weights_refused": self.refused}
