"""The cost model's rule for megablox grouped matmuls (glm5_jax.cost.hlo_cost `GroupedMatmulLoad`): a call is
charged the row tiles its dynamic grid visits, not its declared 2 x m x k x n over the whole row buffer.
Checked against megablox's own tile metadata (the grid it runs), hand counts on a real v5p compile, and
the routed rows per call of the all-to-all transport counted by hand."""
import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.cost.hlo_cost import GroupedMatmulLoad, grouped_matmul_tiles, hlo_cost
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.moe.expert_parallel import expected_routed_rows

_needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                   reason="libtpu is not importable (pip install -r requirements-tpu.txt)")


@pytest.mark.parametrize("rows, tile, groups, aligned", [(8192, 512, 8, False), (8192, 256, 8, False),
                                                         (8192, 128, 8, False), (3000, 128, 5, False),
                                                         (8192, 256, 8, True), (3000, 128, 5, True)])
def test_visited_tiles_match_megablox_metadata(rows, tile, groups, aligned):
    """The tiles megablox's make_group_metadata schedules (its grid's row-tile count) for random group
    sizes summing to `rows`, on average: back to back, the rows' tiles + one per group boundary (within
    half a tile); padded to whole tiles (each group's size rounded up), the rows' tiles + half a tile per
    group (within a tile: the sizes' remainders are tied by their sum)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

    rng = np.random.default_rng(0)
    m = math.ceil((rows * 1.25 + groups * tile) / tile) * tile     # a capacity buffer with room to spare
    visited = []
    for _ in range(48):
        sizes = rng.multinomial(rows, [1 / groups] * groups).astype(np.int32)
        if aligned:
            sizes = -(-sizes // tile) * tile
        _, n = make_group_metadata(group_sizes=jnp.asarray(sizes), m=m, tm=tile, start_group=jnp.array(0),
                                   num_nonzero_groups=groups, visit_empty_groups=False)
        visited.append(int(n))
    assert abs(np.mean(visited) - grouped_matmul_tiles(rows, tile, groups, aligned)) <= (1.0 if aligned else 0.5)
    # at 512-row tiles the boundaries alone add 7 of 16 tiles: 1.44x the routed rows' work
    if (rows, tile, groups, aligned) == (8192, 512, 8, False):
        assert grouped_matmul_tiles(rows, tile, groups) == 23


def test_expected_routed_rows_of_the_all_to_all():
    """744B pretraining shard: 2048 tokens in 2 chunks of 1024, K = 8: 8192 rows per call on average,
    whatever the capacity (it sizes the buffer, not what lands in it)."""
    cfg = ModelConfig(n_routed_experts=256, num_experts_per_tok=8)
    rt = dataclasses.replace(cfg.runtime, moe_ep="a2a", moe_capacity_factor=1.25, moe_a2a_chunks=2)
    a2a = dataclasses.replace(cfg, runtime=rt)
    assert expected_routed_rows(2048, a2a) == 8192
    # 2 chunks do not divide 1001 tokens: one chunk
    assert expected_routed_rows(1001, a2a) == 1001 * 8
    # expert chunks: every token's assignments to half of the experts, 2048 x 8 / 2 rows per call on average
    # (and the 1001 tokens split too: the chunks do not split them)
    by_experts = dataclasses.replace(cfg, runtime=dataclasses.replace(rt, moe_a2a_chunk_by="experts"))
    assert expected_routed_rows(2048, by_experts) == 8192
    assert expected_routed_rows(1001, by_experts) == 1001 * 8 / 2
    # without the all-to-all the grouped matmul's rows are the N x K assignments themselves: the whole buffer
    assert expected_routed_rows(2048, cfg) is None


# a per-chip gmm / tgmm at small shapes, one tile wide in k and n: m = 1024 rows in tiles of 128 (8 tiles),
# 4 groups, so the grid may visit L = 8 + 3 = 11 tiles
M, K, N, G, TM = 1024, 256, 256, 4, 128
TILING = (TM, K, N)


def _compiled_hlo(kind):
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.grouped_matmul import kernel

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    s = SingleDeviceSharding(device)
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731
    if kind == "gmm":
        fn = lambda a, b, g: kernel.gmm(a, b, g, out_dtype=jnp.bfloat16, tiling=TILING)  # noqa: E731
        args = (spec((M, K)), spec((G, K, N)), spec((G,), jnp.int32))
    else:
        fn = lambda a, b, g: kernel.tgmm(a, b, g, out_dtype=jnp.bfloat16, tiling=TILING)  # noqa: E731
        args = (spec((M, K)), spec((M, N)), spec((G,), jnp.int32))
    with jax.default_matmul_precision("default"):
        return jax.jit(fn).lower(*args).compile().as_text()


@_needs_libtpu
@pytest.mark.parametrize("kind", ["gmm", "tgmm"])
def test_grouped_matmul_charged_its_visited_tiles_on_v5p(kind):
    text = _compiled_hlo(kind)
    declared = hlo_cost(text)
    assert declared.kernel_flops == 2 * M * K * N                  # megablox's estimate: every buffer row
    # half the buffer routed: 512 rows = 4 tiles, + 3 boundaries = 7 of the 8 tiles' work
    half = hlo_cost(text, grouped_matmul_load=GroupedMatmulLoad(512))
    assert half.kernel_flops == 2 * 7 * TM * K * N
    lhs, weight_tile, out = M * K * 2, K * N * 2, (M * N * 2 if kind == "gmm" else G * K * N * 2)
    if kind == "gmm":
        # declared: lhs once per output-column tile (1) + one group's weights per possible tile (11) + out;
        # executed: the visited tiles' lhs and out rows (7 / 8) + one group's weights per visited tile (7)
        change = (lhs + out) * (7 / 8 - 1) + weight_tile * (7 - 11)
    else:
        # declared: lhs and d out once per tile of the other operand (1 each) + the [G, K, N] gradient;
        # executed: the visited rows of both (7 / 8), the gradient written whole
        change = (lhs + M * N * 2) * (7 / 8 - 1)
    assert half.bytes_accessed - declared.bytes_accessed == pytest.approx(change, abs=1)
    # the same rows in groups padded to whole tiles: 4 tiles + half a tile per group = 6
    aligned = hlo_cost(text, grouped_matmul_load=GroupedMatmulLoad(512, aligned=True))
    assert aligned.kernel_flops == 2 * 6 * TM * K * N
    # a full buffer: every tile + every boundary, the grid's most (11 tiles), above the declared 8
    full = hlo_cost(text, grouped_matmul_load=GroupedMatmulLoad())
    assert full.kernel_flops == 2 * 11 * TM * K * N
