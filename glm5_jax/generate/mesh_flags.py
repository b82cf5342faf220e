"""The sampling-mesh flags every sampling command takes (``python -m glm5_jax.generate``, ``glm5_jax.serve``).

    --mesh=data:2,expert:2,tensor:2   the sampling mesh (glm5_jax.parallel.sampling; default: one device)
    --host_devices=8                  simulate 8 CPU devices (set before JAX starts)
    --sampler_kernels=pallas          decode steps through the decode program's kernels (glm5_jax/generate/settings.py)
    --sampler_dispatch=a2a_decode     their MoE dispatch (default gather: a few tokens a chip)
    --sampler_capacity=2.0            its capacity factor (default 0: nothing dropped)
"""
from __future__ import annotations

from absl import flags

FLAGS = flags.FLAGS


def define_mesh_flags():
    flags.DEFINE_string("mesh", "", "Sampling mesh AXIS:SIZE,... over data, fsdp, context, expert, tensor (e.g. "
                        "data:2,expert:2,tensor:2; default: one device). Weights stay resident: experts over "
                        "expert, heads / widths / vocabulary over tensor, batch rows over data and expert, cache "
                        "slots over context.")
    flags.DEFINE_integer("host_devices", None, "Simulate this many CPU devices (sets XLA_FLAGS before JAX starts).")

    flags.DEFINE_enum("sampler_kernels", "xla", ["xla", "pallas", "pallas_interpret"],
                      "Decode steps: 'xla' (XLA's forms) or the decode program's Pallas kernels ('pallas' on TPU, "
                      "'pallas_interpret' to run them on CPU; RuntimeConfig.sampler_kernels).")
    flags.DEFINE_enum("sampler_dispatch", "gather", ["gather", "a2a_decode"],
                      "With --sampler_kernels: the decode MoE dispatch ('gather': a few tokens a chip; 'a2a_decode': "
                      "many, the ragged all-to-all).")
    flags.DEFINE_float("sampler_capacity", 0.0, "With --sampler_kernels: the dispatch's capacity factor (0: no "
                       "assignment dropped; e.g. 2.0: each chip takes 2x its expected share, smaller exchanges).")


def with_sampler_flags(cfg):
    """``cfg`` with the --sampler_kernels / --sampler_dispatch / --sampler_capacity settings."""
    return cfg.replace(sampler_kernels=FLAGS.sampler_kernels, sampler_dispatch=FLAGS.sampler_dispatch,
                       sampler_capacity=FLAGS.sampler_capacity)
