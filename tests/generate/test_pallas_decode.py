"""Generation with the Pallas DSA kernels (Pallas interpreter on CPU): the decode-time top-k over the
cache runs the indexer kernel and the attention runs the sparse kernel over the cache's latent rows.
Greedy tokens and their log-probs equal the XLA path's, on one device and, for a batch of 1 (which no
batch axis divides), under a data-parallel mesh where the kernels run inside shard_map."""
import flax.linen as nn
import jax
import numpy as np

from glm5_jax.generate.decoding import generate
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from tests.generate.test_generate import LENGTHS, N, prompts
from tests.generate.tiny_models import TINY, init_variables


def greedy(cfg, variables, prompt, lengths):
    return generate(cfg, variables, prompt, lengths, max_new_tokens=N, temperature=0.0)


def test_pallas_decode_equals_xla_decode():
    variables = init_variables(TINY)
    prompt = prompts(TINY)
    pallas_cfg = TINY.replace(attention_impl="pallas_interpret")
    want = greedy(TINY, variables, prompt, LENGTHS)
    got = greedy(pallas_cfg, variables, prompt, LENGTHS)
    assert int(np.max(want.lengths)) + LENGTHS.max() > 2 * TINY.index_topk       # selection drops keys
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)

    mesh = build_mesh(MeshConfig(data=2, fsdp=2, expert=1, tensor=1), jax.devices()[:4])
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        one = greedy(pallas_cfg, variables, prompt[1:], LENGTHS[1:])
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(want.tokens)[1:])
