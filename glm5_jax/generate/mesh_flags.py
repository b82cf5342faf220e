"""The sampling-mesh flags every sampling command takes (``python -m glm5_jax.generate``, ``glm5_jax.serve``).

    --mesh=data:2,expert:2,tensor:2   the sampling mesh (glm5_jax.parallel.sampling; default: one device)
    --host_devices=8                  simulate 8 CPU devices (set before JAX starts)
"""
from __future__ import annotations

from absl import flags


def define_mesh_flags():
    flags.DEFINE_string("mesh", "", "Sampling mesh AXIS:SIZE,... over data, fsdp, context, expert, tensor (e.g. "
                        "data:2,expert:2,tensor:2; default: one device). Weights stay resident: experts over "
                        "expert, heads / widths / vocabulary over tensor, batch rows over data and expert, cache "
                        "slots over context.")
    flags.DEFINE_integer("host_devices", None, "Simulate this many CPU devices (sets XLA_FLAGS before JAX starts).")
