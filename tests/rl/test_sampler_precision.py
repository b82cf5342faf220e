"""A bf16 sampler against an fp32 learner: the DIS statistics the learner logs per version see the
precision mismatch (|r - 1| well above the 1e-5 an fp32 sampler gets: tests/rl/test_logprobs.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_model_config

from glm5_jax.generate.decoding import Sampler, generate
from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.rl.config import RLConfig
from glm5_jax.rl.loss import policy_loss
from glm5_jax.rl.policy import Policy, completion_logprobs, rl_model_config, sampler_model_config


def _dis_stats(sampler_dtype):
    sft = tiny_model_config(initializer_range=0.3)                 # peaked logits: bf16 rounding matters
    learner_cfg, sampler_cfg = rl_model_config(sft), sampler_model_config(sft, sampler_dtype)
    mesh_cfg = MeshConfig(data=1, fsdp=1)
    mesh = build_mesh(mesh_cfg, jax.devices()[:1])
    learner, sampler = Policy(learner_cfg, mesh, mesh_cfg.rules), Policy(sampler_cfg, mesh, mesh_cfg.rules)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), learner.abstract_variables) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), sampler.abstract_variables)     # one set of fp32 weights
    variables = jax.jit(learner.model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))
    variables = jax.tree.map(lambda x: getattr(x, "value", x), variables, is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(0)
    B, P, C = 32, 6, 7
    lengths = np.full(B, P, np.int32)
    prompts = rng.integers(2, 14, (B, P)).astype(np.int32)
    with sampler.context():
        out = generate(sampler_cfg, variables, prompts, lengths, max_new_tokens=C, temperature=1.0,
                       rng=jax.random.PRNGKey(1), eos_ids=(1,))
    with learner.context():
        logp = jax.jit(lambda v, a, b, c, d: completion_logprobs(learner.model, v, a, b, c, d, Sampler(1.0)))(
            variables, prompts, lengths, out.tokens, out.lengths)
    mask = (np.arange(C)[None] < np.asarray(out.lengths)[:, None]).astype(np.float32)
    _, stats = policy_loss(logp, out.logprobs, jnp.ones(B), mask, "dis", 0.2, 0.2)
    return {k: float(v) for k, v in stats.items()}


def test_bf16_sampler_against_fp32_learner_shows_in_dis_stats():
    mixed = _dis_stats("bfloat16")
    print(mixed)
    assert 1e-3 < mixed["ratio_dev"] < 0.2, mixed           # bf16 rounding noise, not a different policy
    assert 0.5 < mixed["keep_fraction"] <= 1.0, mixed


def test_sampler_dtype_is_validated():
    with pytest.raises(ValueError, match="rl.sampler_dtype='fp8'"):
        RLConfig(sampler_dtype="fp8").validate()
