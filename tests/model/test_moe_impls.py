"""The "blocked" grouped matmul computes the same routed experts as the ragged_dot reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.moe.blocked import blocked_swiglu
from glm5_jax.model.moe.layer import grouped_swiglu


def _inputs(N, E, K, D, F, seed=0, skew=False):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (N, D))
    logits = jax.random.normal(keys[1], (N, E)) + (jnp.arange(E) == 0) * 4.0 * skew   # skew: expert 0 crowded
    idx = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
    w = lambda k, shape: 0.2 * jax.random.normal(k, shape)  # noqa: E731
    return x, idx, w(keys[2], (E, D, F)), w(keys[3], (E, D, F)), w(keys[4], (E, F, D))


@pytest.mark.parametrize("N,E,K,skew,form", [(50, 8, 2, False, None), (64, 4, 3, True, None),
                                             (7, 16, 4, False, None),          # takes all_experts
                                             (3, 16, 4, False, None),          # takes per_assignment
                                             (9, 8, 2, True, "per_assignment"), (20, 8, 3, False, "all_experts")])
def test_blocked_matches_ragged_dot_forward_and_gradient(N, E, K, skew, form):
    x, idx, wg, wu, wd = _inputs(N, E, K, D=12, F=10, skew=skew)
    cot = jax.random.normal(jax.random.PRNGKey(9), (N, K, 12))

    def blocked(*args):
        return blocked_swiglu(args[0], idx, *args[1:], jnp.float32, form)

    def ragged_dot(*args):
        return grouped_swiglu(args[0], idx, *args[1:], jnp.float32, "ragged_dot")

    args = (x, wg, wu, wd)
    np.testing.assert_allclose(blocked(*args), ragged_dot(*args), rtol=1e-5, atol=1e-5)
    g_ref = jax.grad(lambda *a: jnp.sum(ragged_dot(*a) * cot), argnums=(0, 1, 2, 3))(*args)
    g_got = jax.grad(lambda *a: jnp.sum(blocked(*a) * cot), argnums=(0, 1, 2, 3))(*args)
    for a, b in zip(g_got, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_blocked_small_block_many_padded_groups():
    """Blocks much smaller than the groups, and experts with no rows at all."""
    from glm5_jax.model.moe import blocked as moe_blocked

    x, idx, wg, wu, wd = _inputs(40, 8, 1, D=6, F=5, skew=True)
    ref = grouped_swiglu(x, idx, wg, wu, wd, jnp.float32, "ragged_dot")
    flat = moe_blocked._blocked_swiglu(x[jnp.argsort(idx[:, 0], stable=True)], jnp.bincount(idx[:, 0], length=8),
                               wg, wu, wd, jnp.float32, block=3)
    got = flat[jnp.argsort(jnp.argsort(idx[:, 0], stable=True))].reshape(40, 1, 6)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_blocked_bf16_compute_matches_ragged_dot_in_bf16():
    """bf16 compute (fp32 weights cast at use): the custom block backward returns weight-dtype grads that
    match autodiff of the ragged_dot reference within bf16 rounding."""
    x, idx, wg, wu, wd = _inputs(300, 8, 2, D=16, F=12, seed=3)     # 600 rows: several 128-row blocks
    cot = jax.random.normal(jax.random.PRNGKey(4), (300, 2, 16))

    def loss(impl, *args):
        return jnp.sum(grouped_swiglu(args[0], idx, *args[1:], jnp.bfloat16, impl) * cot)

    args = (x, wg, wu, wd)
    g_ref = jax.grad(lambda *a: loss("ragged_dot", *a), argnums=(0, 1, 2, 3))(*args)
    g_got = jax.jit(jax.grad(lambda *a: loss("blocked", *a), argnums=(0, 1, 2, 3)))(*args)
    for a, b in zip(g_got, g_ref):
        assert a.dtype == b.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=0.03 * scale)
