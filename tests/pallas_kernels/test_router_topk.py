"""The router's top-k kernel (pallas_kernels/router_topk, interpreted) against its XLA reference and against
glm5_jax/model/moe/layer.route with the XLA router: the same experts in the same order (ties to the lower
index), gates within fp32 rounding; per token shard on a mesh."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.moe.layer import route
from pallas_kernels.router_topk import kernel, ops, reference
from tests.quant.quant_helpers import TINY_Q


def _scores(rng, N, E):
    scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(N, E)), jnp.float32))
    scores = scores.at[0, 3].set(scores[0, 9])                  # a tie within a row
    return scores, jnp.asarray(rng.normal(size=(E,)) * 0.02, jnp.float32)


@pytest.mark.parametrize("N, E, K, normalize", [(1, 256, 8, True), (5, 64, 4, False), (16, 32, 8, True)])
def test_kernel_equals_reference(N, E, K, normalize):
    scores, bias = _scores(np.random.default_rng(N * E), N, E)
    bias = bias.at[9].set(bias[3])                               # the tie survives the bias
    want_idx, want_gates = reference.route_topk(scores, bias, top_k=K, normalize=normalize, scale=2.5)
    idx, gates = jax.jit(lambda s, b: kernel.route_topk(s, b, top_k=K, normalize=normalize, scale=2.5,
                                                        interpret=True))(scores, bias)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(gates), np.asarray(want_gates), rtol=1e-6, atol=0)
    if N == 1:                                                   # lane 3 and 9 tie: 3 first when both are chosen
        row = list(np.asarray(idx)[0])
        assert 3 not in row or 9 not in row or row.index(3) < row.index(9)


def test_route_with_the_kernel_equals_route_with_xla_on_a_mesh():
    """`route` under router_impl="pallas_interpret" (the kernel per token shard of data:2,expert:4, 8 tokens) and
    with the XLA router: the same experts, gates within 1e-6; the kernel refuses gradients, the XLA impl
    differentiates."""
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec

    cfg = TINY_Q.replace(n_group=1, topk_group=1)                # GLM-5's router: no expert groups
    scores, bias = _scores(np.random.default_rng(0), 8, cfg.n_routed_experts)
    want_idx, want_gates = jax.jit(lambda s, b: route(s, b, cfg))(scores, bias)
    mesh = build_mesh(parse_mesh_spec("data:2,expert:4", SAMPLING_RULES), jax.devices()[:8])
    with jax.set_mesh(mesh), nn.logical_axis_rules(SAMPLING_RULES):
        routed = lambda s, b: route(s, b, cfg.replace(router_impl="pallas_interpret"))  # noqa: E731
        assert f"name={kernel.NAME}" in str(jax.make_jaxpr(routed)(scores, bias))
        idx, gates = jax.jit(routed)(scores, bias)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(gates), np.asarray(want_gates), rtol=1e-6, atol=0)
    loss = lambda impl: lambda s: jnp.sum(ops.route_topk(s, bias, top_k=4, normalize=True, scale=1.0,  # noqa: E731
                                                         impl=impl)[1])
    assert np.isfinite(np.asarray(jax.grad(loss("xla"))(scores))).all()
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss("pallas_interpret"))(scores)
