"""The INT4 grouped dequantise-matmul: Pallas kernel (interpreted) against the XLA reference, forward and
activation gradient, on the used row blocks (the kernel's grid stops at n_used: later blocks are never
written, and `ops.block_rows` reads them as 0), its tile rule, and the MoE on packed experts through the
kernel against the dequantised XLA MoE."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer
from glm5_jax.model.moe.int4_weights import quantize_params
from glm5_jax.quant import int4
from pallas_kernels.int4_matmul import ops, tiling
from tests.generate.tiny_models import init_variables
from tests.quant.quant_helpers import TINY_Q

G = 8


def operands(dtype, n=5, m=16, K=128, N=256, E=3, n_used=4, seed=0):
    kx, kw, ke = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, m, K)).astype(dtype)
    w = jax.random.normal(kw, (E, K, N)) * 0.1
    packed, scale = int4.quantize_packed(w, G)
    block_expert = jax.random.randint(ke, (n,), 0, E)
    return x, block_expert, jnp.int32(n_used), packed, scale


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_kernel_matches_reference_forward_and_gradient(dtype, tol):
    x, be, n_used, packed, scale = operands(dtype)
    run = lambda impl, x: ops.int4_block_matmul(x, be, n_used, packed, scale, group_size=G, impl=impl)
    # small tiles so the grid really loops over output and contraction tiles
    kernel_y = jax.jit(lambda x: ops.kernel.int4_block_matmul(x, be, n_used, packed, scale, group_size=G,
                                                              tile_n=128, tile_k=64, interpret=True))(x)
    ref_y = run("xla", x)
    np.testing.assert_allclose(kernel_y[:4], ref_y[:4], rtol=tol, atol=tol)
    np.testing.assert_allclose(run("pallas_interpret", x)[:4], ref_y[:4], rtol=tol, atol=tol)
    # the grid runs the 4 used blocks only: the interpreter's uninitialised output (NaN) is left in block 4
    assert np.all(np.isnan(np.asarray(kernel_y)[4:])) and np.all(np.asarray(ref_y)[4:] == 0)
    # independent check of block 0: numpy dequantisation of its expert and a float64 product
    w0 = np.asarray(int4.unpack_grouped(packed, G)[be[0]], np.float64) * np.repeat(
        np.asarray(scale[be[0]], np.float64), G, axis=0)
    np.testing.assert_allclose(ref_y[0], np.asarray(x[0], np.float64) @ w0, rtol=tol, atol=tol)

    # rows read through block_rows: every slot, those of block 4 as 0, for both impls
    dest = jnp.array([0, 17, 63, 64, 70, 79], jnp.int32)          # blocks 0, 1, 3, 4, 4, 4 of 16 rows
    for impl in ("xla", "pallas_interpret"):
        rows = np.asarray(ops.block_rows(run(impl, x), dest, n_used))
        np.testing.assert_allclose(rows[:3], np.asarray(ref_y).reshape(-1, ref_y.shape[-1])[[0, 17, 63]],
                                   rtol=tol, atol=tol)
        assert np.all(rows[3:] == 0)

    dy = jax.random.normal(jax.random.key(5), (6, ref_y.shape[-1]))
    grads = [jax.grad(lambda x: jnp.sum(ops.block_rows(run(impl, x), dest, n_used) * dy))(x)
             for impl in ("xla", "pallas_interpret")]
    w_blocks = np.asarray(jax.vmap(lambda e: int4.dequantize_packed(packed[e], scale[e], G))(be), np.float64)
    dy_blocks = np.zeros(ref_y.shape)
    dy_blocks.reshape(-1, ref_y.shape[-1])[[0, 17, 63]] = np.asarray(dy[:3], np.float64)
    expected = np.einsum("nmf,nkf->nmk", dy_blocks, w_blocks)
    for g in grads:
        np.testing.assert_allclose(np.asarray(g, np.float32), expected, rtol=tol, atol=tol)


def test_kernel_rejects_mismatched_shapes():
    x, be, n_used, packed, scale = operands(jnp.float32)
    with pytest.raises(ValueError, match="groups of"):
        ops.int4_block_matmul(x[..., :64], be, n_used, packed, scale, group_size=G, impl="pallas_interpret")


def test_empty_dispatch_runs_one_block_of_zeros():
    """n_used = 0: the grid still has one row block (a grid may not be empty); it computes nothing, writes 0."""
    x, be, _, packed, scale = operands(jnp.float32)
    y = ops.int4_block_matmul(x, be, jnp.int32(0), packed, scale, group_size=G, impl="pallas_interpret")
    assert np.all(np.asarray(y)[0] == 0) and np.all(np.isnan(np.asarray(y)[1:]))


def test_tile_rule_at_glm5_widths():
    """16-row blocks (batch 1) at GLM-5's expert widths over tensor:8: an expert's whole weights in one step
    per TensorCore (two output tiles); 128-row blocks without the tensor split: 2 steps per core. Every
    choice within the VMEM budget, by the module's count (hand check of one: 16 x 6144 bf16 activations,
    768 x 128 words, 24 x 16 x 128 bf16 scales (8 group rows padded to 16), 16 x 128 fp32 output, double
    buffered, plus the accumulator and a [256, 128] chunk in fp32 and bf16)."""
    assert tiling.pick_tiles(16, 6144, 256, 32) == (6144, 128)              # gate / up: K = D, N = F / 8
    assert tiling.pick_tiles(16, 256, 6144, 32) == (256, 3072)              # down: K = F / 8, N = D
    assert tiling.pick_tiles(128, 6144, 2048, 32) == (3072, 1024)
    hand = 2 * (16 * 6144 * 2 + 768 * 128 * 4 + 24 * 16 * 128 * 2 + 16 * 128 * 4) + 16 * 128 * 4 + 256 * 128 * 6
    assert tiling.vmem_bytes(16, 6144, 128, 32, 2, 2) == hand
    for m, K, N in [(16, 6144, 2048), (16, 2048, 6144), (128, 2048, 6144), (128, 6144, 256)]:
        tk, tn = tiling.pick_tiles(m, K, N, 32)
        assert K % tk == 0 and N % tn == 0 and N // tn >= 2
        assert tiling.vmem_bytes(m, tk, tn, 32, 2, 2) <= tiling.VMEM_BUDGET


def test_model_on_packed_experts_through_the_kernel_matches_xla_int4():
    cfg = TINY_Q.replace(mtp_depth=0, num_nextn_predict_layers=0)
    variables = init_variables(cfg)
    int4_vars = {**variables, "params": quantize_params(variables["params"], cfg)}
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)

    def logits(c):
        return np.asarray(jax.jit(lambda v, t: Transformer(c).apply(v, t).logits)(int4_vars, tokens))

    np.testing.assert_allclose(logits(cfg.replace(quant="int4", quant_matmul="pallas_interpret")),
                               logits(cfg.replace(quant="int4")), rtol=1e-5, atol=1e-5)


def test_stacked_layers_read_in_place_equal_the_layer_slice():
    """Weights stacked over layers [L, E, ...] with the layer index: the same numbers as the layer's slice."""
    x, be, n_used, packed, scale = operands(jnp.float32)
    stacked_p = jnp.stack([packed[::-1], packed, packed[::-1] * 0])      # layer 1 is `packed`
    stacked_s = jnp.stack([scale[::-1], scale, scale[::-1]])
    want = ops.int4_block_matmul(x, be, n_used, packed, scale, group_size=G, impl="xla")
    for impl in ("xla", "pallas_interpret"):
        got = jax.jit(lambda x, layer: ops.int4_block_matmul(x, be, n_used, stacked_p, stacked_s, group_size=G,
                                                             impl=impl, layer=layer))(x, jnp.int32(1))
        np.testing.assert_allclose(got[:4], want[:4], rtol=1e-5, atol=1e-5)      # the n_used = 4 blocks
        other = ops.int4_block_matmul(x, be, n_used, stacked_p, stacked_s, group_size=G, impl=impl,
                                      layer=jnp.int32(0))
        assert np.abs(np.asarray(other)[:4] - np.asarray(want)[:4]).max() > 1e-2      # another layer, other numbers
    dx = jax.grad(lambda x: jnp.sum(ops.int4_block_matmul(x, be, n_used, stacked_p, stacked_s, group_size=G,
                                                          impl="pallas_interpret", layer=jnp.int32(1))))(x)
    want_dx = jax.grad(lambda x: jnp.sum(ops.int4_block_matmul(x, be, n_used, packed, scale, group_size=G)))(x)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
