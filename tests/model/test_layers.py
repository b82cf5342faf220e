"""layers.einsum: both projection impls ("xla", and "cpu_transposed_grad" with its own weight-gradient
VJP) give jnp.einsum's values and JAX's gradients; the norms' spread statistics (decode_spread_norms) give the
plain form's values; grad_reduce_dtype rounds the weight gradient within its bound."""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.layers import LayerNorm, RMSNorm, einsum, spread_mean

SPECS = [  # (spec, x shape, w shape): every projection form the model uses
    ("btd,dv->btv", (2, 6, 8), (8, 10)),
    ("btq,qhk->bthk", (2, 6, 8), (8, 3, 5)),
    ("bthv,hvd->btd", (2, 6, 3, 5), (3, 5, 8)),
    ("bthn,rhn->bthr", (2, 6, 3, 5), (4, 3, 5)),      # per-head (batched): plain einsum path
]


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "cpu_transposed_grad"])
def test_einsum_value_and_grads_match_jnp(spec, x_shape, w_shape, dtype, impl):
    x = jax.random.normal(jax.random.PRNGKey(0), x_shape)
    w = jax.random.normal(jax.random.PRNGKey(1), w_shape)

    def ours(x, w):
        return jnp.sum(jnp.sin(einsum(spec, x, w, dtype, jnp.float32, impl)))

    def plain(x, w):
        y = jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
        return jnp.sum(jnp.sin(y))

    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (ours, plain))
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(v1, v2, rtol=tol)
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def test_einsum_rejects_an_unknown_impl():
    x = jnp.ones((2, 3, 4))
    with pytest.raises(ValueError, match="unknown projection impl 'tpu'"):
        einsum("btd,dv->btv", x, jnp.ones((4, 5)), jnp.float32, impl="tpu")


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 5, 96)])     # one decode token; a batch of rows
def test_spread_norms_equal_the_plain_norms_bit_for_bit(shape):
    """``spread=True`` (RuntimeConfig.decode_spread_norms) computes RMSNorm and LayerNorm with each row's mean spread
    over the row (layers.spread_mean): the same values, bit for bit, under jit (bf16 in and out, as decoding), and a
    row mean computed by hand."""
    x = (3.0 * jax.random.normal(jax.random.PRNGKey(0), shape) + 0.5).astype(jnp.bfloat16)
    mean = np.asarray(spread_mean(np.asarray(x, np.float32)))
    assert mean.shape == shape
    row = np.asarray(x, np.float64)[-1, -1]
    np.testing.assert_allclose(mean[-1, -1], np.full(shape[-1], row.mean()), rtol=1e-5)
    for norm in (RMSNorm(1e-6, "embed"), LayerNorm(1e-6, "embed")):
        params = norm.init(jax.random.PRNGKey(1), x)
        params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.PRNGKey(2), p.shape) * 0.1, params)
        want = jax.jit(norm.apply)(params, x)
        got = jax.jit(norm.clone(spread=True).apply)(params, x)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


U_BF16 = 2.0 ** -8       # unit roundoff of bf16 (8 significant bits)


