"""glm5_jax.cost.hlo_cost on Mosaic custom calls of a real v5p compile (libtpu, no TPU): a Pallas kernel is
counted by its declared `pl.CostEstimate`, `ragged_dot`'s Mosaic lowering by its own estimate, plain
matmuls as compiler-visible FLOPs; the two kinds are reported apart."""
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from glm5_jax.cost.hlo_cost import hlo_cost

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

M, K, N = 128, 256, 128
ROWS, GROUPS, OUT = 512, 4, 384
# what the kernel declares (any number will do: the counter must report the declaration, not a guess)
DECLARED_FLOPS, DECLARED_BYTES = 2 * M * K * N + 12345, 3 * 65536


def _matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


def _step(x, w, lhs, rhs, group_sizes):
    pallas_out = pl.pallas_call(
        _matmul_kernel, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        cost_estimate=pl.CostEstimate(flops=DECLARED_FLOPS, transcendentals=0, bytes_accessed=DECLARED_BYTES))(x, w)
    grouped = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    plain = jnp.dot(x, w, preferred_element_type=jnp.float32)        # compiler-visible
    return pallas_out + plain, grouped


def test_pallas_cost_estimate_and_ragged_dot_on_v5p():
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    s = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(shape, dt, sharding=s) for shape, dt in [
        ((M, K), jnp.bfloat16), ((K, N), jnp.bfloat16), ((ROWS, K), jnp.bfloat16), ((GROUPS, K, OUT), jnp.bfloat16),
        ((GROUPS,), jnp.int32)]]
    # the test suite's "highest" matmul precision has no bf16 Mosaic form
    with jax.default_matmul_precision("default"):
        cost = hlo_cost(jax.jit(_step).lower(*args).compile().as_text())
    # the Pallas call as declared + the ragged dot: every row against one group's [K, OUT] weight
    assert cost.kernel_flops == DECLARED_FLOPS + 2 * ROWS * K * OUT
    assert cost.flops == 2 * M * K * N
    assert cost.total_flops == cost.flops + cost.kernel_flops
    assert cost.uncounted_custom_calls == []
