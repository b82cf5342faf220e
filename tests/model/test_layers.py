"""layers.einsum: both projection impls ("xla", and "cpu_transposed_grad" with its own weight-gradient
VJP) give jnp.einsum's values and JAX's gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.layers import einsum

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
