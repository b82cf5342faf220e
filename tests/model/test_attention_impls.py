"""The same model and weights give the same logits with the XLA reference and the Pallas kernels
(interpret mode on CPU), on one device and on a mesh where the kernels run inside shard_map."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax.sharding import NamedSharding

from glm5_jax import Transformer
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from tests.model.test_model_properties import TINY

CFG = TINY.replace(num_nextn_predict_layers=0, mtp_depth=0)


def _logits(cfg, variables, tokens, mesh=None, output=lambda out: out.logits):
    fn = lambda v, t: output(Transformer(cfg).apply(v, t))  # noqa: E731
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


def test_pallas_kl_target_matches_xla_with_heads_split_over_chips():
    """Sparse-stage indexer KL per layer: the Pallas forward kernel's target (a per-head-shard mean, then
    averaged over the tensor shards) gives the XLA path's KL, on one device and with heads on tensor=2."""
    cfg = CFG.replace(indexer_loss="sparse")
    variables = meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(1), jnp.zeros((1, 8), jnp.int32)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 3 * cfg.index_topk)), jnp.int32)
    kl = lambda out: out.stats.indexer_kl  # noqa: E731
    ref = _logits(cfg, variables, tokens, output=kl)
    own_indexer = _logits(cfg, variables, tokens, output=lambda out: out.stats.has_indexer_kl)
    assert own_indexer.sum() >= 2 and np.all(ref[own_indexer] > 1e-3)   # a real KL in every indexer layer
    pallas = cfg.replace(attention_impl="pallas_interpret")
    np.testing.assert_allclose(_logits(pallas, variables, tokens, output=kl), ref, rtol=1e-5, atol=1e-7)
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=2), jax.devices()[:2])
    np.testing.assert_allclose(_logits(pallas, variables, tokens, mesh, output=kl), ref, rtol=1e-5, atol=1e-7)
