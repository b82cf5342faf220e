"""The one-call INT4 SwiGLU of a chip's received rows (pallas_kernels/int4_moe_rows, interpreted) against its XLA
reference, and the reference against the INT4 block matmul's reference applied row by row: rows in expert
blocks by a slot table (padding slots, rows no slot holds), alternate blocks per part, blocks past n_used
skipped, weights read from a stacked [L, E, ...] layer, F over several grid steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_matmul import packing
from pallas_kernels.int4_matmul.reference import int4_block_matmul
from pallas_kernels.int4_moe_rows import kernel, ops, reference

L, E, D, F, G = 2, 3, 512, 512, 32
R, M = 40, 16                    # received rows, rows per block


def _weights(rng):
    def packed(k, n):
        q = jnp.asarray(rng.integers(-8, 8, (L, E, k, n)), jnp.int8)
        return packing.pack_grouped(q, G), jnp.asarray(rng.uniform(0.01, 0.05, (L, E, k // G, n)), jnp.bfloat16)
    return (*packed(D, F), *packed(D, F), *packed(F, D))


def _layout(rng, n_blocks=5):
    """A slot table of n_blocks blocks of M slots: blocks 0-3 used (experts 0, 0, 2, 1), each with a few padding
    slots (R), block 4 unused; rows 0 .. R-1 each in at most one slot, some in none."""
    rows = rng.permutation(R)
    slot = np.full((n_blocks, M), R, np.int32)
    fill = [M, 5, 11, 3]                                 # rows per used block
    start = 0
    for b, k in enumerate(fill):
        slot[b, :k] = rows[start:start + k]
        start += k
    slot[4, :2] = rows[start:start + 2]                  # an unused block's slots: never computed or written
    return jnp.asarray(slot.reshape(-1)), jnp.asarray([0, 0, 2, 1, 1], jnp.int32), jnp.int32(4)


def _rows(rng, dtype=jnp.bfloat16):
    return jnp.asarray(rng.normal(size=(R, D // 128, 128)), jnp.float32).astype(dtype)


def _held(slot, n_used):
    """The rows a used block's slot holds."""
    slot = np.asarray(slot).reshape(-1, M)[:int(n_used)]
    return np.sort(slot[slot < R])


@pytest.mark.parametrize("tile_f", [None, 256])
def test_kernel_equals_reference(tile_f):
    rng = np.random.default_rng(3)
    weights, x = _weights(rng), _rows(rng)
    slot, block_expert, n_used = _layout(rng)
    held = _held(slot, n_used)
    for layer in (0, 1):
        want = reference.int4_moe_rows(x, slot, block_expert, n_used, *weights, jnp.int32(layer), group_size=G,
                                       dtype=jnp.bfloat16)
        got = jax.jit(lambda *a: kernel.int4_moe_rows(*a, group_size=G, dtype=jnp.bfloat16, tile_f=tile_f,
                                                      interpret=True))(
            x, slot, block_expert, n_used, *weights, jnp.int32(layer))
        assert got.shape == x.shape and got.dtype == x.dtype
        # fp32 products summed chunk by chunk (the reference: in one contraction), then rounded to bf16: a bf16
        # ulp apart at most
        np.testing.assert_allclose(np.asarray(got[held], np.float32), np.asarray(want[held], np.float32),
                                   rtol=8e-3, atol=1e-3)
        assert float(jnp.abs(want[held].astype(jnp.float32)).max()) > 0.1


@pytest.mark.parametrize("n_used", [0, 1, 5])
def test_kernel_runs_every_used_block_and_no_other(n_used):
    """n_used of the 5 blocks (odd: the second part's last step past n_used skips): every row a used block holds
    equals the reference; none used (an empty dispatch) runs and writes nothing it must."""
    rng = np.random.default_rng(11)
    weights, x = _weights(rng), _rows(rng)
    slot, block_expert, _ = _layout(rng)
    n_used = jnp.int32(n_used)
    held = _held(slot, n_used)
    want = reference.int4_moe_rows(x, slot, block_expert, n_used, *weights, 0, group_size=G, dtype=jnp.bfloat16)
    got = kernel.int4_moe_rows(x, slot, block_expert, n_used, *weights, 0, group_size=G, dtype=jnp.bfloat16,
                               interpret=True)
    assert len(held) == {0: 0, 1: M, 5: M + 5 + 11 + 3 + 2}[int(n_used)]
    np.testing.assert_allclose(np.asarray(got[held], np.float32), np.asarray(want[held], np.float32),
                               rtol=8e-3, atol=1e-3)


