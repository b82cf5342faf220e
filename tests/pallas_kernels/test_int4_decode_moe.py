"""The one-call INT4 routed-expert sum for a few tokens (pallas_kernels/int4_decode_moe, interpreted) against its
XLA reference, and the reference against the INT4 block matmul's own reference applied assignment by assignment:
the tokens' K choices in token order, the chip's experts OFFSET .. OFFSET + E_local - 1 (others, below and above,
skipped), weights read from a stacked [L, E_local, ...] layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_decode_moe import kernel, ops, reference
from pallas_kernels.int4_matmul import packing
from pallas_kernels.int4_matmul.reference import int4_block_matmul

L, E, D, F, G = 2, 4, 512, 256, 32
OFFSET = E                                                  # the chip holds experts E .. 2E - 1 of 3E


def _weights(rng):
    def packed(k, n):
        q = jnp.asarray(rng.integers(-8, 8, (L, E, k, n)), jnp.int8)
        return packing.pack_grouped(q, G), jnp.asarray(rng.uniform(0.01, 0.05, (L, E, k // G, n)), jnp.bfloat16)
    return (*packed(D, F), *packed(D, F), *packed(F, D))


def _tokens(rng, n, K):
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    key = rng.integers(0, 3 * E, n * K)                   # other chips' experts below and above the chip's
    key[0], key[-1] = OFFSET - 1, OFFSET                   # one skipped, one local, whatever the draw
    return x, jnp.asarray(key, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, n * K), jnp.float32)


@pytest.mark.parametrize("n, K", [(1, 8), (2, 4), (3, 8)])
def test_kernel_equals_reference(n, K):
    rng = np.random.default_rng(n * K)
    weights, (x, key, gates) = _weights(rng), _tokens(rng, n, K)
    for layer in (0, 1):
        want = reference.int4_decode_moe(x, key, gates, *weights, layer, OFFSET, group_size=G, dtype=jnp.bfloat16)
        got = jax.jit(lambda *a: kernel.int4_decode_moe(*a, group_size=G, dtype=jnp.bfloat16, interpret=True))(
            x, key, gates, *weights, jnp.int32(layer), jnp.int32(OFFSET))
        assert got.shape == (n, D) and got.dtype == jnp.float32
        # fp32 products summed in another order; h rounded to bf16 between them
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4 * np.abs(want).max())


def test_reference_is_the_block_matmul_per_assignment():
    """Each local assignment as a one-row block through the INT4 block matmul's reference (gate, up, SwiGLU in
    bf16, down), times its gate, summed per token: the reference's values."""
    rng = np.random.default_rng(7)
    n, K = 2, 4
    weights, (x, key, gates) = _weights(rng), _tokens(rng, n, K)
    gp, gs, up, us, dp, ds = weights
    want = np.zeros((n, D), np.float32)
    for m in range(n * K):
        if not OFFSET <= int(key[m]) < OFFSET + E:
            continue
        xb, e = x[m // K].astype(jnp.bfloat16)[None, None], jnp.asarray([int(key[m]) - OFFSET])
        mm = lambda a, p, s: int4_block_matmul(a, e, 1, p, s, 1, group_size=G)  # noqa: E731
        h = (jax.nn.silu(mm(xb, gp, gs)) * mm(xb, up, us)).astype(jnp.bfloat16)
        want[m // K] += np.asarray(mm(h, dp, ds))[0, 0] * float(gates[m])
    got = reference.int4_decode_moe(x, key, gates, *weights, 1, OFFSET, group_size=G, dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ops_impls_agree_refuse_gradients_and_bad_shapes():
    rng = np.random.default_rng(3)
    weights, (x, key, gates) = _weights(rng), _tokens(rng, 1, 8)
    want = reference.int4_decode_moe(x, key, gates, *weights, 0, OFFSET, group_size=G, dtype=jnp.bfloat16)
    for impl in ("reference", "xla", "pallas_interpret"):     # "pallas": test_int4_decode_moe_tpu_compile.py
        got = ops.int4_decode_moe(x, key, gates, *weights, 0, OFFSET, group_size=G, dtype=jnp.bfloat16, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4 * np.abs(want).max())
    loss = lambda impl: lambda x_: jnp.sum(ops.int4_decode_moe(  # noqa: E731
        x_, key, gates, *weights, 0, OFFSET, group_size=G, dtype=jnp.bfloat16, impl=impl))
    assert np.isfinite(np.asarray(jax.grad(loss("xla"))(x))).all()
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss("pallas_interpret"))(x)
    with pytest.raises(ValueError, match="int4_decode_moe"):            # more assignments than the kernel unrolls
        many = jnp.zeros((kernel.MAX_ASSIGNMENTS + 8,), jnp.int32)
        kernel.int4_decode_moe(jnp.zeros((5, D)), many, jnp.zeros_like(many, jnp.float32), *weights, 0,
                               group_size=G, dtype=jnp.bfloat16, interpret=True)
