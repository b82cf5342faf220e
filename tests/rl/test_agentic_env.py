"""The multi-turn pieces that need no server: the SFT teacher, fixed-shape episode batches, seeds."""
import numpy as np

from glm5_jax.rl.agentic import env_seeds, sampling_seed, sft_seed
from glm5_jax.rl.agentic_sft import teacher_episodes
from glm5_jax.rl.config import AgenticConfig
from glm5_jax.rl.env import Sampled, episodes_to_batch, run_episode
from glm5_jax.rl.learner import oldest_version, staleness_of
from glm5_jax.rl.number_guess import NumberGuess
from tests.serve.test_multiturn_env import binary_search_policy


def test_noiseless_teacher_is_binary_search_and_noise_costs_wins():
    """teacher_guess(noise=0) reconstructs the feasible range from the token context alone; it must play
    move for move like the scripted binary search that tracks the range itself."""
    agentic = AgenticConfig(digits=2, max_turns=7, teacher_noise=0.0)
    teacher = teacher_episodes("number_guess", agentic, seed=0, first=0, n=40)
    for index, e in enumerate(teacher):
        env = NumberGuess(digits=2)
        ref = run_episode(binary_search_policy(env), env, sft_seed(0, index)[0], max_turns=7, max_action_tokens=3)
        assert (e.completion, e.reward) == (ref.completion, 1.0)
    noisy = teacher_episodes("number_guess", AgenticConfig(digits=1, max_turns=4, teacher_noise=0.4), 0, 0, 400)
    wins = np.mean([e.reward for e in noisy])
    assert 0.3 < wins < 0.95, wins          # room for RL; binary search itself always wins in 4 turns
    assert all(np.all(np.array(e.logprobs)[np.array(e.loss_mask) == 0] == 0) for e in noisy)


def test_episode_batch_has_a_fixed_shape_and_ignores_version_padding():
    env = NumberGuess(digits=1)
    short = run_episode(lambda c, m, s: Sampled(env.encode_guess(3), [-0.5, -0.25], weights_version=7), env, 0,
                        max_turns=1, max_action_tokens=2)
    long = run_episode(lambda c, m, s: Sampled(env.encode_guess(c.count(1) % 10), [-1.0, -2.0], weights_version=5),
                       NumberGuess(digits=1), 1, max_turns=3, max_action_tokens=2)
    agentic = AgenticConfig(digits=1, max_turns=3)
    batch = episodes_to_batch([short, long], [0, 0], {}, completion_width=agentic.completion_width,
                              turns_width=agentic.max_turns)
    assert batch.completion_tokens.shape == (2, 9) and batch.versions.shape == (2, 3)
    assert batch.versions[0].tolist() == [7, -1, -1]
    assert oldest_version(batch.versions) == 5 and staleness_of(9, batch.versions) == 4
    n = len(long.completion)         # actions of 2 tokens, each answered by 1 token unless it won
    assert n == 3 * long.turns - long.reward
    np.testing.assert_array_equal(batch.loss_mask[1], ([1, 1, 0] * 3)[:n] + [0] * (9 - n))
    np.testing.assert_array_equal(batch.logprobs[1], ([-1, -2, 0] * 3)[:n] + [0] * (9 - n))
    # a policy that names no per-token versions: each action token carries its turn's version
    np.testing.assert_array_equal(batch.token_versions[1], ([5, 5, -1] * 3)[:n] + [-1] * (9 - n))


def test_per_token_versions_of_a_turn_that_spans_a_swap_reach_the_batch():
    """A server that swapped weights mid-turn names each token's version; the batch keeps them, environment
    tokens are -1, and the turn's `versions` entry stays the version it was admitted with."""
    env = NumberGuess(digits=1)
    turns = iter([([2, 3], 2), ([3, 3], 3), ([3, 4], 4)])

    def policy(context, max_tokens, stop):
        versions, admitted = next(turns)
        return Sampled(env.encode_guess(context.count(1) % 10), [-1.0, -2.0], weights_version=admitted,
                       token_versions=versions)
    episode = run_episode(policy, NumberGuess(digits=1), 1, max_turns=3, max_action_tokens=2)
    batch = episodes_to_batch([episode], [0], {}, completion_width=9, turns_width=3)
    n = len(episode.completion)
    want = [2, 3, -1, 3, 3, -1, 3, 4, -1][:n] + [-1] * (9 - n)
    np.testing.assert_array_equal(batch.token_versions[0], want)
    assert batch.versions[0].tolist()[:episode.turns] == [2, 3, 4][:episode.turns]


def test_seeds_depend_on_the_ordinal_only():
    assert env_seeds(0, 5, 4) == env_seeds(0, 5, 4) != env_seeds(0, 6, 4)
    assert len({sampling_seed(0, o, r) for o in range(20) for r in range(64)}) == 20 * 64