def test_reference_is_the_block_matmul_per_row():
    """Each held row as a one-row block through the INT4 block matmul's reference (gate, up, SwiGLU in bf16,
    down) by its block's expert, rounded to the rows' dtype; rows no used slot holds are 0."""
    rng = np.random.default_rng(5)
    weights, x = _weights(rng), _rows(rng)
    slot, block_expert, n_used = _layout(rng)
    gp, gs, up, us, dp, ds = weights
    got = np.asarray(reference.int4_moe_rows(x, slot, block_expert, n_used, *weights, 1, group_size=G,
                                             dtype=jnp.bfloat16), np.float32).reshape(R, D)
    want = np.zeros((R, D), np.float32)
    for p, r in enumerate(np.asarray(slot)):
        if r == R or p // M >= int(n_used):
            continue
        e = jnp.asarray([int(block_expert[p // M])])
        mm = lambda a, w, s: int4_block_matmul(a, e, 1, w, s, 1, group_size=G)  # noqa: E731
        xr = x[r].reshape(1, 1, D)
        h = (jax.nn.silu(mm(xr, gp, gs)) * mm(xr, up, us)).astype(jnp.bfloat16)
        want[r] = np.asarray(mm(h, dp, ds).astype(jnp.bfloat16), np.float32)[0, 0]
    # the same products, XLA:CPU summing a block's rows and a single row's in other orders: a bf16 ulp apart
    np.testing.assert_allclose(got, want, rtol=8e-3, atol=1e-3)
    assert len(_held(slot, n_used)) == M + 5 + 11 + 3 and np.count_nonzero(np.abs(got).sum(1)) == M + 5 + 11 + 3


def test_impls_agree_unstacked_fp32_rows_and_refuse_gradients():
    """fp32 rows and unstacked [E, ...] weights through every impl; the Pallas impls refuse a gradient, the XLA
    ones give one; bad shapes are refused by name."""
    rng = np.random.default_rng(9)
    weights = tuple(w[0] for w in _weights(rng))
    x = _rows(rng, jnp.float32)
    slot, block_expert, n_used = _layout(rng)
    held = _held(slot, n_used)
    want = reference.int4_moe_rows(x, slot, block_expert, n_used, *weights, group_size=G, dtype=jnp.float32)
    for impl in ("reference", "xla", "pallas_interpret"):      # "pallas": test_int4_moe_rows_tpu_compile.py
        got = ops.int4_moe_rows(x, slot, block_expert, n_used, *weights, group_size=G, dtype=jnp.float32, impl=impl)
        # fp32 throughout; the kernel sums the contraction chunk by chunk, the reference in one product
        np.testing.assert_allclose(np.asarray(got[held]), np.asarray(want[held]), rtol=0,
                                   atol=2e-6 * float(jnp.abs(want).max()))
    loss = lambda impl: lambda x_: jnp.sum(ops.int4_moe_rows(  # noqa: E731
        x_, slot, block_expert, n_used, *weights, group_size=G, dtype=jnp.float32, impl=impl)[held])
    assert float(jnp.abs(jax.grad(loss("xla"))(x)).sum()) > 0
    with pytest.raises(NotImplementedError, match="int4_moe_rows"):
        jax.grad(loss("pallas_interpret"))(x)
    with pytest.raises(ValueError, match="int4_moe_rows"):
        kernel.int4_moe_rows(x[:, :3], slot, block_expert, n_used, *weights, group_size=G, dtype=jnp.float32)
