"""Test-wide setup: 8 fake CPU devices so sharded code runs on any machine.

Test programs are tiny and compiled once each, so compile time dominates: LLVM optimisation is turned
off for them (about 2x faster compiles; results are unaffected, kernels and models still run as built).
"""
import os
import uuid

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# AOT compiles for TPU topologies load libtpu; without this a second process using libtpu at the same
# time (another test run, a compile_only job) makes it abort on /tmp/libtpu_lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def gcs_emulator():
    """A GCS API on 127.0.0.1 for this session; this process and its children talk to it."""
    from tests.gcs_emulator import Emulator, client_env

    emulator = Emulator()
    saved = {k: os.environ.get(k) for k in client_env(emulator.url)}
    os.environ.update(client_env(emulator.url))
    yield emulator
    emulator.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def gcs_dir(gcs_emulator, request):
    """A fresh gs:// directory (an unused prefix of the emulator's bucket) for one test."""
    from tests.gcs_emulator import BUCKET

    return f"gs://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}-{uuid.uuid4().hex[:8]}"
