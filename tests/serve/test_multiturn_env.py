"""Multi-turn episodes (number guessing) run token in / token out through the server."""
import jax
import numpy as np

from glm5_jax.rl.env import Sampled, ServerPolicy, episodes_to_batch, run_episode
from glm5_jax.rl.number_guess import GuessTokens, NumberGuess
from tests.generate.tiny_models import full_logits
from tests.serve.conftest import SERVE_CFG, variables

T = GuessTokens()


def binary_search_policy(env):
    """A scripted policy reading the last observation in its context (the optimal strategy)."""
    bounds = {"lo": 0, "hi": 10 ** env.digits - 1, "last": None}

    def policy(context, max_tokens, stop_ids):
        if bounds["last"] is not None:
            if context[-1] == T.higher:
                bounds["lo"] = bounds["last"] + 1
            elif context[-1] == T.lower:
                bounds["hi"] = bounds["last"] - 1
        bounds["last"] = (bounds["lo"] + bounds["hi"]) // 2
        action = env.encode_guess(bounds["last"])
        return Sampled(action, [0.0] * len(action))
    return policy


def test_binary_search_always_wins_within_seven_turns():
    for seed in range(30):
        env = NumberGuess(digits=2)
        episode = run_episode(binary_search_policy(env), env, seed, max_turns=7, max_action_tokens=3)
        assert episode.reward == 1.0 and episode.turns <= 7, (seed, env.secret)
        assert env.parse(episode.completion[-3:]) == env.secret
    env = NumberGuess(digits=2)
    env.reset(0)
    assert env.step([T.digit0 + 1, T.end]).observation == [T.invalid]           # one digit short
    assert env.step([T.digit0, T.digit0 + 5, 99]).observation == [T.invalid]    # no end token
    low = env.step(env.encode_guess(0 if env.secret else 1))
    assert low.observation == ([T.higher] if env.secret else [T.lower]) and not low.done


def test_episode_through_the_server_is_token_exact(served):
    _, url = served
    policy = ServerPolicy(url, temperature=1.0, seed=5)
    episodes = [run_episode(policy, NumberGuess(digits=2), seed, max_turns=4, max_action_tokens=3,
                            stop_token_ids=[T.end]) for seed in range(2)]
    policy.close()
    for e in episodes:
        tokens = np.array(e.prompt + e.completion)
        mask = np.array(e.loss_mask)
        # every action token's logprob is the model's (temperature 1, top_p 1) given the whole episode so far
        logp = jax.nn.log_softmax(full_logits(SERVE_CFG, variables(), tokens[None])[0], axis=-1)
        P = len(e.prompt)
        want = np.asarray(logp[np.arange(P - 1, len(tokens) - 1), tokens[P:]])
        np.testing.assert_allclose(np.array(e.logprobs)[mask == 1], want[mask == 1], atol=1e-4)
        assert np.all(np.array(e.logprobs)[mask == 0] == 0)
        # a later turn prefills only what is new: the previous context and action are cached except the
        # action's last id (sampled, never fed back)
        assert e.turns == 4 or e.reward == 1.0
        for t in range(1, e.turns):
            assert e.cached_tokens[t] == e.context_lengths[t - 1] + e.action_lengths[t - 1] - 1
    batch = episodes_to_batch(episodes, [0, 0], {"task": "number_guess"})
    assert batch.loss_mask.sum() == sum(sum(e.loss_mask) for e in episodes)
    assert batch.versions.shape == (2, max(e.turns for e in episodes))
