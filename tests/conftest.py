"""Test-wide setup: 8 fake CPU devices so sharded code runs on any machine.

Test programs are tiny and compiled once each, so compile time dominates: LLVM optimisation is turned
off for them (about 2x faster compiles; results are unaffected, kernels and models still run as built).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# AOT compiles for TPU topologies load libtpu; without this a second process using libtpu at the same
# time (another test run, a compile_only job) makes it abort on /tmp/libtpu_lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (after the flags above)

jax.config.update("jax_default_matmul_precision", "highest")
