"""generate on a sampling mesh equals the single-device run: same greedy tokens, fp32 log-probs within 1e-5.

The tiny model has MoE layers (8 routed experts) and DSA (index_topk 8 < prompt + new tokens), so the
experts split over ``expert``, the heads over ``tensor`` and the decode-time key selection all matter.
Three prompts on a mesh of 4 batch shards exercise the padded batch; an odd cache length on
``context:2`` the padded prompt width. The same three rows unpadded, split by the program itself over the
4 shards, check the decode step on a batch that does not divide its shards (the DSA selection mask is a
scatter, which the XLA SPMD partitioner once fed a pad row's indices: pallas_kernels/masking.py).
"""
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.checkpoint.placement import place_variables
from glm5_jax.generate.decoding import generate, prepare_generate
from glm5_jax.generate.on_mesh import generate_on_mesh
from glm5_jax.parallel.mesh import MeshError, mesh_and_rules
from glm5_jax.parallel.sampling import SAMPLING_RULES, check_sampling_fits, sampling_mesh
from tests.generate.tiny_models import TINY, init_variables

LENGTHS = np.array([5, 11, 8], np.int32)
N = 14                       # 11 + 14 = 25 slots: odd, and past index_topk = 8


def prompts():
    seq = np.random.default_rng(3).integers(2, TINY.vocab_size, (len(LENGTHS), LENGTHS.max())).astype(np.int32)
    return np.where(np.arange(seq.shape[1])[None] < LENGTHS[:, None], seq, 0)


@pytest.fixture(scope="module")
def single_device():
    return generate(TINY, init_variables(TINY), prompts(), LENGTHS, max_new_tokens=N, temperature=0.0)


@pytest.mark.parametrize("spec", ["data:2,expert:2,tensor:2", "data:2,context:2,tensor:2"])
def test_sharded_greedy_equals_single_device(single_device, spec):
    mesh = sampling_mesh(spec)
    check_sampling_fits(mesh, TINY)
    variables = place_variables(init_variables(TINY), TINY, mesh, SAMPLING_RULES)
    # weights resident: experts split over expert, widths over tensor, none over the batch or cache axes
    axes = {a for leaf in jax.tree.leaves(variables) for entry in leaf.sharding.spec if entry
            for a in ((entry,) if isinstance(entry, str) else entry) if mesh.shape[a] > 1}
    assert axes == {"tensor"} | ({"expert"} if "expert" in spec else set())
    # the query's down-projection split over its LoRA rank, its up-projection over heads (sampling.py)
    attn = variables["params"]["decoder"]["segment_0"]["layer_0"]["attention"]
    assert tuple(attn["q_a_proj"].sharding.spec)[-1] == "tensor" and "tensor" in attn["q_b_proj"].sharding.spec[-2:]
    got = generate_on_mesh(TINY, variables, prompts(), LENGTHS, mesh, max_new_tokens=N, temperature=0.0)
    assert_same_generation(got, single_device)


@pytest.mark.parametrize("spec", ["data:2,expert:2,tensor:2", "data:2,context:2,tensor:2"])
def test_unpadded_indivisible_batch_equals_single_device(single_device, spec):
    """3 rows handed whole to the program, whose rules split the batch over 4 shards (the partitioner pads it)."""
    mesh = sampling_mesh(spec)
    whole = NamedSharding(mesh, P())
    fn, args = prepare_generate(TINY, place_variables(init_variables(TINY), TINY, mesh, SAMPLING_RULES),
                                jax.device_put(prompts(), whole), jax.device_put(LENGTHS, whole), max_new_tokens=N,
                                temperature=0.0)
    with mesh_and_rules(mesh, SAMPLING_RULES):
        got = fn(*args[:3], jax.device_put(args[3], whole))
    assert_same_generation(got, single_device)


def assert_same_generation(got, want):
    """Same greedy tokens and lengths, fp32 log-probs within 1e-5."""
    assert np.asarray(got.tokens).shape == np.asarray(want.tokens).shape
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec, message", [
    ("data:2,tensor", "mesh spec 'data:2,tensor': 'tensor' is not AXIS:SIZE with AXIS one of data, fsdp, "
                      "context, expert, tensor"),
    ("model:2", "mesh spec 'model:2': 'model:2' is not AXIS:SIZE"),
    ("data:2,data:2", "mesh spec 'data:2,data:2': axis 'data' given twice"),
    ("tensor:x", "mesh spec 'tensor:x': size 'x' of 'tensor' is not an integer"),
    ("data:4,tensor:4", "mesh spec 'data:4,tensor:4' needs 16 devices, but only 8 exist"),
])
def test_bad_mesh_specs_name_the_problem(spec, message):
    with pytest.raises(MeshError, match="^" + re.escape(message)):
        sampling_mesh(spec)


def test_a_mesh_that_does_not_fit_the_model_names_each_dimension():
    with pytest.raises(MeshError) as e:
        check_sampling_fits(sampling_mesh("tensor:3"), TINY)
    split = "splits 3 ways (tensor:3) but"
    assert str(e.value) == (
        f"the sampling mesh does not fit the model: heads {split} num_attention_heads=4 is not divisible by 3; "
        f"index_heads {split} index_n_heads=8 is not divisible by 3; vocab {split} vocab_size=128 is not divisible "
        f"by 3; mlp_moe {split} moe_intermediate_size=32 is not divisible by 3; mlp {split} the shared experts' "
        f"width=32 is not divisible by 3")
    with pytest.raises(MeshError, match=r"exp splits 3 ways \(expert:3\) but n_routed_experts=8 is not divisible"):
        check_sampling_fits(sampling_mesh("expert:3"), TINY)
