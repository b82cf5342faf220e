"""The stacked row-gather kernel (pallas_kernels/row_gather, interpreted) against numpy indexing: rows idx[b, k]
of one layer of a stacked [L, B, S, C] cache, duplicates and out-of-range indices (clamped) included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.row_gather import kernel, ops


def _cache_and_indices(rng, L, B, S, C, K, dtype):
    cache = jnp.asarray(rng.normal(size=(L, B, S, C)), jnp.float32).astype(dtype)
    idx = rng.integers(0, S, (B, K))
    idx[:, :3] = idx[:, 3:6]                       # duplicates
    idx[:, 6], idx[:, 7], idx[:, 8] = -1, S, S + 1000   # out of range: clamped, as XLA's gather clamps
    idx[:, 9] = S - 1                              # the last row of the last tile group
    return cache, jnp.asarray(idx, jnp.int32)


def _numpy_gather(cache, layer, idx):
    c = np.asarray(cache.astype(jnp.float32))
    L, _, S, _ = c.shape
    rows = c[min(max(layer, 0), L - 1)]
    return np.stack([rows[b][np.clip(np.asarray(idx)[b], 0, S - 1)] for b in range(rows.shape[0])])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dtype, B, K, block, C", [
    (jnp.bfloat16, 3, 40, 16, 576),   # odd rows x 3 blocks each (K padded to 48): one grid half, row pairs split;
                                      # C = 576: 4.5 lane tiles, as GLM-5's latent row
    (jnp.bfloat16, 2, 64, 32, 576),   # 4 blocks: two parallel halves, the look-ahead crosses a batch row
    (jnp.float32, 2, 24, 16, 576),
    (jnp.bfloat16, 1, 40, 16, 576),   # one batch row (decoding batch 1): one grid step streams its slice
    (jnp.bfloat16, 2, 24, 16, 80),    # a row narrower than a lane tile: picked by a masked sum
])
def test_kernel_equals_numpy_gather(dtype, B, K, block, C, stream):
    """Both forms: tile-group DMAs per row, and each batch row's layer slice streamed whole."""
    L, S = 3, 64
    cache, idx = _cache_and_indices(np.random.default_rng(K), L, B, S, C, K, dtype)
    for layer in (0, 2, 7):                        # 7: clamped to the last layer
        got = jax.jit(lambda c, l, i: kernel.stacked_row_gather(c, l, i, block=block, interpret=True,
                                                                     stream=stream))(
            cache, jnp.int32(layer), idx)
        assert got.shape == (B, K, C) and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), _numpy_gather(cache, layer, idx))


def test_ops_impls_agree_and_the_kernel_refuses_gradients():
    cache, idx = _cache_and_indices(np.random.default_rng(1), 2, 2, 32, 128, 16, jnp.float32)
    layer = jnp.int32(1)
    want = _numpy_gather(cache, 1, idx)
    for impl in ops.IMPLS[:-1] + ("pallas_interpret",):
        if impl == "pallas":
            continue                               # Mosaic: tests/pallas_kernels/test_row_gather_tpu_compile.py
        np.testing.assert_array_equal(np.asarray(ops.stacked_row_gather(cache, layer, idx, impl=impl)), want)
    loss = lambda impl: lambda c: jnp.sum(ops.stacked_row_gather(c, layer, idx, impl=impl))  # noqa: E731
    grad = jax.grad(loss("xla"))(cache)            # XLA: each gathered row's count at its (clamped) slot
    assert float(jnp.sum(grad[1])) == idx.size * cache.shape[-1] and float(jnp.sum(jnp.abs(grad[0]))) == 0
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss("pallas_interpret"))(cache)
    with pytest.raises(ValueError, match="unknown impl"):
        ops.stacked_row_gather(cache, layer, idx, impl="triton")


def test_streamed_form_is_chosen_where_it_reads_fewer_bytes():
    """GLM-5's latent rows (C = 576, bf16): at 8K slots, 2048 tile groups (2048 x 8 x 640 x 2 bytes) are twice
    the slice (8192 x 640 x 2), so the slice streams, also for one batch row (its core reads one slice where the
    DMAs read a slice on each of two cores); at 200K slots, or an odd number of rows past one, the DMAs stay."""
    assert kernel.streams(32, 8192, 576, 2048, 2)
    assert 2048 * kernel.tile_group_bytes(576, 2) == 2 * kernel.slice_bytes(8192, 576, 2)
    assert not kernel.streams(32, 204800, 576, 2048, 2)     # 8 x K < S, and a slice past VMEM
    assert kernel.streams(1, 8192, 576, 2048, 2)
    assert not kernel.streams(3, 8192, 576, 2048, 2)        # two rows on one core, one on the other
    assert not kernel.streams(32, 8192, 576, 384, 2)        # no power-of-two index window
