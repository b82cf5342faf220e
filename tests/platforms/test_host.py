"""On a host without a TPU the project's commands keep JAX off the TPU runtime, whose libtpu prints
failure-looking lines when it finds no chip; a user's JAX_PLATFORMS and a TPU host are left alone."""
import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from glm5_jax.convert.synthetic import write_random_hub_checkpoint
from glm5_jax.platforms import host, platforms_for_host

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TPU_RUNTIME_LINES = re.compile(r"host bounds|worker hostname|E0000|TPU")


def test_no_tpu_means_the_host_platforms():
    assert platforms_for_host(None, tpu=False, gpu_platforms=()) == "cpu"
    assert platforms_for_host(None, tpu=False, gpu_platforms=("cuda",)) == "cuda,cpu"


def test_a_tpu_or_the_users_choice_is_left_alone():
    assert platforms_for_host(None, tpu=True, gpu_platforms=()) is None
    assert platforms_for_host("tpu,cpu", tpu=False, gpu_platforms=()) is None
    assert platforms_for_host("", tpu=False, gpu_platforms=()) is None     # JAX_PLATFORMS='': JAX's own search


def test_tpu_device_files_and_jax_force_tpu_init_count_as_a_tpu(monkeypatch):
    present = {"/dev/vfio/vfio", "/dev/nvidia0"}   # the VFIO control file alone is no TPU
    monkeypatch.setattr(host.glob, "glob", lambda pattern: fnmatch.filter(present, pattern))
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    assert not host.tpu_attached()
    present.add("/dev/vfio/0")           # v5e / v5p / v6e
    assert host.tpu_attached()
    present.clear()
    present.add("/dev/accel0")           # v2-v4
    assert host.tpu_attached()
    present.clear()
    monkeypatch.setenv("JAX_FORCE_TPU_INIT", "1")
    assert host.tpu_attached()


@pytest.mark.skipif(host.tpu_attached(), reason="a TPU host starts the TPU runtime on purpose")
def test_a_cli_prints_no_tpu_runtime_lines_without_jax_platforms(tmp_path):
    """hf-to-orbax starts a JAX backend; with libtpu installed and JAX_PLATFORMS unset, JAX's default search
    would start the TPU runtime and print its lines."""
    hf_config = json.load(open(os.path.join(REPO, "tests", "convert", "tiny_glm5_config.json")))
    write_random_hub_checkpoint(str(tmp_path / "hf"), hf_config, dtype=np.dtype("float32"))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = REPO

    def convert(out, extra_env=()):
        return subprocess.run([sys.executable, "-m", "glm5_jax.convert", "hf-to-orbax", f"--hf_dir={tmp_path / 'hf'}",
                               f"--out_dir={tmp_path / out}"], env={**env, **dict(extra_env)}, capture_output=True,
                              text=True, timeout=120)

    r = convert("orbax")
    assert r.returncode == 0, r.stderr
    assert "hf-to-orbax:" in r.stderr
    assert TPU_RUNTIME_LINES.findall(r.stdout + r.stderr) == []
    if importlib.util.find_spec("libtpu") is not None:    # the check can fail: JAX's own search prints them
        r = convert("orbax_auto", {"JAX_PLATFORMS": ""})
        assert r.returncode == 0, r.stderr
        assert TPU_RUNTIME_LINES.findall(r.stderr)
