"""train.py end to end: typed --set overrides, and resume after SIGKILL with identical losses."""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from glm5_jax import storage
from glm5_jax.checkpoint.inference import checkpoint_tokenizer, latest_step
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.train.experiment import apply_overrides, load_config_file
from tests.telemetry.test_profiler import traced_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "train", "small_run_config.py")


def test_set_overrides_are_typed():
    cfg = load_config_file(CONFIG)
    cfg = apply_overrides(cfg, ["train.steps=5", "train.learning_rate=1", "mesh.fsdp=-1", "train.stage=warmup",
                                "data.source=('stdlib', '/tmp/x.jsonl')", "model.indexer_types=['full', 'shared']",
                                "data.tokenizer_path=None"])
    assert cfg.train.steps == 5 and cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.stage == "warmup" and cfg.mesh.fsdp == -1
    assert cfg.data.source == ("stdlib", "/tmp/x.jsonl") and cfg.model.indexer_types == ("full", "shared")


@pytest.mark.parametrize("order", [0, 1])
def test_overrides_are_validated_together_in_any_order(order):
    """The tiny config's 128-wide experts do not pack INT4 with the default group of 32 (8 groups per
    chunk): quant=int4_qat alone fails, with quant_group_size=16 it holds, whichever comes first."""
    tiny = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    pair = ["model.quant=int4_qat", "model.quant_group_size=16"]
    cfg = apply_overrides(tiny, pair if order == 0 else pair[::-1])
    assert (cfg.model.quant, cfg.model.quant_group_size) == ("int4_qat", 16)
    cfg.validate()
    with pytest.raises(ValueError, match="quant_group_size=32 per chunk: must be a multiple of 256"):
        apply_overrides(tiny, pair[:1])
    assert apply_overrides(tiny, ["train.steps=3", "train.steps=4"]).train.steps == 4     # the last one wins


@pytest.mark.parametrize("override,message", [
    ("train.stpes=5", r"unknown key 'stpes'; valid keys: .*train\.steps"),  # noqa: typo on purpose
    ("nope=1", r"unknown key 'nope'; valid keys: model\.vocab_size"),
    ("train.steps=many", "expected <class 'int'>, got 'many'"),
    ("train.steps=1.5", "expected <class 'int'>, got 1.5"),
    ("train=3", r"'train' is a group; set one of its keys: train\.steps"),
    ("train.steps", "expected key=value"),
    ("train.steps.x=1", "'steps' has no sub-keys"),
])
def test_set_errors_name_the_problem(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(load_config_file(CONFIG), [override])


def _start(workdir, env, *flags):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), f"--config={CONFIG}",
                             f"--workdir={workdir}", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _losses(workdir):
    return {r["step"]: (r["loss"], r["lm_loss"], r.get("eval_loss"))
            for r in storage.read_jsonl(storage.join(workdir, "metrics.jsonl"))}


def _wait_for(predicate, proc, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise TimeoutError


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_cache")
    return dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", JAX_COMPILATION_CACHE_DIR=str(cache),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, run_env):
    """The losses of one uninterrupted local run, which also takes a profiler trace of steps 2 and 3 (it
    changes no number)."""
    reference = tmp_path_factory.mktemp("reference")
    proc = _start(reference, run_env, "--set=train.profile_start=2", "--set=train.profile_steps=2")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    traces = glob.glob(str(reference / "tb" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and traced_steps(traces[0]) == [2, 3]
    return _losses(reference)


@pytest.mark.parametrize("where", ["local", "gs"])
def test_resume_after_sigkill_gives_identical_losses(tmp_path, request, where, run_env, reference_losses):
    """Killed twice and resumed; with the workdir on gs:// (checkpoints, metrics, tokenizer, TensorBoard
    events all in the bucket) as on a local disk."""
    killed = str(tmp_path / "killed") if where == "local" else request.getfixturevalue("gcs_dir")
    env = dict(run_env, **{k: os.environ[k] for k in os.environ if k not in run_env})   # the emulator's settings

    # kill right after the step-4 checkpoint commits ...
    proc = _start(killed, env)
    _wait_for(lambda: storage.isfile(storage.join(killed, "checkpoints", "4", "commit_success.txt")), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # ... and again in the middle of training, after step 6 was logged
    proc = _start(killed, env)
    _wait_for(lambda: 6 in _losses(killed), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = _start(killed, env)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "resumed from step" in out
    # the run ends saying where its checkpoint is and what to run next
    assert f"done: step 8 is checkpointed in {storage.join(killed, 'checkpoints', '8')}" in out
    assert f"python -m glm5_jax.generate --checkpoint={killed}" in out

    expected = reference_losses
    assert sorted(expected) == list(range(1, 9))
    assert _losses(killed) == expected            # bit-identical losses, every step logged exactly once
    assert not storage.exists(storage.join(killed, "tb", "plugins"))      # profiling off: no trace
    assert storage.isfile(storage.join(killed, "config.json"))
    assert storage.glob(storage.join(killed, "tb"), "events.out.tfevents.*")
    # what generate/serve --checkpoint read: the newest committed step and the run's cached tokenizer
    assert latest_step(killed) == 8
    assert load_tokenizer(checkpoint_tokenizer(killed)).vocab_size > 0
