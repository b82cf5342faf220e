"""A training run's scalar metrics: ``metrics.jsonl`` and TensorBoard event files beside it."""
from __future__ import annotations

from glm5_jax import storage


class MetricsWriter:
    """metrics.jsonl (one object per logged step; resumed runs drop entries past the restored step; on
    object storage kept as parts, see storage.JsonlLog) and TensorBoard event files under <workdir>/tb."""

    def __init__(self, workdir: str, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = storage.join(workdir, "metrics.jsonl")
        if not enabled:
            return
        # a killed run may have logged steps past its last checkpoint
        self.log = storage.JsonlLog(self.path, keep=lambda record: record.get("step", 0) <= resume_step)
        from tensorboardX import SummaryWriter
        self.tb = SummaryWriter(storage.join(workdir, "tb"))

    def write(self, record: dict):
        if not self.enabled:
            return
        self.log.append(record)
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, record["step"])
        self.tb.flush()

    def close(self):
        if self.enabled:
            self.tb.close()
