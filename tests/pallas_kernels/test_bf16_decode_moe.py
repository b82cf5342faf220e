"""The one-call bf16 routed-expert sum for a few tokens (pallas_kernels/bf16_decode_moe, interpreted) against its
XLA reference, and the reference against the grouped-matmul SwiGLU of the decode's fp path
(glm5_jax/model/moe/experts.swiglu_rows) applied assignment by assignment: the tokens' K choices in token order,
the chip's experts OFFSET .. OFFSET + E_local - 1 (others, below and above, skipped), weights read from a stacked
[L, E_local, ...] layer, the expert width whole or in tiles."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.moe.experts import swiglu_rows
from pallas_kernels.bf16_decode_moe import kernel, ops, reference

L, E, D, F = 2, 4, 512, 256
OFFSET = E                                                  # the chip holds experts E .. 2E - 1 of 3E


def _weights(rng):
    w = lambda *s: jnp.asarray(rng.normal(size=s) * 0.05, jnp.bfloat16)    # noqa: E731
    return w(L, E, D, F), w(L, E, D, F), w(L, E, F, D)


def _tokens(rng, n, K):
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    key = rng.integers(0, 3 * E, n * K)                   # other chips' experts below and above the chip's
    key[0], key[-1] = OFFSET - 1, OFFSET                   # one skipped, one local, whatever the draw
    return x, jnp.asarray(key, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, n * K), jnp.float32)


@pytest.mark.parametrize("n, K, tile", [(1, 8, None), (2, 4, 128), (3, 8, None)])
def test_kernel_equals_reference(n, K, tile):
    rng = np.random.default_rng(n * K)
    weights, (x, key, gates) = _weights(rng), _tokens(rng, n, K)
    for layer in (0, 1):
        want = reference.bf16_decode_moe(x, key, gates, *weights, layer, OFFSET, dtype=jnp.bfloat16)
        got = jax.jit(lambda *a: kernel.bf16_decode_moe(*a, dtype=jnp.bfloat16, tile=tile, interpret=True))(
            x, key, gates, *weights, jnp.int32(layer), jnp.int32(OFFSET))
        assert got.shape == (n, D) and got.dtype == jnp.float32
        # fp32 products summed in another order (and over width tiles); g, u and h rounded to bf16 between them
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4 * np.abs(want).max())


def test_reference_is_the_grouped_swiglu_per_assignment():
    """Each local assignment as a one-row group through swiglu_rows (the bf16 decode path's grouped matmul:
    gate and up rounded to bf16, the SwiGLU rounded, down in fp32), times its gate, summed per token."""
    rng = np.random.default_rng(7)
    n, K = 2, 4
    weights, (x, key, gates) = _weights(rng), _tokens(rng, n, K)
    wg, wu, wd = (w[1] for w in weights)
    want = np.zeros((n, D), np.float32)
    for m in range(n * K):
        e = int(key[m]) - OFFSET
        if not 0 <= e < E:
            continue
        sizes = jnp.zeros((E,), jnp.int32).at[e].set(1)
        y = swiglu_rows(x[m // K][None], sizes, wg, wu, wd, jnp.bfloat16, "ragged_dot")
        want[m // K] += np.asarray(y)[0] * float(gates[m])
    got = reference.bf16_decode_moe(x, key, gates, *weights, 1, OFFSET, dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_width_tile_rule():
    """The widest halving of F whose double-buffered gate / up / down tiles fit the budget: 744B decode shapes
    (D = 6144) at F = 256 a chip (tensor 8) take F whole (2 x 3 x 6144 x 256 x 2 B = 18 MiB); F = 2048 (no tensor
    split) halves to 256 (at 512: 36 MiB > 24 MiB)."""
    assert kernel.width_tile(6144, 256, 2) == 256
    assert kernel.width_tile(6144, 2048, 2) == 256
    assert kernel.width_tile(6144, 2048, 2, budget=40 << 20) == 512
    assert kernel.width_tile(512, 256, 2) == 256


def test_ops_impls_agree_refuse_gradients_and_bad_shapes():
    rng = np.random.default_rng(3)
    weights, (x, key, gates) = _weights(rng), _tokens(rng, 1, 8)
    want = reference.bf16_decode_moe(x, key, gates, *weights, 0, OFFSET, dtype=jnp.bfloat16)
    for impl in ("reference", "xla", "pallas_interpret"):     # "pallas": test_bf16_decode_moe_tpu_compile.py
        got = ops.bf16_decode_moe(x, key, gates, *weights, 0, OFFSET, dtype=jnp.bfloat16, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4 * np.abs(want).max())
    loss = lambda impl: lambda x_: jnp.sum(ops.bf16_decode_moe(  # noqa: E731
        x_, key, gates, *weights, 0, OFFSET, dtype=jnp.bfloat16, impl=impl))
    assert np.isfinite(np.asarray(jax.grad(loss("xla"))(x))).all()
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss("pallas_interpret"))(x)
    with pytest.raises(ValueError, match="bf16_decode_moe"):            # more assignments than the kernel unrolls
        many = jnp.zeros((kernel.MAX_ASSIGNMENTS + 8,), jnp.int32)
        kernel.bf16_decode_moe(jnp.zeros((5, D)), many, jnp.zeros_like(many, jnp.float32), *weights, 0,
                               dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="tile"):                        # a tile that does not divide F
        kernel.bf16_decode_moe(x, key, gates, *weights, 0, dtype=jnp.bfloat16, tile=96, interpret=True)
