"""bench/flash_dense.py (the dense baseline of bench/dsa.py) equals the reference dense absorbed MLA under a
causal mask: outputs, log-sum-exp and the gradients of both, with the diagonal and off-diagonal blocks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.flash_dense import causal_dense_mla
from pallas_kernels.masking import visible_mask
from pallas_kernels.sparse_mla.reference import dense_mla

B, T, H, C, V, BLOCK = 2, 64, 3, 12, 8, 16


def test_matches_reference_forward_and_gradients():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, C))
    kv = jax.random.normal(keys[1], (B, T, C))
    dout = jax.random.normal(keys[2], (B, T, H, V))
    dlse = jax.random.normal(keys[3], (B, T, H))
    pos, seg = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32)
    scale = C ** -0.5

    def reference(q, kv):
        return dense_mla(q, kv, visible_mask(pos, pos, seg, seg), scale=scale, v_dim=V)

    def flash(q, kv):
        return causal_dense_mla(q, kv, scale, V, BLOCK)

    def objective(fn):
        return lambda q, kv: sum(jnp.sum(a * b) for a, b in zip(fn(q, kv), (dout, dlse)))

    for got, want in zip(jax.jit(flash)(q, kv), jax.jit(reference)(q, kv)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    got = jax.jit(jax.grad(objective(flash), argnums=(0, 1)))(q, kv)
    want = jax.jit(jax.grad(objective(reference), argnums=(0, 1)))(q, kv)
    for g, w in zip(got, want):
        assert float(jnp.max(jnp.abs(w))) > 0.1
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)


def test_rejects_a_length_that_is_not_a_block_multiple():
    with pytest.raises(ValueError, match="not a multiple of block"):
        causal_dense_mla(jnp.zeros((1, 40, 1, 4)), jnp.zeros((1, 40, 4)), 1.0, 2, 16)
