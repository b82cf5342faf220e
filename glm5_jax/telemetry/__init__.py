"""What every long-running process (training, serving, RL) reports about itself: jax.profiler traces of
chosen steps (`profiler`) and a run's scalar metrics log (`metrics`). Imports nothing of the package but
`glm5_jax.storage`."""
from glm5_jax.telemetry.metrics import MetricsWriter
from glm5_jax.telemetry.profiler import StepProfiler

__all__ = ["MetricsWriter", "StepProfiler"]
