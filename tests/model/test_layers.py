"""layers.einsum: both projection impls ("xla", and "cpu_transposed_grad" with its own weight-gradient
VJP) give jnp.einsum's values and JAX's gradients; the norms' spread statistics (decode_spread_norms) give the
plain form's values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.layers import LayerNorm, RMSNorm, einsum, spread_mean

SPECS = [  # (spec, x shape, w shape): every projection form the model uses
    ("btd,dv->btv", (2, 6, 8), (8, 10)),
    ("btq,qhk->bthk", (2, 6, 8), (8, 3, 5)),
    ("bthv,hvd->btd", (2, 6, 3, 5), (3, 5, 8)),
    ("bthn,rhn->bthr", (2, 6, 3, 5), (4, 3, 5)),      # per-head (batched): plain einsum path
]


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "cpu_transposed_grad"])
def test_einsum_value_and_grads_match_jnp(spec, x_shape, w_shape, dtype, impl):
    x = jax.random.normal(jax.random.PRNGKey(0), x_shape)
    w = jax.random.normal(jax.random.PRNGKey(1), w_shape)

    def ours(x, w):
        return jnp.sum(jnp.sin(einsum(spec, x, w, dtype, jnp.float32, impl)))

    def plain(x, w):
        y = jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
        return jnp.sum(jnp.sin(y))

    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (ours, plain))
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(v1, v2, rtol=tol)
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def test_einsum_rejects_an_unknown_impl():
    x = jnp.ones((2, 3, 4))
    with pytest.raises(ValueError, match="unknown projection impl 'tpu'"):
        einsum("btd,dv->btv", x, jnp.ones((4, 5)), jnp.float32, impl="tpu")


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 5, 96)])     # one decode token; a batch of rows
def test_spread_norms_equal_the_plain_norms_bit_for_bit(shape):
    """``spread=True`` (RuntimeConfig.decode_spread_norms) computes RMSNorm and LayerNorm with each row's mean spread
    over the row (layers.spread_mean): the same values, bit for bit, under jit (bf16 in and out, as decoding), and a
    row mean computed by hand."""
    x = (3.0 * jax.random.normal(jax.random.PRNGKey(0), shape) + 0.5).astype(jnp.bfloat16)
    mean = np.asarray(spread_mean(np.asarray(x, np.float32)))
    assert mean.shape == shape
    row = np.asarray(x, np.float64)[-1, -1]
    np.testing.assert_allclose(mean[-1, -1], np.full(shape[-1], row.mean()), rtol=1e-5)
    for norm in (RMSNorm(1e-6, "embed"), LayerNorm(1e-6, "embed")):
        params = norm.init(jax.random.PRNGKey(1), x)
        params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.PRNGKey(2), p.shape) * 0.1, params)
        want = jax.jit(norm.apply)(params, x)
        got = jax.jit(norm.clone(spread=True).apply)(params, x)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
