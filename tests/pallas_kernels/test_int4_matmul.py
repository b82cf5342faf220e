"""The INT4 grouped dequantise-matmul: Pallas kernel (interpreted) against the XLA reference, forward and
activation gradient, and the MoE on packed experts through the kernel against the dequantised XLA MoE."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer
from glm5_jax.model.moe.int4_weights import quantize_params
from glm5_jax.quant import int4
from pallas_kernels.int4_matmul import ops
from tests.generate.tiny_models import init_variables
from tests.quant.quant_helpers import TINY_Q

G = 8


def operands(dtype, n=5, m=16, K=128, N=256, E=3, n_used=4, seed=0):
    kx, kw, ke = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, m, K)).astype(dtype)
    w = jax.random.normal(kw, (E, K, N)) * 0.1
    packed, scale = int4.quantize_packed(w, G)
    block_expert = jax.random.randint(ke, (n,), 0, E)
    return x, block_expert, jnp.int32(n_used), packed, scale


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_kernel_matches_reference_forward_and_gradient(dtype, tol):
    x, be, n_used, packed, scale = operands(dtype)
    run = lambda impl, x: ops.int4_block_matmul(x, be, n_used, packed, scale, group_size=G, impl=impl)
    # small tiles so the grid really loops over output and contraction tiles
    kernel_y = jax.jit(lambda x: ops.kernel.int4_block_matmul(x, be, n_used, packed, scale, group_size=G,
                                                              tile_n=128, tile_k=64, interpret=True))(x)
    ref_y = run("xla", x)
    np.testing.assert_allclose(kernel_y, ref_y, rtol=tol, atol=tol)
    np.testing.assert_allclose(run("pallas_interpret", x), ref_y, rtol=tol, atol=tol)
    assert np.all(np.asarray(kernel_y)[4:] == 0) and np.abs(np.asarray(ref_y)[:4]).min() >= 0
    # independent check of block 0: numpy dequantisation of its expert and a float64 product
    w0 = np.asarray(int4.unpack_grouped(packed, G)[be[0]], np.float64) * np.repeat(
        np.asarray(scale[be[0]], np.float64), G, axis=0)
    np.testing.assert_allclose(ref_y[0], np.asarray(x[0], np.float64) @ w0, rtol=tol, atol=tol)

    dy = jax.random.normal(jax.random.key(5), ref_y.shape)
    grads = [jax.grad(lambda x: jnp.sum(run(impl, x) * dy))(x) for impl in ("xla", "pallas_interpret")]
    w_blocks = np.asarray(jax.vmap(lambda e: int4.dequantize_packed(packed[e], scale[e], G))(be), np.float64)
    expected = np.einsum("nmf,nkf->nmk", np.asarray(dy, np.float64), w_blocks)
    expected[4:] = 0
    for g in grads:
        np.testing.assert_allclose(np.asarray(g, np.float32), expected, rtol=tol, atol=tol)


def test_kernel_rejects_mismatched_shapes():
    x, be, n_used, packed, scale = operands(jnp.float32)
    with pytest.raises(ValueError, match="groups of"):
        ops.int4_block_matmul(x[..., :64], be, n_used, packed, scale, group_size=G, impl="pallas_interpret")


def test_model_on_packed_experts_through_the_kernel_matches_xla_int4():
    cfg = TINY_Q.replace(mtp_depth=0, num_nextn_predict_layers=0)
    variables = init_variables(cfg)
    int4_vars = {**variables, "params": quantize_params(variables["params"], cfg)}
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)

    def logits(c):
        return np.asarray(jax.jit(lambda v, t: Transformer(c).apply(v, t).logits)(int4_vars, tokens))

    np.testing.assert_allclose(logits(cfg.replace(quant="int4", quant_matmul="pallas_interpret")),
                               logits(cfg.replace(quant="int4")), rtol=1e-5, atol=1e-5)


def test_stacked_layers_read_in_place_equal_the_layer_slice():
    """Weights stacked over layers [L, E, ...] with the layer index: the same numbers as the layer's slice."""
    x, be, n_used, packed, scale = operands(jnp.float32)
    stacked_p = jnp.stack([packed[::-1], packed, packed[::-1] * 0])      # layer 1 is `packed`
    stacked_s = jnp.stack([scale[::-1], scale, scale[::-1]])
    want = ops.int4_block_matmul(x, be, n_used, packed, scale, group_size=G, impl="xla")
    for impl in ("xla", "pallas_interpret"):
        got = jax.jit(lambda x, layer: ops.int4_block_matmul(x, be, n_used, stacked_p, stacked_s, group_size=G,
                                                             impl=impl, layer=layer))(x, jnp.int32(1))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        other = ops.int4_block_matmul(x, be, n_used, stacked_p, stacked_s, group_size=G, impl=impl,
                                      layer=jnp.int32(0))
        assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-2      # another layer, other numbers
    dx = jax.grad(lambda x: jnp.sum(ops.int4_block_matmul(x, be, n_used, stacked_p, stacked_s, group_size=G,
                                                          impl="pallas_interpret", layer=jnp.int32(1))))(x)
    want_dx = jax.grad(lambda x: jnp.sum(ops.int4_block_matmul(x, be, n_used, packed, scale, group_size=G)))(x)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
