"""Real Mosaic compile of the one-call INT4 SwiGLU of a chip's received rows for v5p (AOT from a CPU host via
libtpu) at the 744B decode's per-chip shapes, batch 2048 on `expert:64`: D = 6144, each chip's 4 experts 2048
wide, INT4 groups of 32, 1,024 received rows (64 chips x 16 send slots) in 12 blocks of 128, weights stacked over
a few layers and read by the layer index. Needs libtpu; skipped without it."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.sharding import PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost.kernels import dynamic_grid_bound, kernel_cost, table_fraction  # noqa: E402
from glm5_jax.cost.hlo_cost.mosaic_grid import kernel_grid  # noqa: E402
from glm5_jax.cost.hlo_cost.parsing import parse_computations  # noqa: E402
from pallas_kernels.int4_moe_rows import kernel  # noqa: E402
from tests.pallas_kernels.int4_expert_compile import (  # noqa: E402
    EXPERTS, expert_mesh, replicated, stacked_int4_weights)

L, E_LOCAL, D, F, G, R, M, N_BLOCKS = 3, 4, 6144, 2048, 32, 1024, 128, 12
EXPECTED_BLOCKS = 5.5


def test_layer_loop_compiles_and_declares_its_blocks():
    """A loop over layers (as the decode layer scan runs it): the stacked packed experts are the kernel's operands
    (no per-layer copy: the temporaries hold less than one expert's weights). Declared cost by hand for 5.5
    expected used blocks: three products on 128 rows each, the packed words and bf16 scales of one expert's three
    [6144 x 2048] weights per block, each block's rows read and written (bf16), the slot table read once. The cost
    model's grid rule: each part runs (5.5 + 1) / 2 blocks (alternate blocks, the busiest part's), every F tile
    step fetches its three weight windows, the parts split over both TensorCores."""
    mesh = expert_mesh()
    args = (replicated(mesh, (R, D // 128, 128), jnp.bfloat16), replicated(mesh, (N_BLOCKS * M,), jnp.int32),
            replicated(mesh, (N_BLOCKS,), jnp.int32), replicated(mesh, (), jnp.int32),
            *stacked_int4_weights(mesh, L, E_LOCAL, D, F, G))

    def layers(rows, slot, block_expert, n_used, *w):
        def layer(i, y):
            return kernel.int4_moe_rows(y, slot, block_expert, n_used, *w, i, group_size=G, dtype=jnp.bfloat16,
                                        cost_blocks=EXPECTED_BLOCKS)
        return jax.lax.fori_loop(0, L, layer, rows)

    f = jax.shard_map(layers, mesh=mesh, in_specs=(P(), P(), P(), P()) + (EXPERTS,) * 6, out_specs=P(),
                      check_vma=False)
    compiled = jax.jit(f).lower(*args).compile()
    one_expert = 3 * D * F // 2
    assert compiled.memory_analysis().temp_size_in_bytes < one_expert
    line = next(x for x in compiled.as_text().splitlines() if "tpu_custom_call" in x and kernel.NAME in x)
    flops = round(EXPECTED_BLOCKS * 2 * M * 3 * D * F)
    weights = 3 * (D * F // 2 + D // G * F * 2)
    nbytes = round(EXPECTED_BLOCKS * (weights + 2 * M * D * 2) + N_BLOCKS * M * 4)
    assert kernel_cost(line.split("custom-call(")[0], [], line) == (float(flops), nbytes)
    grid = kernel_grid(line)
    tf = kernel.f_tile(D, F, G)
    assert grid.name == kernel.NAME and grid.bounds == (2, None, F // tf) and grid.parallel == (True, False, False)
    comps, _ = parse_computations(compiled.as_text())
    shapes = {n: shape for instrs in comps.values() for n, (shape, *_) in instrs.items()}
    call = next(i for instrs in comps.values() for i in instrs.values() if kernel.NAME in i[4])
    per_part = dynamic_grid_bound([shapes[o] for o in call[2]], call[4], None, call[0], grid.name, grid)
    assert per_part == pytest.approx((EXPECTED_BLOCKS + 1) / 2)
    assert grid.busiest_core_share(2, per_part) == 0.5
    # the slot table whole in SMEM once, the weight windows at every step
    assert grid.window_bytes(per_part, table_fraction(grid, line)) == pytest.approx(
        2 * per_part * weights + N_BLOCKS * M * 4)
