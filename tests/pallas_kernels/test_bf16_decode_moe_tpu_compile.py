"""Real Mosaic compile of the one-call bf16 routed-expert sum for v5p (AOT from a CPU host via libtpu) at the 744B
decode's per-chip shapes, batch 1 on `expert:8,tensor:8`: D = 6144, each chip's 32 experts 256 wide (2048 over
tensor 8), the token's 8 assignments, weights stacked over a few layers and read by the layer index; and the
width-tiled form (the whole 2048 width on a chip, tiles of 256). Needs libtpu; skipped without it."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost.kernels import decode_moe_fetch_fraction, kernel_cost, table_fraction  # noqa: E402
from glm5_jax.cost.hlo_cost.mosaic_grid import kernel_grid  # noqa: E402
from pallas_kernels.bf16_decode_moe import kernel  # noqa: E402
from tests.pallas_kernels.int4_expert_compile import CHIPS, EXPERTS, expert_mesh, replicated  # noqa: E402

L, E_LOCAL, D, M = 3, 32, 6144, 8


@pytest.mark.parametrize("F", [256, 2048])
def test_layer_loop_reads_the_stacked_experts_in_place(F):
    """A loop over layers (as the decode layer scan runs it): the stacked experts are the kernel's operands (no
    per-layer copy: the temporaries hold less than one expert's weights). Declared cost by hand for 2.5 expected
    local assignments: three products on 16 token rows each, three [6144 x F] bf16 weights each, the token row
    read (fp32) and the output row written (bf16); the cost model's grid rule fetches each width tile once per
    expected local assignment, so the grid's bytes are the declared bytes."""
    mesh = expert_mesh()
    stacked = lambda k, n: jax.ShapeDtypeStruct((L, CHIPS * E_LOCAL, k, n), jnp.bfloat16,  # noqa: E731
                                                sharding=NamedSharding(mesh, EXPERTS))
    args = (replicated(mesh, (1, D), jnp.float32), replicated(mesh, (M,), jnp.int32),
            replicated(mesh, (M,), jnp.float32), stacked(D, F), stacked(D, F), stacked(F, D))

    def layers(x, key, gates, *w):
        def layer(i, acc):
            return acc + kernel.bf16_decode_moe(x + acc, key, gates, *w, i, jax.lax.axis_index("expert") * E_LOCAL,
                                                dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
                                                cost_assignments=2.5).astype(jnp.float32)
        return jax.lax.fori_loop(0, L, layer, jnp.zeros((1, D), jnp.float32))

    f = jax.shard_map(layers, mesh=mesh, in_specs=(P(), P(), P()) + (EXPERTS,) * 3, out_specs=P(), check_vma=False)
    compiled = jax.jit(f).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * D * F * 2
    line = next(x for x in compiled.as_text().splitlines() if "tpu_custom_call" in x and kernel.NAME in x)
    flops = round(2.5 * 2 * 16 * 3 * D * F)
    nbytes = round(2.5 * 3 * D * F * 2 + D * (4 + 2))
    assert kernel_cost(line.split("custom-call(")[0], [], line) == (float(flops), nbytes)
    grid = kernel_grid(line)
    tiles = F // kernel.width_tile(D, F, 2)
    assert grid.name == kernel.NAME and grid.bounds == (M, tiles) and not any(grid.parallel)
    assert decode_moe_fetch_fraction(grid, line) == pytest.approx(2.5 / M)
    assert grid.window_bytes(1.0, table_fraction(grid, line)) == pytest.approx(nbytes)
