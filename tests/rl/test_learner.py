"""The learner in-process on hand-made rollout files: global order, stale batches dropped and counted,
corrupt files rejected and counted, every ordinal accounted for exactly once, and a learner that
crashes right after starting a publish resumes to bit-identical final params
(docs/training.md#params-optimiser-and-meta-commit-together,
#files-are-deleted-only-behind-a-committed-watermark)."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_model_config

from glm5_jax.data import DataConfig
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.config import RLConfig, RLExperiment
from glm5_jax.rl.learner import SUMMARY, Learner, admit, check_sampled_like, rollout_sampler, watermark
from glm5_jax.rl.policy import completion_logprobs
from glm5_jax.rl.tasks import SortTask
from glm5_jax.train.experiment import ExperimentConfig

TAU, VERSIONS = 1, 4
# ordinal -> sampling version written into its file; ordinal 2 claims version 0 while the learner is at 2
# (staleness 2 > tau: dropped); ordinal 3 is truncated on disk (rejected)
SAMPLED_WITH = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2}
SAMPLED_LIKE = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}     # RLConfig's defaults
SFT = ExperimentConfig(model=tiny_model_config(), data=DataConfig(source="sort", seq_len=16, batch_size=16))


@pytest.fixture(scope="module")
def setup():
    exp = RLExperiment(rl=RLConfig(num_versions=VERSIONS, tau=TAU, prompts_per_batch=4, group_size=2,
                                   eval_every=0, learning_rate=1e-2, max_new_tokens=7, poll_seconds=0.001))
    learner = Learner(exp, "/nonexistent-unused", SFT, "/nonexistent-unused")
    variables = jax.jit(learner.policy.model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    variables = jax.tree.map(lambda x: getattr(x, "value", x), variables, is_leaf=lambda x: hasattr(x, "value"))
    variables = {"params": variables["params"], "moe_bias": variables["moe_bias"]}
    task, rng = SortTask(partial_credit=True), np.random.default_rng(0)
    logp_fn = jax.jit(lambda v, a, b, c, d: completion_logprobs(learner.policy.model, v, a, b, c, d,
                                                                       rollout_sampler(exp.rl)))
    batches = {}
    for o, version in SAMPLED_WITH.items():
        prompts, lengths = task.prompts(0, 0, o, 4)
        prompts, lengths = np.repeat(prompts, 2, 0), np.repeat(lengths, 2)
        completion = np.concatenate([rng.integers(2, 12, (8, 6)), np.ones((8, 1))], 1).astype(np.int32)
        clen = np.full(8, 7, np.int32)
        with learner.policy.context():
            logp = np.asarray(logp_fn(variables, prompts, lengths, completion, clen)) + rng.normal(0, 0.05, (8, 7))
        batches[o] = ro.RolloutBatch(
            prompt_tokens=prompts, prompt_lengths=lengths, completion_tokens=completion, completion_lengths=clen,
            logprobs=logp.astype(np.float32), loss_mask=np.ones((8, 7), np.float32),
            rewards=task.rewards(prompts, lengths, completion, clen), group_ids=np.arange(8, dtype=np.int32) // 2,
            versions=np.full((8, 1), version, np.int32), meta={"generator": 0, "seq": o, "sample_seconds": 0.0,
                                                                 "sampler": SAMPLED_LIKE})
    return exp, variables, batches


def _start_run(workdir, exp, variables, batches, **rl_changes):
    exp = dataclasses.replace(exp, rl=dataclasses.replace(exp.rl, **rl_changes))
    learner = Learner(exp, str(workdir), SFT, "/nonexistent-unused")
    dirs = ro.RolloutDirs(str(workdir))
    for o, batch in batches.items():
        path = ro.write_batch(dirs, 0, o, batch)
        if o == 3:                                  # damaged on disk after the rename
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    if learner.writer.latest_version() is None:     # version 0: the starting policy (instead of an SFT run)
        learner._publish(0, variables, jax.jit(learner.tx.init)(variables["params"]), learner._fresh_meta())
        learner.writer.wait()
        learner.state.wait()
    return learner


def test_admission_rules():
    assert admit(5, np.array([[3]]), 2) and not admit(5, np.array([[3], [2]]), 2)
    assert watermark(0, 2) == {"0": 0, "1": 0} and watermark(5, 2) == {"0": 3, "1": 2}


def test_rollouts_sampled_with_other_settings_are_rejected():
    rl = RLConfig(top_p=0.9)
    check_sampled_like({"sampler": {"temperature": 1.0, "top_p": 0.9, "top_k": 0}}, rl)
    for recorded in ({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, {"temperature": 1.0, "top_p": 0.9, "top_k": 5},
                     {"temperature": 0.7, "top_p": 0.9, "top_k": 0}, {}):
        with pytest.raises(ro.CorruptRollout, match="sampled with"):
            check_sampled_like({"sampler": recorded}, rl)


def test_top_k_beyond_the_vocabulary_is_refused():
    exp = RLExperiment(rl=RLConfig(top_k=SFT.model.vocab_size + 1))
    with pytest.raises(ValueError, match=f"top_k={SFT.model.vocab_size + 1}: must be in"):
        Learner(exp, "/nonexistent-unused", SFT, "/nonexistent-unused")


@pytest.mark.parametrize("state_every", [1, 2])
def test_drops_rejects_and_crash_resume_are_exact(setup, tmp_path, state_every):
    """With rl.learner_state_every=2 the crash at version 3 resumes from the learner state of version 2 and
    re-trains version 3, which is already published (not written again)."""
    exp, variables, batches = setup
    exp = dataclasses.replace(exp, rl=dataclasses.replace(exp.rl, learner_state_every=state_every))
    clean = _start_run(tmp_path / "clean", exp, variables, batches)
    clean.run()
    summary = json.loads((tmp_path / "clean" / SUMMARY).read_text())
    statuses = [(e["ordinal"], e["status"]) for e in summary["consumed"]]
    assert statuses == [(0, "used"), (1, "used"), (2, "dropped_stale"), (3, "rejected_corrupt"), (4, "used"),
                        (5, "used")]
    assert summary["final_version"] == VERSIONS and summary["dropped_stale"] == 1
    assert summary["rejected_corrupt"] == 1 and summary["staleness_max"] <= TAU
    used = [e for e in summary["consumed"] if e["status"] == "used"]
    assert [e["trained_at"] - e["sampled_with"] for e in used] == [0, 1, 1, 1]
    assert os.listdir(tmp_path / "clean" / "rollouts" / "ready") == []       # all consumed files collected
    assert os.listdir(tmp_path / "clean" / "rollouts" / "rejected") == ["g000_s0000003.rollout"]
    metrics = [json.loads(line) for line in open(tmp_path / "clean" / "rl_metrics.jsonl")]
    assert [m["version"] for m in metrics] == list(range(1, VERSIONS + 1))   # (version 0 was made by the test)
    assert metrics[-1]["batches_consumed"] == 6 and metrics[1]["keep_fraction"] > 0.5

    # the same run, crashing right after starting the publish of version 3 (before its metrics line)
    crashing = _start_run(tmp_path / "crash", exp, variables, batches)
    original = crashing._log_version

    def crash_at_3(variables_, meta, record):
        if meta["version"] == 3:
            raise RuntimeError("simulated kill")
        return original(variables_, meta, record)

    crashing._log_version = crash_at_3
    with pytest.raises(RuntimeError, match="simulated kill"):
        crashing.run()
    crashing.writer.close()
    crashing.state.close()
    resumed = Learner(crashing.exp, str(tmp_path / "crash"), SFT, "/nonexistent-unused")
    assert resumed.writer.latest_version() in (2, 3)
    assert resumed.state.latest_version() in ((2, 3) if state_every == 1 else (2,))
    resumed.run()
    again = json.loads((tmp_path / "crash" / SUMMARY).read_text())
    assert again["params_sha256"] == summary["params_sha256"]
    assert again["consumed"] == summary["consumed"]
    metrics = [json.loads(line) for line in open(tmp_path / "crash" / "rl_metrics.jsonl")]
    assert [m["version"] for m in metrics] == list(range(1, VERSIONS + 1))  # no duplicated or missing line
    assert summary["params_sha256"] != _sha(variables)                       # the params did move


def _sha(variables):
    from glm5_jax.rl.policy import params_sha256
    return params_sha256(variables)


def test_optimizer_reset_on_publish(setup, tmp_path):
    """As in the GLM-5 report: with rl.reset_optimizer_on_publish the published optimizer state is a fresh one."""
    exp, variables, batches = setup
    learner = _start_run(tmp_path, exp, variables, {o: batches[o] for o in (0, 1)}, num_versions=2,
                         reset_optimizer_on_publish=True)
    learner.run()
    restored, opt_state, meta = Learner(learner.exp, str(tmp_path), SFT, "/unused").state.restore(
        2, learner.policy.abstract_variables, learner.abstract_opt_state)
    adam = opt_state[1][0]
    assert int(adam.count) == 0 and meta["version"] == 2
    assert all(float(jnp.abs(m).max()) == 0 for m in jax.tree.leaves(adam.mu))
    assert _sha(restored) != _sha(variables)


def test_profile_option_traces_the_chosen_update(setup, tmp_path):
    """rl.profile_start=1, rl.profile_steps=1: only the second update is traced, into <workdir>/tb."""
    import glob

    from tests.telemetry.test_profiler import traced_steps

    exp, variables, batches = setup
    learner = _start_run(tmp_path, exp, variables, {o: batches[o] for o in (0, 1)}, num_versions=2,
                         profile_start=1, profile_steps=1)
    learner.run()
    traces = glob.glob(str(tmp_path / "tb" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and traced_steps(traces[0], "rl_update") == [1]


def test_inflight_updates_mask_stale_tokens_not_batches(setup, tmp_path):
    """rl.inflight_updates, tau = 1: batch 2 (every token sampled by version 0, trained at 2) is dropped; batch 4
    (tokens 0-2 by version 0, the rest by version 2 after an in-flight swap; trained at 2) is used with its
    version-0 tokens out of the loss. The run ends with the params of a run without in-flight updates in
    which batch 4's loss mask was zeroed on those tokens by hand, and the same ledger statuses."""
    exp, variables, batches = setup
    swapped = np.where(np.arange(7)[None] < 3, 0, 2).repeat(8, 0).astype(np.int32)
    per_token = {0: np.zeros((8, 7), np.int32), 1: np.where(np.arange(7)[None] < 3, 0, 1).repeat(8, 0),
                 2: np.zeros((8, 7), np.int32), 3: np.ones((8, 7), np.int32), 4: swapped}
    inflight = {o: dataclasses.replace(batches[o], versions=np.zeros((8, 1), np.int32),
                                       token_versions=per_token[o].astype(np.int32)) for o in range(5)}
    learner = _start_run(tmp_path / "inflight", exp, variables, inflight, num_versions=3, inflight_updates=True)
    learner.run()
    got = json.loads((tmp_path / "inflight" / SUMMARY).read_text())
    assert [e["status"] for e in got["consumed"]] == ["used", "used", "dropped_stale", "rejected_corrupt", "used"]
    last = got["consumed"][4]
    assert (last["trained_at"], last["sampled_with"], last["oldest_version"], last["stale_tokens"]) == (2, 2, 0, 24)
    assert got["consumed"][1]["stale_tokens"] == 0 and got["staleness_max"] <= 1

    by_hand = dict(inflight)
    by_hand[4] = dataclasses.replace(inflight[4], versions=np.full((8, 1), 2, np.int32), token_versions=None,
                                     loss_mask=inflight[4].loss_mask * (swapped == 2))
    reference = _start_run(tmp_path / "by_hand", exp, variables, by_hand, num_versions=3)
    reference.run()
    want = json.loads((tmp_path / "by_hand" / SUMMARY).read_text())
    assert [e["status"] for e in want["consumed"]] == [e["status"] for e in got["consumed"]]
    assert got["params_sha256"] == want["params_sha256"] != _sha(variables)