def test_bf16_grad_reduce_rounds_each_shards_partial_within_the_bound():
    """grad_dtype=bfloat16 on 8 devices, the rows sharded 8 ways and the weight FSDP-sharded: the forward is
    unchanged, and dw leaves each shard's matmul in bf16, so the partitioner reduces bf16 partials.

    Hand bound, elementwise: let p_i be shard i's exact partial x_i^T c_i and S = sum_i p_i. The fp32 path
    returns bf16(S) (the fp32 sum is exact to ~2^-24): |dw_f32 - S| <= u |S|. The bf16 path rounds each
    p_i (error <= u |p_i|) and sums n values with at most n - 1 bf16 roundings of partial sums, each
    <= u (sum_i |p_i|) (1 + u)^n, then nothing more: |dw_bf16 - S| <= n u (1 + u)^n sum_i |p_i|.
    """
    devices = np.array(jax.devices()[:8])
    n = len(devices)
    mesh = jax.sharding.Mesh(devices, ("shards",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("shards", None))
    N, D, F = 8 * n, 64, 48
    # bf16-representable inputs and cotangent: both paths then differ only in where dw is rounded
    x = jax.random.normal(jax.random.PRNGKey(0), (N, D)).astype(jnp.bfloat16).astype(jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (D, F))
    c = jax.random.normal(jax.random.PRNGKey(2), (N, F)).astype(jnp.bfloat16).astype(jnp.float32)

    def grads(grad_dtype):
        def loss(x, w):
            return jnp.sum(c * einsum("nd,df->nf", x, w, jnp.bfloat16, jnp.float32, grad_dtype=grad_dtype))
        fn = jax.jit(jax.value_and_grad(loss, (0, 1)), in_shardings=(rows, rows), out_shardings=(None, (rows, rows)))
        value, (dx, dw) = fn(x, w)
        return np.float64(value), np.asarray(dx, np.float64), np.asarray(dw, np.float64)

    (v32, dx32, dw32), (v16, dx16, dw16) = grads("float32"), grads("bfloat16")
    assert v16 == v32                                     # the forward is the same program
    np.testing.assert_array_equal(dx16, dx32)             # and so is the input gradient
    xs, cs = np.asarray(x, np.float64).reshape(n, -1, D), np.asarray(c, np.float64).reshape(n, -1, F)
    partials = np.einsum("ind,inf->idf", xs, cs)           # shard i's exact partial p_i
    S, A = partials.sum(0), np.abs(partials).sum(0)
    assert np.all(np.abs(dw32 - S) <= U_BF16 * np.abs(S) + 1e-6 * A)
    assert np.all(np.abs(dw16 - S) <= n * U_BF16 * (1 + U_BF16) ** n * A + 1e-6 * A)
    # (XLA:CPU upcasts bf16 matmuls and reductions to fp32, so here dw16 may equal dw32; the TPU program's
    # bf16 reduce-scatter is checked by test_bf16_grad_reduce_halves_the_tpu_reduce_scatter)


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
def test_bf16_grad_reduce_on_one_device_keeps_value_and_dx_and_bounds_dw(spec, x_shape, w_shape):
    """Unsharded, grad_dtype=bfloat16 changes only dw's matmul, which emits bf16: its value and dx are the
    fp32 path's. Hand bound, elementwise, with D the exact dw and A = |x|^T |c| over the K summed terms: a
    matmul rounding to bf16 only at its output (the TPU's fp32 accumulators) is within u |D|; one that
    accumulates in bf16 (XLA:CPU may) within K u (1 + u)^K A; the fp32 path within u |D| + ~2^-24 A."""
    x_dims, rest = spec.split(",")
    w_dims, out_dims = rest.split("->")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], x_shape).astype(jnp.bfloat16).astype(jnp.float32)
    w = jax.random.normal(keys[1], w_shape)
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
    c = jax.random.normal(keys[2], out_shape).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(grad_dtype):
        return lambda x, w: jnp.sum(c * einsum(spec, x, w, jnp.bfloat16, grad_dtype=grad_dtype))

    (v1, (dx1, dw1)), (v2, (dx2, dw2)) = (jax.jit(jax.value_and_grad(loss(g), (0, 1)))(x, w)
                                          for g in ("float32", "bfloat16"))
    assert v1 == v2 and dw2.dtype == dw1.dtype == jnp.float32
    np.testing.assert_array_equal(dx2, dx1)
    to_w = f"{x_dims},{out_dims}->{w_dims}"
    D = np.einsum(to_w, np.asarray(x, np.float64), np.asarray(c, np.float64))
    A = np.einsum(to_w, np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(c, np.float64)))
    K = int(np.prod([n for d, n in zip(x_dims, x_shape) if d not in w_dims]))     # terms summed per element
    dw1, dw2 = np.asarray(dw1, np.float64), np.asarray(dw2, np.float64)
    assert np.all(np.abs(dw1 - D) <= U_BF16 * np.abs(D) + 1e-6 * A)
    assert np.all(np.abs(dw2 - D) <= K * U_BF16 * (1 + U_BF16) ** K * A)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not importable")
def test_bf16_grad_reduce_halves_the_tpu_reduce_scatter():
    """Compiled for v5p:2x2x1 (AOT, no TPU needed) with the rows and the weight sharded 4 ways: the weight
    gradient's reduction over the shards is fp32 by default and bf16 with grad_dtype=bfloat16, same shape."""
    from glm5_jax.cost.chips import topology_devices

    mesh = jax.sharding.Mesh(np.array(topology_devices("v5p:2x2x1")), ("fsdp",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=sharded)
    w = jax.ShapeDtypeStruct((1024, 2048), jnp.float32, sharding=sharded)

    def reductions(grad_dtype):
        def loss(w, x):
            return jnp.sum(jnp.tanh(einsum("nd,df->nf", x, w, jnp.bfloat16, grad_dtype=grad_dtype)))
        text = jax.jit(jax.grad(loss), out_shardings=sharded).lower(w, x).compile().as_text()
        # (result type, op) of every reduce-scatter / all-reduce of an array (not the loss's scalars)
        return sorted(set(re.findall(r"= ((?:f32|bf16)\[\d+,[\d,]+\])\{[^}]*\} (reduce-scatter|all-reduce)(?:-start)?\(",
                                     text)))

    f32, bf16 = reductions("float32"), reductions("bfloat16")
    assert f32 and all(t.startswith("f32[") for t, _ in f32), f32
    assert [(t.replace("f32[", "bf16["), op) for t, op in f32] == bf16
