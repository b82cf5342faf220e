"""The generator's pure rules: task prompts and rewards, global back-pressure, lockstep versions, and
where a restarted generator resumes (neither skipping nor repeating a batch)."""
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_model_config

from glm5_jax.checkpoint.handoff import PolicyWriter
from glm5_jax.data import DataConfig, sort_task as st
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.config import RLConfig, RLExperiment
from glm5_jax.rl.rollout_generator import Generator, lockstep_version, may_start
from glm5_jax.rl.tasks import SortTask, make_task
from glm5_jax.train.experiment import ExperimentConfig


def test_sort_reward_is_exact_match_with_eos():
    task = SortTask()
    prompt = st.prompt_ids(np.array([3, 1, 2, 9, 0, 0]))
    right = st.correct_answer_ids(np.array([3, 1, 2, 9, 0, 0]))
    assert task.reward(prompt, right) == 1.0
    assert task.reward(prompt, right[:-1]) == 0.0                      # no EOS
    assert task.reward(prompt, np.append(right[:-1], [2, 1])) == 0.0   # extra token before EOS
    swapped = right.copy()
    swapped[[2, 3]] = swapped[[3, 2]]
    assert task.reward(prompt, swapped) == 0.0
    assert make_task("sort_partial").reward(prompt, swapped) == pytest.approx(5 / 7)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")


def test_prompts_are_pure_functions_of_seed_generator_seq():
    task = SortTask()
    a, la = task.prompts(0, 1, 7, 16)
    b, _ = task.prompts(0, 1, 7, 16)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (16, st.PROMPT_LEN) and np.all(la == st.PROMPT_LEN)
    for other in (task.prompts(0, 1, 8, 16)[0], task.prompts(0, 0, 7, 16)[0], task.prompts(1, 1, 7, 16)[0],
                  task.eval_prompts(0, 16)[0]):
        assert not np.array_equal(a, other)


def test_backpressure_is_global_and_lockstep_version_exact():
    # two generators, tau = 2: with 3 ordinals consumed, ordinals up to 5 may start, whoever owns them
    assert [may_start(o, 3, 2) for o in range(3, 7)] == [True, True, True, False]
    assert [lockstep_version(o, 2) for o in range(5)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("watermark_seq,expected", [(1, 3), (5, 5)])
def test_restarted_generator_resumes_after_disk_and_watermark(tmp_path, watermark_seq, expected):
    exp = RLExperiment(rl=RLConfig(num_generators=2, tau=2))
    sft = ExperimentConfig(model=tiny_model_config(), data=DataConfig(source="sort", seq_len=16, batch_size=16))
    writer = PolicyWriter(str(tmp_path), max_to_keep=3)
    writer.publish(0, {"params": {"w": jnp.zeros(2)}}, {"num_generators": 2,
                                                             "watermark": {"0": 0, "1": watermark_seq}})
    writer.wait()
    dirs = ro.RolloutDirs(str(tmp_path))
    for seq in (1, 2):                                        # generator 1 had written seqs 1 and 2
        open(dirs.path(1, seq), "wb").close()
    open(dirs.path(0, 9), "wb").close()                       # another generator's files do not count
    open(f"{dirs.tmp}/g001_s0000003.rollout.123.tmp", "wb").close()
    gen = Generator(exp, str(tmp_path), 1, sft)
    assert gen.resume_seq() == expected
    gen.dirs.clear_tmp(1)
    assert list((tmp_path / "rollouts" / "tmp").iterdir()) == []
    with pytest.raises(ValueError, match="generator_id=2"):
        Generator(exp, str(tmp_path), 2, sft)
    writer.close()
