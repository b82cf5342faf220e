"""Which JAX platforms a command starts: on a host without a TPU, not the TPU runtime (`host.py`)."""
from glm5_jax.platforms.host import platforms_for_host, simulate_host_devices, skip_absent_tpu

__all__ = ["platforms_for_host", "simulate_host_devices", "skip_absent_tpu"]
