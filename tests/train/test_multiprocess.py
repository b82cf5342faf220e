"""Multi-host training on one machine: 2 processes x 4 CPU devices (jax.distributed, gloo) log the same
losses as 1 process x 8 devices, and save/restore orbax checkpoints from both processes."""
import json
import os
import socket
import subprocess
import sys

import pytest

from tests.train.test_train_cli import CONFIG, ROOT

# 8 rows over 8 batch shards; 2 loader shards make the global batches independent of the process count
SETTINGS = ["--set=data.batch_size=8", "--set=data.loader_shards=2", "--set=train.steps=4",
            "--set=train.checkpoint_every=2", "--set=train.eval_every=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path):
    return dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", JAX_PLATFORMS="cpu",
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _train(workdir, env, host_devices, extra=(), process=None):
    args = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={CONFIG}", f"--workdir={workdir}",
            f"--host_devices={host_devices}", *SETTINGS, *extra]
    if process is not None:
        port, pid, n = process
        args += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={n}", f"--process_id={pid}"]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_two_processes(workdir, env, extra=()):
    port = _free_port()
    procs = [_train(workdir, env, 4, extra, (port, pid, 2)) for pid in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: (r["loss"], r["lm_loss"], r.get("eval_loss")) for r in map(json.loads, f)}


@pytest.mark.slow   # minutes on 2 cores: run with `pytest -m slow` (kept out of CI's 20-minute budget)
def test_two_processes_match_one_process_and_resume(tmp_path):
    env = _env(tmp_path)
    single = _train(tmp_path / "single", env, 8)
    out, _ = single.communicate(timeout=240)
    assert single.returncode == 0, out

    multi = tmp_path / "multi"
    _run_two_processes(multi, env, ["--set=train.steps=2"])          # stop after the step-2 checkpoint
    assert sorted(os.listdir(multi / "checkpoints")) == ["2"]
    outs = _run_two_processes(multi, env)                            # both processes restore step 2
    assert all("resumed from step 2" in o for o in outs[:1])

    expected = _losses(tmp_path / "single")
    assert sorted(expected) == [1, 2, 3, 4]
    got = _losses(multi)
    assert sorted(got) == [1, 2, 3, 4]
    for step in expected:
        for a, b in zip(got[step], expected[step]):
            assert (a is None) == (b is None)
            if a is not None:
                assert abs(a - b) <= 1e-5 * abs(b), (step, got[step], expected[step])
