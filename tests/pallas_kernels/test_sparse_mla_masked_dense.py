"""Masked-dense sparse MLA (XLA, hand-written VJP) vs the gather reference: forward, KL target, gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_inputs import assert_close, normal
from pallas_kernels.sparse_mla import masked_dense, ops, reference
from test_sparse_mla import make_inputs

SCALE = 0.2


def loss_of(impl, idx, valid, v_dim, q_chunk=None):
    """A scalar with non-trivial cotangents on out and lse, plus the (detached) KL target."""
    extra = {} if q_chunk is None else {"q_chunk": q_chunk}
    fn = functools.partial(ops.sparse_mla, impl=impl) if not extra else functools.partial(
        masked_dense.sparse_mla, **extra)

    def loss(q, kv):
        out, lse, target = fn(q, kv, idx, valid, scale=SCALE, v_dim=v_dim, with_target=True)
        lse_term = jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0)
        return (jnp.sum(jnp.cos(out.astype(jnp.float32))) + 0.5 * jnp.sum(lse_term)
                + 3.0 * jnp.sum(target * target))

    return loss


# (B, T, H, C, v_dim, topk, q_chunk): a ragged last block, one block, k above the block size
CASES = [(2, 21, 3, 24, 16, 6, 8), (2, 12, 2, 16, 8, 5, 16), (1, 40, 2, 16, 8, 20, 8)]


@pytest.mark.parametrize("B,T,H,C,V,topk,q_chunk", CASES)
def test_forward_target_and_gradients_match_gather_reference(B, T, H, C, V, topk, q_chunk):
    q, kv, idx, valid = make_inputs(B, T, T, H, C, topk, seed=T)  # training rows: keys are the queries
    valid_np = np.asarray(valid)
    assert (~valid_np).any() and valid_np.any() and not valid_np.any(-1).all()  # padded queries see nothing
    got = jax.jit(functools.partial(masked_dense.sparse_mla, scale=SCALE, v_dim=V, q_chunk=q_chunk,
                                    with_target=True))(q, kv, idx, valid)
    want = jax.jit(functools.partial(reference.sparse_mla, scale=SCALE, v_dim=V, with_target=True))(
        q, kv, idx, valid)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g, w, 1e-5)
    np.testing.assert_allclose(np.asarray(got[2]).sum(-1)[valid_np.any(-1)], 1.0, rtol=1e-5)  # a distribution

    grads = jax.jit(jax.grad(loss_of(None, idx, valid, V, q_chunk), argnums=(0, 1)))(q, kv)
    want_grads = jax.jit(jax.grad(loss_of("reference", idx, valid, V), argnums=(0, 1)))(q, kv)
    for g, w in zip(grads, want_grads):
        assert g.dtype == jnp.float32 and np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)


def test_bf16_against_fp32_reference():
    B, T, H, C, V, topk, q_chunk = CASES[0]
    q, kv, idx, valid = make_inputs(B, T, T, H, C, topk, dtype=jnp.bfloat16, seed=5)
    out, lse = masked_dense.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V, q_chunk=q_chunk)
    q32, kv32 = q.astype(jnp.float32), kv.astype(jnp.float32)
    ref_out, ref_lse = reference.sparse_mla(q32, kv32, idx, valid, scale=SCALE, v_dim=V)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref_out, 2e-2)
    assert_close(lse, ref_lse, 1e-2)
    got = jax.grad(loss_of(None, idx, valid, V, q_chunk), argnums=(0, 1))(q, kv)
    want = jax.grad(loss_of("reference", idx, valid, V), argnums=(0, 1))(q32, kv32)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 3e-2)


def test_keys_must_be_the_query_rows():
    rng = np.random.default_rng(0)
    q, kv = normal(rng, (1, 4, 2, 8)), normal(rng, (1, 6, 8))
    idx, valid = jnp.zeros((1, 4, 2), jnp.int32), jnp.ones((1, 4, 2), bool)
    with pytest.raises(ValueError, match="keys = queries"):
        masked_dense.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=4)


def test_dense_prefix_takes_whole_causal_blocks():
    # causal 128-query blocks scoring <= 4 x 256 keys: all of T=1024, the first 1024 queries of T=4096
    assert masked_dense.dense_prefix(1024, 256, 128, 4.0) == 1024
    assert masked_dense.dense_prefix(4096, 256, 128, 4.0) == 1024
    assert masked_dense.dense_prefix(4096, 400, 128, 4.0) == 1536   # whole blocks only: 1600 -> 1536
    assert masked_dense.dense_prefix(4096, 16, 128, 4.0) == 0       # small k: every block gathers
