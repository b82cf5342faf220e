"""Real Mosaic compile of the one-call INT4 routed-expert sum for v5p (AOT from a CPU host via libtpu) at the 744B
decode's per-chip shapes, batch 1 on `expert:8,tensor:8`: D = 6144, each chip's 32 experts 256 wide (2048 over
tensor 8), INT4 groups of 32, the token's 8 assignments, weights stacked over a few layers and read by the layer
index. Needs libtpu; skipped without it."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.sharding import PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost.kernels import decode_moe_fetch_fraction, kernel_cost, table_fraction  # noqa: E402
from glm5_jax.cost.hlo_cost.mosaic_grid import kernel_grid  # noqa: E402
from pallas_kernels.int4_decode_moe import kernel  # noqa: E402
from tests.pallas_kernels.int4_expert_compile import (  # noqa: E402
    EXPERTS, expert_mesh, replicated, stacked_int4_weights)

L, E_LOCAL, D, F, G, M = 3, 32, 6144, 256, 32, 8


def test_layer_loop_reads_the_stacked_experts_in_place():
    """A loop over layers (as the decode layer scan runs it): the stacked packed experts are the kernel's
    operands (no per-layer copy: the temporaries hold less than one expert's weights). Declared cost by hand for
    2.5 expected local assignments: three products on 16 token rows each, the packed words and bf16 scales of
    three [6144 x 256] weights each, the token row read (fp32) and the output row written (bf16)."""
    mesh = expert_mesh()
    args = (replicated(mesh, (1, D), jnp.float32), replicated(mesh, (M,), jnp.int32),
            replicated(mesh, (M,), jnp.float32), *stacked_int4_weights(mesh, L, E_LOCAL, D, F, G))

    def layers(x, key, gates, *w):
        def layer(i, acc):
            return acc + kernel.int4_decode_moe(x + acc, key, gates, *w, i, jax.lax.axis_index("expert") * E_LOCAL,
                                                group_size=G, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
                                                cost_assignments=2.5).astype(jnp.float32)
        return jax.lax.fori_loop(0, L, layer, jnp.zeros((1, D), jnp.float32))

    f = jax.shard_map(layers, mesh=mesh, in_specs=(P(), P(), P()) + (EXPERTS,) * 6, out_specs=P(), check_vma=False)
    compiled = jax.jit(f).lower(*args).compile()
    one_expert = 3 * D * F // 2
    assert compiled.memory_analysis().temp_size_in_bytes < one_expert
    line = next(x for x in compiled.as_text().splitlines() if "tpu_custom_call" in x and kernel.NAME in x)
    flops = round(2.5 * 2 * 16 * 3 * D * F)
    nbytes = round(2.5 * 3 * (D * F // 2 + D // G * F * 2) + D * (4 + 2))
    assert kernel_cost(line.split("custom-call(")[0], [], line) == (float(flops), nbytes)
    # the cost model's grid rule: a weight block is fetched once per expected local assignment (2.5 of the 8
    # steps), not per step, and x / the output once: the grid's bytes are the declared bytes
    grid = kernel_grid(line)
    assert grid.name == kernel.NAME and grid.bounds == (M,) and not any(grid.parallel)
    assert decode_moe_fetch_fraction(grid, line) == pytest.approx(2.5 / M)
    assert grid.window_bytes(1.0, table_fraction(grid, line)) == pytest.approx(nbytes)
