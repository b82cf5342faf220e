"""TITO consistency: the sampler's recorded log-probs equal the learner's recomputation of the same
tokens under the same version (fp32, <= 1e-5), with ragged prompts, EOS stops and a temperature."""
import jax
import jax.numpy as jnp
import numpy as np
from rl_helpers import tiny_model_config

from glm5_jax.rl.policy import Policy, completion_logprobs, rl_model_config, sequence_layout
from glm5_jax.generate import generate
from glm5_jax.sharding import MeshConfig, build_mesh


def test_sequence_layout_places_completion_after_each_prompt():
    prompt = jnp.array([[5, 6, 7], [8, 9, 0]])
    tokens, seg, at = sequence_layout(prompt, jnp.array([3, 2]), jnp.array([[1, 2], [3, 0]]), jnp.array([2, 1]))
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 1, 2], [8, 9, 3, 0, 0]])
    np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(at, [[2, 3], [1, 2]])


def test_generator_logprobs_equal_learner_recomputation():
    cfg = rl_model_config(tiny_model_config(initializer_range=0.1))   # varied logprobs; EOS ids stop rows
    mesh_cfg = MeshConfig(data=1, fsdp=1)
    policy = Policy(cfg, build_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg.rules)
    variables = jax.jit(policy.model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))
    variables = jax.tree.map(lambda x: getattr(x, "value", x), variables,
                             is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(0)
    B, P, C = 12, 9, 8
    lengths = rng.integers(3, P + 1, B).astype(np.int32)
    prompts = np.where(np.arange(P)[None] < lengths[:, None], rng.integers(2, 14, (B, P)), 0).astype(np.int32)
    with policy.context():
        out = generate(cfg, variables, prompts, lengths, max_new_tokens=C, temperature=0.7,
                       rng=jax.random.PRNGKey(1), eos_ids=(1, 5))
        tokens, new_lengths, logp = (np.asarray(x) for x in (out.tokens, out.lengths, out.logprobs))
        recomputed = np.asarray(jax.jit(lambda v, a, b, c, d: completion_logprobs(policy.model, v, a, b, c, d, 0.7))(
            variables, prompts, lengths, tokens, new_lengths))
    mask = np.arange(C)[None] < new_lengths[:, None]
    assert 0 < mask.sum() < mask.size, "some rows must stop early at an EOS for the test to mean something"
    assert np.all(tokens[~mask] == 0) and np.all(logp[~mask] == 0)
    ends = tokens[np.arange(B), np.maximum(new_lengths - 1, 0)]
    assert np.all(np.isin(ends[new_lengths < C], (1, 5))), "a row shorter than C ends with an EOS id"
    np.testing.assert_allclose(logp[mask], recomputed[mask], atol=1e-5, rtol=0)
    assert np.all(logp[mask] < 0) and np.ptp(logp[mask]) > 1.0, "a varied policy, not a uniform one"
