"""The storage helpers on a local path and on gs:// (a GCS emulator): atomic writes, the commit-file-last
directory publish, the parts log, and what a killed writer leaves."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from glm5_jax import storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["local", "gs"])
def base(request, tmp_path):
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("gcs_dir")


def test_write_read_list_move(base):
    a, b = storage.join(base, "d", "a.bin"), storage.join(base, "d", "b.bin")
    storage.makedirs(storage.join(base, "d"))
    storage.write_atomically(a, b"x" * 1000)
    assert storage.read_bytes(a) == b"x" * 1000 and storage.getsize(a) == 1000
    assert storage.isfile(a) and storage.isdir(storage.join(base, "d")) and not storage.exists(b)
    storage.move(a, b)
    assert storage.listdir(storage.join(base, "d")) == ["b.bin"] and storage.read_bytes(b) == b"x" * 1000
    with pytest.raises(RuntimeError):
        with storage.open_for_write(storage.join(base, "d", "c.bin")) as f:
            f.write(b"partial")
            raise RuntimeError("writer dies")
    assert storage.listdir(storage.join(base, "d")) == ["b.bin"]           # nothing of the failed write
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(base, "nothing"))


def test_publish_dir_commit_file_last(base, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name, data in {"a": b"1", "sub/b": b"22", "config.json": b"{}"}.items():
        (src / name).write_bytes(data)
    out = storage.join(base, "out")
    storage.write_atomically(storage.join(out, "stale"), b"old")
    storage.publish_dir(str(src), out, "config.json")
    got = {os.path.relpath(os.path.join(d, n), out) if not storage.is_remote(out) else
           storage.join(d, n)[len(out) + 1:]: storage.read_bytes(storage.join(d, n))
           for d, _, names in storage.walk(out) for n in names}
    assert got == {"a": b"1", "sub/b": b"22", "config.json": b"{}"}


def test_jsonl_log_parts_and_truncation(base):
    p = storage.join(base, "metrics.jsonl")
    log = storage.JsonlLog(p, lines_per_part=3)
    for step in range(1, 8):
        log.append({"step": step})
    assert [r["step"] for r in storage.read_jsonl(p)] == list(range(1, 8))
    log = storage.JsonlLog(p, keep=lambda r: r["step"] <= 4, lines_per_part=3)   # a resume at step 4
    log.append({"step": 5})
    assert [r["step"] for r in storage.read_jsonl(p)] == [1, 2, 3, 4, 5]
    if storage.is_remote(p):
        assert len(storage.listdir(p + ".parts")) == 2


def test_killed_writer_leaves_no_object(gcs_dir):
    """A process SIGKILLed in the middle of a large upload leaves no object under its name."""
    target = storage.join(gcs_dir, "big.bin")
    code = ("import sys, time\nfrom glm5_jax import storage\n"
            "with storage.open_for_write(sys.argv[1]) as f:\n"
            "    for _ in range(64):\n        f.write(b'x' * 2**20); f.flush()\n"
            "    print('written', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, target], env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"        # 64 MiB sent in resumable-upload chunks
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.2)
    assert not storage.exists(target)
    assert json.loads(json.dumps(storage.listdir(gcs_dir) if storage.isdir(gcs_dir) else [])) == []


def test_publish_killed_half_way_leaves_no_complete_output(gcs_dir, tmp_path, monkeypatch):
    """A publisher that dies after some objects were copied leaves an output without its commit file,
    which the HF config reader refuses; the old output's commit file went first."""
    from glm5_jax.hf.config import read_config_json
    from glm5_jax.model.config import ConfigError
    from glm5_jax.storage import atomic

    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.safetensors", "b.safetensors", "config.json"):
        (src / name).write_bytes(b"{}")
    out = storage.join(gcs_dir, "out")
    storage.write_atomically(storage.join(out, "config.json"), b"{}")      # a complete old output
    copied, real_copy = [], atomic.copy

    def dying_copy(a, b):
        if len(copied) == 1:
            raise KeyboardInterrupt("killed")
        copied.append(b)
        real_copy(a, b)

    monkeypatch.setattr(atomic, "copy", dying_copy)
    with pytest.raises(KeyboardInterrupt):
        storage.publish_dir(str(src), out, "config.json")
    assert storage.listdir(out) == ["a.safetensors"]
    with pytest.raises(ConfigError, match="missing config.json"):
        read_config_json(out)
