"""Keep JAX off the TPU runtime on a host that has no TPU.

With libtpu installed (``requirements-tpu.txt``, which the tests use to compile the Pallas kernels), JAX's
default platform search starts the TPU runtime even on a machine without a TPU, and libtpu prints half a
dozen lines ("Failed to find host bounds ...", "E0000 ... unexpected worker hostname ...") that read as
failures although the run goes on on the CPU. Every command of the project (``train.py`` and each
``python -m glm5_jax...`` entry point) calls `skip_absent_tpu` first thing: when the user has not chosen
the platforms (``JAX_PLATFORMS`` or ``jax.config.update("jax_platforms", ...)``) and no TPU is attached,
JAX gets the platforms the host can run (a GPU whose plugin is installed and whose devices are visible,
then the CPU). On a TPU host nothing changes. An ahead-of-time compile for a TPU topology
(``train.py --compile_only --topology=...``) still goes through libtpu: it needs no TPU backend.

A TPU is reached through device files: ``/dev/accel<n>`` (v2-v4) or ``/dev/vfio/<n>`` (v5e, v5p, v6e and
later); libtpu cannot use a chip without them, in a VM or a container alike. ``JAX_FORCE_TPU_INIT`` (JAX's
own switch to start the TPU runtime regardless) counts as a TPU.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import pkgutil

TPU_DEVICE_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
# JAX's GPU platforms: the plugin's module/entry-point name contains the key; the device files that show one.
GPU_PLATFORMS = {"cuda": ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"), "rocm": ("/dev/kfd", "/dev/dxg")}


def tpu_attached() -> bool:
    return "JAX_FORCE_TPU_INIT" in os.environ or any(glob.glob(p) for p in TPU_DEVICE_FILES)


def _installed_jax_plugins() -> list[str]:
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    if importlib.util.find_spec("jax_plugins") is not None:      # namespace package jax_plugins.xla_cuda12, ...
        import jax_plugins

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    return names


def usable_gpu_platforms() -> tuple[str, ...]:
    """The GPU platforms with an installed JAX plugin and a visible device, e.g. ("cuda",)."""
    plugins = _installed_jax_plugins()
    return tuple(platform for platform, devices in GPU_PLATFORMS.items()
                 if any(platform in name for name in plugins) and any(map(os.path.exists, devices)))


def platforms_for_host(user_choice: str | None, tpu: bool, gpu_platforms: tuple[str, ...]) -> str | None:
    """The ``jax_platforms`` value to set, or None to leave JAX's own search (the user chose, or a TPU is
    attached). `user_choice`: ``JAX_PLATFORMS`` or the ``jax_platforms`` option, None where neither is set
    (an empty string is a choice too: JAX's automatic search)."""
    if user_choice is not None or tpu:
        return None
    return ",".join((*gpu_platforms, "cpu"))


def skip_absent_tpu() -> str | None:
    """Restrict JAX to the host's non-TPU platforms when no TPU is attached and the user chose none; returns
    the value set, or None. Call before the first JAX computation (it starts no backend); the choice is also
    put in ``JAX_PLATFORMS`` for the processes this one starts."""
    import jax

    user_choice = os.environ.get("JAX_PLATFORMS", jax.config.jax_platforms)
    platforms = platforms_for_host(user_choice, tpu_attached(), usable_gpu_platforms() if user_choice is None else ())
    if platforms is not None:
        jax.config.update("jax_platforms", platforms)
        os.environ["JAX_PLATFORMS"] = platforms
    return platforms


def simulate_host_devices(count: int | None) -> None:
    """Give the CPU platform `count` devices (XLA's ``--xla_force_host_platform_device_count``), e.g. to run a
    mesh on one host; call before JAX starts a backend. None or 0: leave the flags as they are."""
    if count:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={count}")
