"""The same model and weights give the same logits with the XLA reference and the Pallas kernels
(interpret mode on CPU), on one device and on a mesh where the kernels run inside shard_map."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax.sharding import NamedSharding

from glm5_jax import Transformer
from glm5_jax.sharding import DEFAULT_RULES, MeshConfig, build_mesh
from tests.model.test_model_properties import TINY

CFG = TINY.replace(num_nextn_predict_layers=0, mtp_depth=0)


def _logits(cfg, variables, tokens, mesh=None):
    fn = lambda v, t: Transformer(cfg).apply(v, t).logits
    if mesh is None:
        return np.asarray(jax.jit(fn)(variables, tokens))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        batch = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq")))
        return np.asarray(jax.jit(fn)(variables, jax.device_put(tokens, batch)))


def test_pallas_interpret_matches_xla_on_one_device_and_on_a_mesh():
    variables = meta.unbox(jax.jit(Transformer(CFG).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 3 * CFG.index_topk)), jnp.int32)
    ref = _logits(CFG, variables, tokens)
    pallas = CFG.replace(attention_impl="pallas_interpret")
    np.testing.assert_allclose(_logits(pallas, variables, tokens), ref, atol=2e-5, rtol=0)
    mesh = build_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=2), jax.devices()[:4])
    np.testing.assert_allclose(_logits(pallas, variables, tokens, mesh), ref, atol=2e-5, rtol=0)
