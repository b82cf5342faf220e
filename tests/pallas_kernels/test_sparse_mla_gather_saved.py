"""Gather form with saved probabilities (XLA, hand-written VJP) vs the reference JAX differentiates."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_inputs import assert_close
from pallas_kernels.sparse_mla import gather_saved, reference
from test_sparse_mla import make_inputs

SCALE = 0.2


def loss_of(fn, idx, valid, v_dim):
    """A scalar with non-trivial cotangents on out and lse (the KL target is detached in both)."""
    def loss(q, kv):
        out, lse, target = fn(q, kv, idx, valid, scale=SCALE, v_dim=v_dim, with_target=True)
        lse_term = jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0)
        return jnp.sum(jnp.cos(out.astype(jnp.float32))) + 0.5 * jnp.sum(lse_term) + 3.0 * jnp.sum(target ** 2)
    return loss


# (B, T, S, H, C, v_dim, topk, q_chunk): ragged last chunk, one chunk, more keys than queries (decode-like)
@pytest.mark.parametrize("B,T,S,H,C,V,topk,q_chunk", [(2, 21, 21, 3, 24, 16, 6, 4), (1, 12, 12, 2, 16, 8, 5, 16),
                                                      (2, 9, 30, 2, 16, 8, 7, 2)])
def test_forward_target_and_gradients_match_reference(B, T, S, H, C, V, topk, q_chunk):
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, seed=T + S)
    assert (~np.asarray(valid)).any() and np.asarray(valid).any()
    fast = functools.partial(gather_saved.sparse_mla, q_chunk=q_chunk)
    got = jax.jit(functools.partial(fast, scale=SCALE, v_dim=V, with_target=True))(q, kv, idx, valid)
    want = jax.jit(functools.partial(reference.sparse_mla, scale=SCALE, v_dim=V, with_target=True))(q, kv, idx, valid)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g, w, 1e-5)
    grads = jax.jit(jax.grad(loss_of(fast, idx, valid, V), argnums=(0, 1)))(q, kv)
    want_grads = jax.jit(jax.grad(loss_of(reference.sparse_mla, idx, valid, V), argnums=(0, 1)))(q, kv)
    for g, w in zip(grads, want_grads):
        assert g.dtype == jnp.float32 and np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)


def test_bf16_gradients_close_to_fp32_reference():
    q, kv, idx, valid = make_inputs(2, 21, 21, 3, 24, 6, dtype=jnp.bfloat16, seed=3)
    got = jax.grad(loss_of(gather_saved.sparse_mla, idx, valid, 16), argnums=(0, 1))(q, kv)
    want = jax.grad(loss_of(reference.sparse_mla, idx, valid, 16), argnums=(0, 1))(
        q.astype(jnp.float32), kv.astype(jnp.float32))
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 3e-2)


def test_probability_budget():
    # bench_small at T=4096 (67 MB) keeps its probabilities; GLM-5 sizes (T=8192, k=2048, H=64) do not
    assert gather_saved.fits(2, 4096, 256, 8) and not gather_saved.fits(1, 8192, 2048, 64)
