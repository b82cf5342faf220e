"""mHC mixers (glm5_jax/model/hyper_connections.py) against a hand-written form of transformers'
Glm5NextTextHyperConnection math: the fp32 projection of the flattened, RMS-normed streams and the Sinkhorn
normalisation, unrolled or looped."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.hyper_connections import sinkhorn


def _sinkhorn_by_hand(comb, iters, eps):
    comb = np.asarray(comb, np.float64)
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return comb


@pytest.mark.parametrize("unroll", [False, True])
def test_sinkhorn_unrolled_or_looped_is_the_alternating_normalisation(unroll):
    rng = np.random.default_rng(0)
    comb = jnp.asarray(jax.nn.softmax(rng.standard_normal((2, 5, 4, 4)) * 3, axis=-1) + 1e-6, jnp.float32)
    got = np.asarray(sinkhorn(comb, 20, 1e-6, unroll=unroll))
    np.testing.assert_allclose(got, _sinkhorn_by_hand(comb, 20, 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)   # the last step normalises the columns


def test_sinkhorn_gradients_agree_unrolled_and_looped():
    rng = np.random.default_rng(1)
    comb = jnp.asarray(jax.nn.softmax(rng.standard_normal((3, 4, 4)), axis=-1) + 1e-6, jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4, 4)), jnp.float32)
    grads = [jax.grad(lambda c: jnp.sum(w * sinkhorn(c, 20, 1e-6, unroll=u)))(comb) for u in (False, True)]
    assert float(jnp.abs(grads[0]).max()) > 1e-3
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(grads[0]), rtol=1e-5, atol=1e-6)
