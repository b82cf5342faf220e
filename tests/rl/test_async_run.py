"""End to end through the supervisor: learner + generator processes, what the supervisor prints, and
(slow) lockstep mode with SIGKILLs.

The slow test compares an uninterrupted lockstep run with one whose learner and generator are killed
at random: the final params must be bit-identical and every batch consumed exactly once. (bench/rl.py
runs the full 10-kill check on the real task.)
"""
import json
import os
import re

import pytest
from rl_helpers import write_tiny_configs

from glm5_jax.rl.run import Supervisor

TAU = 1


def _child_env(monkeypatch, cache):
    # children: one CPU device each, unoptimised (fast) compiles, one shared compilation cache
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))


def _run(config, workdir, sft, kills=0):
    report = Supervisor(config, str(workdir), [f"sft_workdir={sft}"], num_generators=2).run(
        chaos_kills=kills, chaos_interval=(1.0, 3.0), chaos_seed=3)
    summary = json.loads((workdir / "rl_summary.json").read_text())
    return report, summary


def _check_ledger(summary, versions):
    ordinals = [e["ordinal"] for e in summary["consumed"]]
    assert ordinals == list(range(len(ordinals))), "every ordinal exactly once, in order"
    used = [e for e in summary["consumed"] if e["status"] == "used"]
    assert len(used) == versions == summary["final_version"]
    # lockstep: batch o is sampled with version max(0, o - tau) and trained at version o
    assert all(e["sampled_with"] == max(0, e["ordinal"] - TAU) for e in used)
    assert all(e["trained_at"] - e["sampled_with"] <= TAU for e in used)
    assert {e["generator"] for e in used} == {0, 1}


def test_run_prints_progress_and_summary(tmp_path, monkeypatch, capsys):
    """The demo's output at the smallest size (SFT, then 2 async versions): a line per SFT log step and per
    learner step with its reward and staleness, and a summary naming the outputs and the children's logs
    (the eval columns: test_progress.py); the generator's log holds no orbax metadata warnings."""
    _child_env(monkeypatch, tmp_path / "cache")
    config = write_tiny_configs(tmp_path, num_versions=2, tau=1, lockstep=False)
    workdir = tmp_path / "run"
    Supervisor(config, str(workdir), [f"sft_workdir={tmp_path / 'sft'}"], num_generators=1).run()
    out = capsys.readouterr().out
    assert re.search(r"\[run\] SFT: training .* \(3 steps; log .*sft\.log\)", out), out
    assert re.search(r"\[run\] sft step 3/3  loss \d", out), out
    assert "[run] step 0/2  (the SFT policy)" in out, out
    for version in (1, 2):
        assert re.search(rf"\[run\] step {version}/2  reward \d\.\d{{3}}  staleness [01]", out), out
    assert re.search(r"\[run\] done: 2 steps in [\d.]+ s \([\d.]+ s with the SFT\); reward final \d\.\d{3}, best .*; "
                     r"staleness max [01], dropped 0; restarts 0", out), out
    logs = workdir / "logs"
    assert f"[run] logs: {logs}/sft.log, {logs}/learner.log, {logs}/gen0.log" in out, out
    assert f"policy versions in {workdir}/policy" in out, out
    gen0 = (logs / "gen0.log").read_text()
    assert "wrote seq 0" in gen0 and "Metadata file does not exist" not in gen0, gen0


@pytest.mark.slow   # ~2 minutes on 2 cores (process starts and compiles): run with -m slow
def test_lockstep_run_survives_kills_bit_identically(tmp_path, monkeypatch):
    _child_env(monkeypatch, tmp_path / "cache")
    config = write_tiny_configs(tmp_path, num_versions=12, tau=TAU, lockstep=True,
                                extra_rl='task="sort_partial"')
    clean_report, clean = _run(config, tmp_path / "clean", tmp_path / "sft")
    _check_ledger(clean, 12)
    assert sum(clean_report["restarts"].values()) == 0
    killed_report, killed = _run(config, tmp_path / "killed", tmp_path / "sft", kills=4)
    assert len(killed_report["kills"]) >= 2, killed_report
    assert sum(killed_report["restarts"].values()) == len(killed_report["kills"])
    _check_ledger(killed, 12)
    assert killed["params_sha256"] == clean["params_sha256"]
    assert killed["consumed"] == clean["consumed"]
    versions = [json.loads(line)["version"] for line in open(tmp_path / "killed" / "rl_metrics.jsonl")]
    assert versions == list(range(13))
