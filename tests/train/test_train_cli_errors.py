"""train.py on a user's own text and with a user's mistakes: one text file trains with eval off; a missing
config file, a bad --set, an impossible eval split and a workdir of another configuration are each one line
``error: ...`` (exit status 1), and a refused start writes nothing to the workdir."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from glm5_jax import storage
from glm5_jax.checkpoint.run import config_as_json
from glm5_jax.train.experiment import TrainConfig, apply_overrides, load_config_file
from glm5_jax.train.resume_check import IDENTITY_FIELDS, config_differences

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "train", "small_run_config.py")
NOTES = "".join(f"Note {i}. The quick brown fox jumps over the lazy dog {i % 13} times.\n\n" for i in range(300))


def _train(workdir, *flags, config=CONFIG, timeout=120):
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--config={config}",
                           f"--workdir={workdir}", *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _one_line_error(proc) -> str:
    """The error line of a refused run, checked to be a one-line report, not a traceback."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def own_text_run(tmp_path_factory):
    """Four steps on one small text file, named by a glob the project expands, with eval off: past the eval
    point at step 2 (and the last step)."""
    tmp = tmp_path_factory.mktemp("own_text")
    (tmp / "notes.txt").write_text(NOTES)
    workdir = tmp / "run"
    proc = _train(workdir, f"--set=data.source={tmp}/*.txt", "--set=data.eval_fraction=0", "--set=train.steps=4",
                  "--set=train.eval_every=2", "--set=train.checkpoint_every=4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir, proc.stdout + proc.stderr


def test_own_text_trains_with_eval_off(own_text_run):
    workdir, out = own_text_run
    records = storage.read_jsonl(str(workdir / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not any("eval_loss" in r for r in records)
    assert out.count("eval is off (data.eval_fraction=0): the metrics have no eval_loss") == 1
    assert "done: step 4 is checkpointed" in out


def test_a_workdir_of_another_configuration_is_named(own_text_run):
    workdir, _ = own_text_run
    proc = _train(workdir, f"--set=data.source={workdir.parent}/*.txt", "--set=data.eval_fraction=0",
                  "--set=train.steps=8", "--set=model.hidden_size=64", "--set=model.num_hidden_layers=3")
    assert _one_line_error(proc) == (
        f"error: {workdir} holds a run of another configuration (step 4, stored != this run): "
        f"model.hidden_size 32 != 64, model.num_hidden_layers 2 != 3; use another --workdir or the same config")
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]


def test_missing_config_file(tmp_path):
    proc = _train(tmp_path / "w", config=str(tmp_path / "nope.py"))
    assert _one_line_error(proc) == f"error: config file {tmp_path / 'nope.py'} does not exist"
    assert not (tmp_path / "w").exists()


def test_unknown_set_key(tmp_path):
    proc = _train(tmp_path / "w", "--set=train.stpes=5")      # noqa: typo on purpose
    valid = ", ".join(f"train.{f.name}" for f in dataclasses.fields(TrainConfig))
    assert _one_line_error(proc) == f"error: --set train.stpes: unknown key 'stpes'; valid keys: {valid}"


def test_wrong_set_type(tmp_path):
    proc = _train(tmp_path / "w", "--set=train.steps=many")
    assert _one_line_error(proc) == "error: --set train.steps=many: expected <class 'int'>, got 'many'"


def test_impossible_eval_split_writes_nothing(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("one short note\n")
    workdir = tmp_path / "w"
    proc = _train(workdir, f"--set=data.source={short}")
    assert _one_line_error(proc) == ("error: the eval split needs 2 documents but the corpus has only 1: add data, "
                                     "or train without eval: --set=data.eval_fraction=0")
    assert not workdir.exists()                 # no empty checkpoints/ left behind


def test_a_resume_may_change_the_schedule_and_how_it_runs_but_not_the_parameters_or_tokens():
    cfg = load_config_file(CONFIG)
    stored = json.loads(json.dumps(config_as_json(cfg)))            # as the checkpoint's meta item holds it
    allowed = apply_overrides(cfg, ["train.steps=50", "train.eval_every=7", "train.learning_rate=1e-4",
                                    "train.warmup_steps=5", "train.profile_steps=2", "train.init_from='/x'",
                                    "data.batch_size=8", "mesh.fsdp=1", "model.remat_policy='full'"])
    assert config_differences(stored, config_as_json(allowed)) == []
    refused = apply_overrides(cfg, ["train.stage=dense", "data.vocab_size=1024", "model.moe_intermediate_size=32"])
    assert config_differences(stored, config_as_json(refused)) == [
        "model.moe_intermediate_size 16 != 32", "train.stage 'sparse' != 'dense'", "data.vocab_size 512 != 1024"]
    for group, names in IDENTITY_FIELDS.items():                    # every refused field exists
        assert set(names) <= {f.name for f in dataclasses.fields(getattr(cfg, group))}, group
