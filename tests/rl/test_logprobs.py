"""TITO consistency: the sampler's recorded log-probs equal the learner's recomputation of the same
tokens under the same version (fp32, <= 1e-5), with ragged prompts, EOS stops, a temperature and
top-p / top-k truncation."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_model_config

from glm5_jax.generate.decoding import Sampler, generate
from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.rl.loss import policy_loss
from glm5_jax.rl.policy import OUTSIDE_SUPPORT_LOGP, Policy, completion_logprobs, rl_model_config, sequence_layout


def test_sequence_layout_places_completion_after_each_prompt():
    prompt = jnp.array([[5, 6, 7], [8, 9, 0]])
    tokens, seg, at = sequence_layout(prompt, jnp.array([3, 2]), jnp.array([[1, 2], [3, 0]]), jnp.array([2, 1]))
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 1, 2], [8, 9, 3, 0, 0]])
    np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(at, [[2, 3], [1, 2]])


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 20)])
def test_generator_logprobs_equal_learner_recomputation(top_p, top_k):
    """On-policy (same version) the learner's log-probs equal the recorded ones, so π_θ / π_rollout = 1 and
    the DIS loss keeps every token; with top-p / top-k this holds because both sides renormalise over the
    same kept set (the full-vocabulary log-softmax would differ by the log of the kept mass)."""
    cfg = rl_model_config(tiny_model_config(initializer_range=0.1, vocab_size=48))   # varied logprobs
    mesh_cfg = MeshConfig(data=1, fsdp=1)
    policy = Policy(cfg, build_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg.rules)
    variables = jax.jit(policy.model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))
    variables = jax.tree.map(lambda x: getattr(x, "value", x), variables,
                             is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(0)
    B, P, C = 12, 9, 8
    lengths = rng.integers(3, P + 1, B).astype(np.int32)
    prompts = np.where(np.arange(P)[None] < lengths[:, None], rng.integers(2, 14, (B, P)), 0).astype(np.int32)
    sampler = Sampler(temperature=0.7, top_p=top_p, top_k=top_k)
    learner_logp = jax.jit(lambda v, a, b, c, d, s: completion_logprobs(policy.model, v, a, b, c, d, s),
                           static_argnums=5)
    with policy.context():
        out = generate(cfg, variables, prompts, lengths, max_new_tokens=C, temperature=sampler.temperature,
                       top_p=top_p, top_k=top_k, rng=jax.random.PRNGKey(1), eos_ids=(1, 5))
        tokens, new_lengths, logp = (np.asarray(x) for x in (out.tokens, out.lengths, out.logprobs))
        recomputed = np.asarray(learner_logp(variables, prompts, lengths, tokens, new_lengths, sampler))
        full_vocab = np.asarray(learner_logp(variables, prompts, lengths, tokens, new_lengths, Sampler(0.7)))
    mask = np.arange(C)[None] < new_lengths[:, None]
    assert 0 < mask.sum() < mask.size, "some rows must stop early at an EOS for the test to mean something"
    assert np.all(tokens[~mask] == 0) and np.all(logp[~mask] == 0)
    ends = tokens[np.arange(B), np.maximum(new_lengths - 1, 0)]
    assert np.all(np.isin(ends[new_lengths < C], (1, 5))), "a row shorter than C ends with an EOS id"
    np.testing.assert_allclose(logp[mask], recomputed[mask], atol=1e-5, rtol=0)
    assert np.all(logp[mask] < 0) and np.ptp(logp[mask]) > 1.0, "a varied policy, not a uniform one"
    loss, stats = policy_loss(jnp.asarray(recomputed), jnp.asarray(logp), jnp.ones(B), jnp.asarray(mask), "dis")
    assert float(stats["ratio_dev"]) <= 1e-5 and float(stats["keep_fraction"]) == 1.0 and np.isfinite(float(loss))
    if top_p < 1 or top_k:
        # truncation removed mass: the full-vocabulary log-prob is lower, by log(kept mass) > 0.01 somewhere
        assert np.max(logp[mask] - full_vocab[mask]) > 0.01


def test_token_outside_the_learners_kept_set_gets_ratio_zero_and_finite_loss():
    """Off-policy a recorded token can fall outside the learner's top-k: log-prob OUTSIDE_SUPPORT_LOGP
    (not -inf), ratio 0, masked by DIS and ICEPOP, and the loss and its gradient stay finite."""
    logits = jnp.array([[[3.0, 2.0, 1.0, 0.0]]])
    sampler = Sampler(temperature=1.0, top_k=2)
    logp_V = sampler.log_probs(logits)[0, 0]
    np.testing.assert_allclose(np.exp(logp_V[:2]), jax.nn.softmax(jnp.array([3.0, 2.0])), rtol=1e-6)
    assert np.all(np.isneginf(np.asarray(logp_V[2:])))

    class Logits:                       # a stand-in model: fixed logits at every position
        def apply(self, variables, tokens, segment_ids):
            return SimpleNamespace(logits=jnp.broadcast_to(variables["w"] * logits[0, 0], tokens.shape + (4,)))

    def loss_of(w, kind):
        logp = completion_logprobs(Logits(), {"w": w}, jnp.array([[1]]), jnp.array([1]), jnp.array([[0, 3]]),
                                   jnp.array([2]), sampler)
        return policy_loss(logp, jnp.log(jnp.array([[0.7, 0.1]])), jnp.array([1.0]), jnp.ones((1, 2)), kind)

    for kind in ("dis", "icepop", "ppo_clip"):
        (loss, stats), grad = jax.value_and_grad(loss_of, has_aux=True)(1.0, kind)
        assert np.isfinite(float(loss)) and np.isfinite(float(grad)), kind
        if kind != "ppo_clip":
            assert float(stats["keep_fraction"]) <= 0.5, kind       # token 3 (outside the top-2) is masked
    logp = completion_logprobs(Logits(), {"w": 1.0}, jnp.array([[1]]), jnp.array([1]), jnp.array([[0, 3]]),
                               jnp.array([2]), sampler)
    np.testing.assert_allclose(logp[0], [logp_V[0], OUTSIDE_SUPPORT_LOGP], rtol=1e-6)
