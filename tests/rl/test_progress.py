"""The supervisor's progress lines and summary (glm5_jax.rl.progress), and following a metrics log that
its writer appends to in pieces, rewrites on restart, or has not created yet."""
import json
import os

from glm5_jax.rl.progress import LogFollower, outcome_line, version_line


def _line(record):
    return json.dumps(record) + "\n"


def test_follower_waits_for_whole_lines_and_rereads_a_rewritten_log(tmp_path):
    path = tmp_path / "rl_metrics.jsonl"
    follower = LogFollower(str(path), "version")
    assert follower.poll() == []                                  # not created yet
    line = _line({"version": 1, "mean_reward": 0.5})
    path.write_text(_line({"version": 0}) + line[:7])             # the learner is half-way through a line
    assert [r["version"] for r in follower.poll()] == [0]
    with open(path, "a") as f:
        f.write(line[7:])
    assert [r["version"] for r in follower.poll()] == [1]
    assert follower.poll() == []
    # a restarted learner rewrites the log without its uncommitted tail, then logs again from there
    tmp = tmp_path / "tmp"
    tmp.write_text(_line({"version": 0}) + _line({"version": 1}) + _line({"version": 2}))
    os.replace(tmp, path)
    assert [r["version"] for r in follower.poll()] == [2]


def test_version_lines_and_outcome():
    assert version_line({"version": 0, "eval_exact_match": 0.5664, "elapsed": 0.0}, 60) == \
        "step 0/60  (the SFT policy)  eval 0.566  0.0 s"
    assert version_line({"version": 7, "mean_reward": 0.59375, "staleness": 2, "dropped_stale": 1,
                         "elapsed": 12.34}, 60) == "step 7/60  reward 0.594  staleness 2  dropped 1  12.3 s"
    records = [{"version": 0, "eval_exact_match": 0.5},
               {"version": 1, "mean_reward": 0.75, "staleness": 0},
               {"version": 2, "mean_reward": 0.625, "staleness": 1, "eval_exact_match": 0.875,
                "staleness_max": 1, "dropped_stale": 0}]
    assert outcome_line(records, 12.25, 40.0, {"learner": 1, "gen0": 0, "gen1": 2}) == \
        "done: 2 steps in 12.2 s (40.0 s with the SFT); reward final 0.625, best 0.750 (step 1); " \
        "eval 0.500 (step 0) -> 0.875 (step 2); staleness max 1, dropped 0; restarts 3 (learner 1, gen1 2)"
    assert outcome_line([], 1.0, 1.0, {"learner": 0}) == "done: 0 steps in 1.0 s; restarts 0"
