"""The RL samplers on their own sampling mesh (rl.sampler_mesh), not the learner's: a generator's rollout
batch on data:2,expert:2,tensor:2 is the one-device batch (same sampled tokens, fp32 log-probs within
1e-5), and a bad spec fails the config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from rl_helpers import tiny_model_config

from glm5_jax.checkpoint.handoff import PolicyWriter
from glm5_jax.data import DataConfig
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.mesh import MeshError
from glm5_jax.rl.config import RLConfig, RLExperiment
from glm5_jax.rl.policy import sampler_model_config
from glm5_jax.rl.rollout_generator import Generator
from glm5_jax.train.experiment import ExperimentConfig


def test_generator_on_its_own_mesh_samples_the_one_device_batch(tmp_path):
    sft = ExperimentConfig(model=tiny_model_config(initializer_range=0.1),
                           data=DataConfig(source="sort", seq_len=16, batch_size=16))
    cfg = sampler_model_config(sft.model)
    variables = meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(2), jnp.zeros((1, 8), jnp.int32)))
    writer = PolicyWriter(str(tmp_path), max_to_keep=3)
    writer.publish(0, variables, {"num_generators": 1, "watermark": {"0": 0}})
    writer.wait()
    # 3 prompts x 2 samples = 6 rows on 4 batch shards: padded, the padding dropped
    rl = RLConfig(prompts_per_batch=3, group_size=2, temperature=1.0, max_new_tokens=7)
    batches = {}
    for spec in ("", "data:2,expert:2,tensor:2"):
        generator = Generator(RLExperiment(rl=RLConfig(**{**vars(rl), "sampler_mesh": spec})), str(tmp_path), 0, sft)
        assert generator.policy.mesh.size == (8 if spec else 1)
        batches[spec] = generator.sample(seq=1, version=0)
    one, sharded = batches[""], batches["data:2,expert:2,tensor:2"]
    assert one.completion_tokens.shape == (6, 7)
    np.testing.assert_array_equal(sharded.completion_tokens, one.completion_tokens)
    np.testing.assert_array_equal(sharded.completion_lengths, one.completion_lengths)
    np.testing.assert_allclose(sharded.logprobs, one.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(sharded.rewards, one.rewards)
    assert len(np.unique(one.completion_tokens)) > 3, "sampled, varied completions"


def test_a_bad_sampler_mesh_fails_the_config():
    with pytest.raises(MeshError, match="mesh spec 'data=2': 'data=2' is not AXIS:SIZE"):
        RLExperiment(rl=RLConfig(sampler_mesh="data=2")).validate()


def test_the_sampler_kernels_reach_the_generators_model():
    """rl.sampler_kernels / sampler_dispatch / sampler_capacity set the sampling policy's decode steps (the model the
    rollout generators and policy servers build); bad values and routing replay with the kernels fail the config."""
    from glm5_jax.rl.policy import sampling_policy

    rl = RLConfig(sampler_kernels="pallas_interpret", sampler_dispatch="a2a_decode", sampler_capacity=2.0)
    runtime = sampling_policy(rl, tiny_model_config()).cfg.runtime
    assert (runtime.sampler_kernels, runtime.sampler_dispatch, runtime.sampler_capacity) == (
        "pallas_interpret", "a2a_decode", 2.0)
    with pytest.raises(ValueError, match=r"^rl.sampler_kernels='tpu': must be one of \('xla', 'pallas', "):
        RLExperiment(rl=RLConfig(sampler_kernels="tpu")).validate()
    with pytest.raises(ValueError, match="routing replay records the routing in the per-layer cache writes"):
        RLExperiment(rl=RLConfig(sampler_kernels="pallas", replay_experts=True)).validate()
