"""End to end through the supervisor: learner + generator processes, lockstep mode, SIGKILLs.

The slow test compares an uninterrupted lockstep run with one whose learner and generator are killed
at random: the final params must be bit-identical and every batch consumed exactly once. (bench/rl.py
runs the full 10-kill check on the real task.)
"""
import json
import os

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
