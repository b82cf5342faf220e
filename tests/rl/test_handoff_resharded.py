"""The weights-only policy handoff across meshes: a version written sharded from the learner's training
layout (fsdp 2 x expert 2 on 4 devices, DEFAULT_RULES) is restored by a generator on 2 other devices with
the sampling rules (expert 2), and holds exactly what sampling needs (docs/rl.md#weights-only-policy-handoff):

* fp32: the generator's log-probs equal the learner's (within 1e-6);
* bf16: the restored weights are the learner's weights cast to bf16, bit for bit;
* INT4 experts: the packed words and scales are `int4_weights.quantize_params` of the learner's experts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_model_config

from glm5_jax.checkpoint.handoff import (PolicyReader, PolicyWriter, sampler_abstract_variables,
                                         sampler_variables)
from glm5_jax.model.moe.int4_weights import quantize_params
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from glm5_jax.parallel.sampling import SAMPLING_RULES
from glm5_jax.rl.config import RLConfig
from glm5_jax.rl.learner import rollout_sampler
from glm5_jax.rl.policy import Policy, completion_logprobs, rl_model_config

# K = 64 = 8 groups of 8 input channels: the smallest width INT4 packs (one int32 word per 8 groups)
MODEL = rl_model_config(tiny_model_config(hidden_size=64, moe_intermediate_size=64, quant_group_size=8))
FP32, BF16, INT4 = 0, 1, 2           # the version numbers written below


def _random_variables(policy):
    """Non-trivial values for every leaf (a nonzero routing bias too), placed in the policy's layout."""
    leaves, tree = jax.tree.flatten(policy.abstract_variables)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    values = [0.3 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
    return jax.device_put(jax.tree.unflatten(tree, values), policy.shardings)


@pytest.fixture(scope="module")
def handoff(tmp_path_factory):
    devices = jax.devices()
    learner = Policy(MODEL, build_mesh(MeshConfig(fsdp=2, expert=2), devices[:4]), DEFAULT_RULES)
    generator = Policy(MODEL, build_mesh(MeshConfig(fsdp=1, expert=2), devices[4:6]), SAMPLING_RULES)
    variables = _random_variables(learner)
    workdir = str(tmp_path_factory.mktemp("handoff"))
    writer = PolicyWriter(workdir, max_to_keep=5)
    for version, (dtype, int4_cfg) in {FP32: (jnp.float32, None), BF16: (jnp.bfloat16, None),
                                       INT4: (jnp.bfloat16, MODEL)}.items():
        writer.publish(version, sampler_variables(variables, dtype, int4_cfg), {"version": version})
    writer.wait()
    writer.close()
    return learner, generator, variables, PolicyReader(workdir)


def _devices_of(tree):
    return {d for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}


def test_fp32_version_gives_the_learners_logprobs_on_the_generator_mesh(handoff):
    learner, generator, variables, reader = handoff
    restored = reader.restore_variables(FP32, generator.abstract_variables)
    assert _devices_of(restored) == set(jax.devices()[4:6])
    assert all(a.sharding == s for a, s in zip(jax.tree.leaves(restored), jax.tree.leaves(generator.shardings)))
    rng = np.random.default_rng(0)
    prompts, completions = rng.integers(2, 16, (4, 5)), rng.integers(2, 16, (4, 6))
    prompt_lengths, completion_lengths = np.array([5, 3, 4, 5]), np.array([6, 6, 2, 4])
    sampler = rollout_sampler(RLConfig())

    def logprobs(policy, v):
        with policy.context():
            return np.asarray(jax.jit(lambda v: completion_logprobs(policy.model, v, prompts, prompt_lengths,
                                                                    completions, completion_lengths, sampler))(v))

    mask = np.arange(6)[None] < completion_lengths[:, None]
    want, got = logprobs(learner, variables), logprobs(generator, restored)
    assert np.all(want[mask] < 0)
    np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=1e-6)


def test_bf16_version_is_the_learners_weights_cast(handoff):
    _, generator, variables, reader = handoff
    restored = reader.restore_variables(BF16, sampler_abstract_variables(generator.abstract_variables,
                                                                         jnp.bfloat16))
    want = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), variables["params"])
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(restored["params"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored["params"]), want)
    # a generator whose target keeps its model's fp32 parameters gets the same values, upcast by orbax
    upcast = reader.restore_variables(BF16, generator.abstract_variables)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(upcast["params"]))
    jax.tree.map(lambda a, w: np.testing.assert_array_equal(np.asarray(a), w.astype(np.float32)),
                 upcast["params"], want)
    # the routing bias only selects experts: it keeps the learner's dtype and bits
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored["moe_bias"]),
                 jax.tree.map(np.asarray, variables["moe_bias"]))


def test_int4_version_holds_the_packing_of_the_learners_experts(handoff):
    _, _, variables, reader = handoff
    generator = Policy(MODEL.replace(quant="int4"), build_mesh(MeshConfig(fsdp=1, expert=2), jax.devices()[4:6]),
                       SAMPLING_RULES)
    restored = reader.restore_variables(INT4, sampler_abstract_variables(generator.abstract_variables,
                                                                         jnp.bfloat16))
    host = jax.tree.map(np.asarray, variables["params"])                 # packed on the host, unsharded
    want = quantize_params(host, MODEL)
    packed = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(restored["params"])[0]
              if path[-1].key.endswith(("_packed", "_scale"))]
    experts = [path for path, _ in jax.tree_util.tree_flatten_with_path(host)[0]
               if path[-2:] == (jax.tree_util.DictKey("moe"), jax.tree_util.DictKey("gate_proj"))]
    assert experts and len(packed) == 6 * len(experts)                   # 3 weights x (packed, scale) per MoE layer
    for path, leaf in packed:
        expected = want
        for k in path:
            expected = expected[k.key]
        assert leaf.dtype == expected.dtype and leaf.shape == expected.shape
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected), err_msg=jax.tree_util.keystr(path))
