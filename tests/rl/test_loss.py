"""The RL losses against hand computations (docs/training.md#policy-losses): GLM-5 DIS masking at both interval
edges, padding and loss-mask handling, token-level normalisation, gradients; GRPO advantages."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.rl.loss import group_advantages, policy_loss

EPS_L, EPS_H = 0.2, 0.28


def _rollout_for_ratios(logp, ratios):
    """Behaviour log-probs that give exactly these ratios r = exp(logp - logp_rollout) in float32."""
    return (np.asarray(logp, np.float64) - np.log(np.asarray(ratios, np.float64))).astype(np.float32)


def test_group_advantages_hand_computed():
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], jnp.float32)     # two groups of 4
    adv = np.asarray(group_advantages(rewards, 4))
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
    adv_mean_only = np.asarray(group_advantages(rewards, 4, std_norm=False))
    np.testing.assert_allclose(adv_mean_only, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-7)


def test_dis_masks_both_edges_padding_and_loss_mask():
    # row 0: ratios just inside/outside each edge; row 1: a kept token, a loss-masked token (env token)
    # with a wild ratio, and padding after the end (mask 0, arbitrary values)
    ratios = np.array([[1 - EPS_L - 1e-3, 1 - EPS_L + 1e-3, 1 + EPS_H - 1e-3, 1 + EPS_H + 1e-3],
                       [1.05, 7.0, 0.01, 3.0]])
    logp = np.array([[-0.5, -1.0, -1.5, -2.0], [-0.25, -3.0, -9.0, -4.0]], np.float32)
    rollout = _rollout_for_ratios(logp, ratios)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    adv = np.array([2.0, -0.5], np.float32)
    loss, stats = policy_loss(jnp.asarray(logp), jnp.asarray(rollout), jnp.asarray(adv), jnp.asarray(mask),
                              "dis", EPS_L, EPS_H)
    # hand: kept tokens are (0,1), (0,2), (1,0); five tokens in the loss
    r = np.exp(logp.astype(np.float64) - rollout.astype(np.float64))
    expected = -(r[0, 1] * 2.0 * logp[0, 1] + r[0, 2] * 2.0 * logp[0, 2] + r[1, 0] * -0.5 * logp[1, 0]) / 5
    assert math.isclose(float(loss), expected, rel_tol=1e-5)
    assert math.isclose(float(stats["keep_fraction"]), 3 / 5, rel_tol=1e-6)
    assert float(stats["tokens"]) == 5
    # gradient: sg(r * keep) * A / N on kept tokens, zero elsewhere (including masked and padding)
    grad = jax.grad(lambda lp: policy_loss(lp, jnp.asarray(rollout), jnp.asarray(adv), jnp.asarray(mask), "dis",
                                           EPS_L, EPS_H)[0])(jnp.asarray(logp))
    want = np.zeros_like(r)
    want[0, 1], want[0, 2], want[1, 0] = -r[0, 1] * 2 / 5, -r[0, 2] * 2 / 5, -r[1, 0] * -0.5 / 5
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


def test_dis_on_policy_is_plain_policy_gradient():
    """r = 1 everywhere: loss = -mean(A * logp) over the mask, every token kept."""
    key = jax.random.PRNGKey(0)
    logp = -jax.random.uniform(key, (3, 5), minval=0.1, maxval=3.0)
    adv = jnp.array([1.0, -2.0, 0.5])
    mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], jnp.float32)
    loss, stats = policy_loss(logp, logp, adv, mask, "dis")
    expected = -float(jnp.sum(adv[:, None] * logp * mask) / jnp.sum(mask))
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    assert float(stats["keep_fraction"]) == 1.0 and float(stats["ratio_dev"]) == 0.0


def test_ppo_clip_hand_computed():
    ratios = np.array([[0.5, 1.1, 1.5]])
    logp = np.array([[-1.0, -1.0, -1.0]], np.float32)
    rollout = _rollout_for_ratios(logp, ratios)
    mask = np.ones((1, 3), np.float32)
    for a in (1.0, -1.0):
        loss, _ = policy_loss(jnp.asarray(logp), jnp.asarray(rollout), jnp.asarray([a]), jnp.asarray(mask),
                              "ppo_clip", EPS_L, EPS_H)
        r = np.exp(logp.astype(np.float64) - rollout)[0]
        expected = -np.mean(np.minimum(r * a, np.clip(r, 1 - EPS_L, 1 + EPS_H) * a))
        assert math.isclose(float(loss), expected, rel_tol=1e-5), a


def test_icepop_masks_train_infer_mismatch_beyond_beta():
    ratios = np.array([[0.49, 0.51, 1.0, 1.99, 2.01]])               # pi_old / pi_infer, beta = 2
    logp = np.full((1, 5), -1.0, np.float32)
    rollout = _rollout_for_ratios(logp, ratios)
    mask = np.ones((1, 5), np.float32)
    loss, stats = policy_loss(jnp.asarray(logp), jnp.asarray(rollout), jnp.asarray([1.5]), jnp.asarray(mask),
                              "icepop", EPS_L, EPS_H, icepop_beta=2.0)
    # u = pi_theta / pi_old = 1 in value: each kept token contributes -A; three of five are kept
    assert math.isclose(float(loss), -1.5 * 3 / 5, rel_tol=1e-6)
    assert math.isclose(float(stats["keep_fraction"]), 3 / 5, rel_tol=1e-6)
    grad = jax.grad(lambda lp: policy_loss(lp, jnp.asarray(rollout), jnp.asarray([1.5]), jnp.asarray(mask),
                                           "icepop", EPS_L, EPS_H, 2.0)[0])(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(grad), [[0, -1.5 / 5, -1.5 / 5, -1.5 / 5, 0]], atol=1e-7)


def test_unknown_loss_is_an_error():
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((1,)), jnp.ones((1, 1)), "reinforce")
