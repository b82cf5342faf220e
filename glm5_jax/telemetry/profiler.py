"""jax.profiler traces of chosen steps, written where TensorBoard's profile plugin and XProf read them.

`StepProfiler(log_dir, start, num_steps)` traces steps ``start .. start + num_steps - 1`` (0-based indices
of the steps a loop runs, counted across resumes); each traced step is wrapped in a
`jax.profiler.StepTraceAnnotation`, so XProf's step views split the timeline per step. The trace lands in
``<log_dir>/plugins/profile/<timestamp>/`` (``*.xplane.pb``, and ``*.trace.json.gz`` for Perfetto): with
log_dir = a train.py workdir's ``tb/``, ``tensorboard --logdir=<workdir>/tb`` (or ``xprof --logdir=...``)
shows it beside the scalars. The training loop, the RL learner and the serving engine each trace their own
steps with it. The HLO ops on the timeline carry the model's `jax.named_scope` paths
(``attention_core``, ``indexer_kl``, ``lightning_indexer``, ``moe/...``), the names
glm5_jax.cost.categories files the compile report's categories by.

With ``num_steps == 0`` nothing is traced and no profiler function is called.

``before_stop``: called before the trace stops (the training loop waits there for an async checkpoint save in
flight: `jax.profiler.stop_trace` collecting events while orbax's writer threads run has crashed the process
with a segmentation fault on CPU).
"""
from __future__ import annotations

import contextlib
import logging

import jax

log = logging.getLogger("glm5_jax.telemetry")


class StepProfiler:
    def __init__(self, log_dir: str, start: int = 0, num_steps: int = 0, name: str = "train", before_stop=None):
        if start < 0 or num_steps < 0:
            raise ValueError(f"profile start={start}, steps={num_steps}: must be >= 0")
        self.log_dir, self.start, self.end, self.name = log_dir, start, start + num_steps, name
        self.before_stop = before_stop
        self.active = False

    @property
    def enabled(self) -> bool:
        return self.end > self.start

    def step(self, index: int):
        """A context manager around step `index`: starts the trace before the first traced step, and
        annotates traced steps. Call `after_step` with the step's outputs once it was dispatched."""
        if not self.enabled or not self.start <= index < self.end:
            return contextlib.nullcontext()
        if not self.active:
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d..%d into %s", index, self.end - 1, self.log_dir)
        return jax.profiler.StepTraceAnnotation(self.name, step_num=index)

    def after_step(self, index: int, outputs=None) -> None:
        """Stop the trace after its last step, once `outputs` (that step's results) are computed."""
        if self.active and index + 1 >= self.end:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            if self.before_stop is not None:
                self.before_stop()
            jax.profiler.stop_trace()
            self.active = False
            log.info("profile written under %s/plugins/profile", self.log_dir)
