"""The fused sparse MLA decode kernel (pallas_kernels/sparse_mla_decode, interpreted) against its XLA reference,
and the reference against the model's two-pass decode (the row gather, then decode_rows.attend_with_new_rows):
one token per batch row over its selected latent rows of one layer of a stacked cache, its own new row at slot
pos (not yet cached), invalid slots masked, out-of-range slots and layers clamped."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model import decode_rows
from pallas_kernels.row_gather.reference import stacked_row_gather
from pallas_kernels.sparse_mla_decode import kernel, ops, reference

SCALE = 0.07


def _inputs(rng, L, B, S, C, K, H, dtype):
    cache = jnp.asarray(rng.normal(size=(L, B, S, C)), jnp.float32).astype(dtype)
    idx = rng.integers(0, S, (B, K))
    idx[:, 0], idx[:, 1] = -3, S + 5                      # clamped into range, as XLA's gather clamps
    pos = rng.integers(1, S, B)
    idx[:, 2] = pos                                       # the token's own slot: its new row, not the cache's
    valid = rng.random((B, K)) > 0.25
    valid[:, 2] = True
    q = jnp.asarray(rng.normal(size=(B, H, C)), jnp.float32).astype(dtype)
    new = jnp.asarray(rng.normal(size=(B, C)), jnp.float32).astype(dtype)
    return cache, jnp.asarray(idx, jnp.int32), jnp.asarray(valid), q, new, jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("dtype, B, K, H, C, V", [
    (jnp.bfloat16, 2, 40, 4, 576, 512),   # GLM-5's latent row (kv_lora 512 + rope 64: 4.5 lane tiles); K padded to 48
    (jnp.bfloat16, 1, 64, 8, 576, 512),   # one batch row (decoding batch 1): one grid step
    (jnp.float32, 3, 24, 2, 160, 128),
])
def test_kernel_equals_reference(dtype, B, K, H, C, V):
    L, S = 3, 64
    args = _inputs(np.random.default_rng(K), L, B, S, C, K, H, dtype)
    cache, idx, valid, q, new, pos = args
    for layer in (0, 2, 9):                               # 9: clamped to the last layer
        want = reference.sparse_mla_decode(cache, jnp.int32(layer), idx, valid, q, new, pos, scale=SCALE, v_dim=V)
        got = jax.jit(lambda *a: kernel.sparse_mla_decode(*a, scale=SCALE, v_dim=V, interpret=True))(
            cache, jnp.int32(layer), idx, valid, q, new, pos)
        assert got.shape == (B, H, V) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6, rtol=0)
    # the new row counts: with it replaced by the cached row the output changes
    cached_row = cache[2, jnp.arange(B), pos]
    other = reference.sparse_mla_decode(cache, jnp.int32(2), idx, valid, q, cached_row, pos, scale=SCALE, v_dim=V)
    assert np.abs(np.asarray(other, np.float32) - np.asarray(want, np.float32)).max() > 1e-3


def test_reference_equals_the_two_pass_decode_attention():
    """The reference computes what the model's decode did in two passes (rows gathered, then attended with the
    new row placed at its slot), at one token per batch row: the same values."""
    L, B, S, C, K, H, V = 2, 3, 48, 96, 16, 4, 64
    cache, idx, valid, q, new, pos = _inputs(np.random.default_rng(5), L, B, S, C, K, H, jnp.float32)
    idx = jnp.clip(idx, 0, S - 1)                         # the model's selection is in range
    cached = stacked_row_gather(cache, jnp.int32(1), idx)
    want = decode_rows.attend_with_new_rows(q[:, None], cached[:, None], new[:, None], idx[:, None], valid[:, None],
                                            pos[:, None], scale=SCALE, v_dim=V)[:, 0]
    got = reference.sparse_mla_decode(cache, jnp.int32(1), idx, valid, q, new, pos, scale=SCALE, v_dim=V)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_ops_impls_agree_and_the_kernel_refuses_gradients():
    cache, idx, valid, q, new, pos = _inputs(np.random.default_rng(2), 2, 2, 32, 128, 16, 2, jnp.float32)
    layer = jnp.int32(1)
    want = reference.sparse_mla_decode(cache, layer, idx, valid, q, new, pos, scale=SCALE, v_dim=64)
    for impl in ("reference", "xla", "pallas_interpret"):   # "pallas": test_sparse_mla_decode_tpu_compile.py
        np.testing.assert_allclose(np.asarray(ops.sparse_mla_decode(cache, layer, idx, valid, q, new, pos,
                                                                    scale=SCALE, v_dim=64, impl=impl)),
                                   np.asarray(want), atol=1e-6)
    loss = lambda impl: lambda q_: jnp.sum(ops.sparse_mla_decode(  # noqa: E731
        cache, layer, idx, valid, q_, new, pos, scale=SCALE, v_dim=64, impl=impl))
    assert np.isfinite(np.asarray(jax.grad(loss("xla"))(q))).all()
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss("pallas_interpret"))(q)
    with pytest.raises(ValueError, match="unknown impl"):
        ops.sparse_mla_decode(cache, layer, idx, valid, q, new, pos, scale=SCALE, v_dim=64, impl="triton")


def test_a_slice_past_vmem_is_refused():
    """One batch row's layer slice must stream through VMEM: 200K slots of GLM-5's 576-wide rows do not."""
    S, C = 204_800, 576
    assert kernel.fits(8192, C, 2) and not kernel.fits(S, C, 2)
    cache = jax.ShapeDtypeStruct((2, 1, S, C), jnp.bfloat16)
    with pytest.raises(ValueError, match="one slice"):
        jax.eval_shape(lambda c: kernel.sparse_mla_decode(
            c, jnp.int32(0), jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), bool), jnp.zeros((1, 2, C), jnp.bfloat16),
            jnp.zeros((1, C), jnp.bfloat16), jnp.zeros((1,), jnp.int32), scale=SCALE, v_dim=512), cache)
