"""The sorted row scatter-add kernel (pallas_kernels/row_scatter, interpreted) against XLA's scatter-add."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.row_scatter import kernel, ops, packing


def _updates(rng, B, S, N, W, hot=None):
    d = jnp.asarray(rng.normal(size=(B, S, W)), jnp.float32)
    rows = jnp.asarray(rng.normal(size=(B, N, W)), jnp.float32)
    target = rng.integers(0, S, (B, N)) if hot is None else rng.choice(hot, (B, N))
    valid = rng.uniform(size=(B, N)) < 0.85
    return d, rows, jnp.asarray(target, jnp.int32), jnp.asarray(valid)


@pytest.mark.parametrize("S, N, W, window, hot, parts", [
    (203, 700, 128, 16, None, 2),           # ~3.4 updates per row: each part's window walks its half
    (203, 700, 128, 16, None, 1),           # one part (one core) walks the whole array
    (203, 90, 256, 24, (0, 1, 7, 8, 100, 199, 200, 202), 2),   # repeated rows, jumps, the last window clamped
    (203, 300, 128, 16, tuple(range(12)), 2),       # every target below one window: the cut clamped to it,
    (203, 300, 128, 16, tuple(range(190, 203)), 2),  # or above the last one: one part adds everything
    (40, 120, 128, 16, None, 2),            # S_pad = 40 < 2 windows: one part
])
def test_kernel_equals_xla_scatter_add(S, N, W, window, hot, parts):
    """Two batch rows, updates in blocks of 64 (the last one padded), duplicates within and across blocks,
    masked updates dropped, S not a multiple of 8: the kernel's sums equal XLA's scatter-add, cut over two
    parts (one per TensorCore) or walked by one."""
    d, rows, target, valid = _updates(np.random.default_rng(S + N), 2, S, N, W, hot and np.array(hot))
    masked = jnp.where(valid, target, S)
    want = jax.jit(lambda *a: ops.row_scatter_add(*a, impl="reference"))(d, rows, target, valid)
    order = jnp.argsort(masked, axis=1, stable=True)
    got = jax.jit(lambda d, r, o, t: kernel.sorted_row_scatter_add(d, r[:, :, None], o, t, block=64, window=window,
                                                                   parts=parts, interpret=True))(
        d, rows, order, jnp.take_along_axis(masked, order, axis=1))
    assert float(jnp.max(jnp.abs(want - d))) > 1.0            # the updates changed d
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


def test_parts_cut_at_the_median_row_and_share_one_block():
    """Hand count of the cut: 100 sorted targets 2 x i (rows 0..198 of S = 203, S_pad = 208), the last 10
    masked (sentinel 203), blocks of 8, windows of 16. The median valid update (45 of 90) targets row 90: the
    cut is row 88; 44 targets lie below it (blocks [0, 6)), the other 46 from update 44 (blocks [5, 12), block 5
    read by both); the grid runs 7 blocks a part. Clamped: a median below row 16 cuts at 16, above row 192 at
    192 (each side keeps a whole window)."""
    target = jnp.where(jnp.arange(100) < 90, 2 * jnp.arange(100), 203)[None].astype(jnp.int32)
    split, blocks = kernel._part_blocks(target, n_parts=2, n_rows=203, n_rows_pad=208, window=16, block=8)
    assert split.tolist() == [88]
    assert blocks.tolist() == [0, 6, 5, 12, 7]
    low = jnp.full((1, 100), 3, jnp.int32)
    high = jnp.full((1, 100), 200, jnp.int32)
    assert kernel._part_blocks(low, n_parts=2, n_rows=203, n_rows_pad=208, window=16, block=8)[0].tolist() == [16]
    split, blocks = kernel._part_blocks(high, n_parts=2, n_rows=203, n_rows_pad=208, window=16, block=8)
    assert split.tolist() == [192] and blocks.tolist() == [0, 0, 0, 13, 13]
    split, blocks = kernel._part_blocks(target, n_parts=1, n_rows=203, n_rows_pad=208, window=16, block=8)
    assert split.tolist() == [208] and blocks.tolist() == [0, 12, 12]


def test_ops_gradients_and_impl_switch():
    """Through ops (sorting included): values and gradients of a weighted sum equal the XLA path's; d's
    gradient is the weight, an update's is the weight's row at its target (zero where masked)."""
    d, rows, target, valid = _updates(np.random.default_rng(3), 1, 50, 200, 128)
    weight = jnp.asarray(np.random.default_rng(4).normal(size=d.shape), jnp.float32)

    def loss(impl):
        return lambda d, rows: jnp.sum(ops.row_scatter_add(d, rows, target, valid, impl=impl) * weight)

    (value, grads), (want_value, want_grads) = (jax.jit(jax.value_and_grad(loss(impl), argnums=(0, 1)))(d, rows)
                                                for impl in ("pallas_interpret", "xla"))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(weight))
    want_rows = np.where(np.asarray(valid)[0, :, None], np.asarray(weight)[0, np.asarray(target)[0]], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1])[0], want_rows)
    np.testing.assert_array_equal(np.asarray(want_grads[1])[0], want_rows)
    with pytest.raises(ValueError, match="unknown impl"):
        ops.row_scatter_add(d, rows, target, impl="cuda")
    with pytest.raises(ValueError, match="W a multiple of 128"):
        kernel.sorted_row_scatter_add(d[..., :100], rows[:, :, None, :100], target, target)
    with pytest.raises(ValueError, match="parts is 1 or 2"):
        kernel.sorted_row_scatter_add(d, rows[:, :, None], target, target, parts=3)


def test_packed_bf16_rows_are_added_as_their_bf16_roundings():
    """Rows of 640 values packed as bf16 pairs in 384 uint32 lanes (lane j: column j high, j + 384 low; the
    columns past 640 zero): unpacking gives exactly the bf16 roundings, and the kernel (interpreted, through
    ops) adds them like XLA's scatter-add of the rounded rows; the XLA path takes packed rows too."""
    d, rows, target, valid = _updates(np.random.default_rng(7), 2, 61, 150, 640)
    packed = packing.pack_bf16_pairs(rows)
    assert packed.shape == (2, 150, 384) and packed.dtype == jnp.uint32
    rounded = rows.astype(jnp.bfloat16).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(rounded - rows))) > 0
    np.testing.assert_array_equal(packing.unpack_bf16_pairs(packed, 640), rounded)
    np.testing.assert_array_equal(packing.unpack_bf16_pairs(packed, 768)[..., 640:], 0.0)
    # bf16 input (its bit patterns shifted into place) packs exactly as its fp32 upcast
    np.testing.assert_array_equal(packing.pack_bf16_pairs(rows.astype(jnp.bfloat16)), packed)
    want = ops.row_scatter_add(d, rounded, target, valid, impl="reference")
    for impl in ("xla", "pallas_interpret"):
        got = jax.jit(lambda d, p: ops.row_scatter_add(d, p, target, valid, impl=impl))(d, packed)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="packed"):
        kernel.sorted_row_scatter_add(d, packed[:, :, None, :256], target, target)
