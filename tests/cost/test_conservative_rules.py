"""The cost model's conservative rules (glm5_jax.cost.hlo_cost.CostRules, glm5_jax.cost.ici, the report's
expert load), each against a hand count: a megablox grouped matmul and the INT4 expert kernel compiled for
v5p (their grids read from the kernels' modules: core split, grid steps over a dynamic axis, bytes by their
blocks), hand-built HLO (per-op cost, ring collectives' HBM passes, SparseCore rate) and hand-placed
all-to-all groups (busiest link)."""
import dataclasses
import functools
import importlib.util
import types

import jax
import jax.numpy as jnp
import pytest

from glm5_jax.cost.hlo_cost import (CONSERVATIVE, CollectiveOp, CostRules, GroupedMatmulLoad, StepTiming, hlo_cost,
                                    kernel_grid)
from glm5_jax.cost.hlo_cost.kernels import table_fraction
from glm5_jax.cost.hlo_cost.rules import GRID_STEP_SECONDS
from glm5_jax.cost.ici import CollectiveModel
from tests.cost.test_hlo_collectives import SPARSECORE_STEP

_needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                   reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

# a per-chip megablox gmm: m = 1024 rows in tiles of 128 (8 tiles), 4 groups (so at most L = 11 row tiles),
# k = 256 (one tile), n in tiles of 256: megablox marks only its n-tile axis "parallel"
M, K, G, TM, TN = 1024, 256, 4, 128, 256
TIMING = StepTiming(3.94e14, 2.35e12, lambda op: 0.0)


def _gmm_hlo(n: int) -> str:
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.grouped_matmul import kernel

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    s = SingleDeviceSharding(device)
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731
    fn = lambda a, b, g: kernel.gmm(a, b, g, out_dtype=jnp.bfloat16, tiling=(TM, K, TN))  # noqa: E731
    with jax.default_matmul_precision("default"):
        return jax.jit(fn).lower(spec((M, K)), spec((G, K, n)), spec((G,), jnp.int32)).compile().as_text()


def _kernel_row(cost):
    (row,) = [t for t in cost.top_instructions if t.opcode == "custom-call" and "gmm" in t.op_name]
    return row


@_needs_libtpu
def test_grid_rules_on_a_v5p_grouped_matmul():
    text = _gmm_hlo(3 * TN)
    line = next(x for x in text.splitlines() if "tpu_custom_call" in x and "jit(gmm)" in x)
    grid = kernel_grid(line)
    # grid (n tiles, row tiles: dynamic, k tiles), only the n axis parallel
    assert grid.bounds == (3, None, 1) and grid.parallel == (True, False, False)
    # blocks: lhs [128, 256] and one group's rhs [256, 256] change every step, the output [128, 256] with
    # its (n, row) tile: each of the 3 x 11 steps moves all three
    assert grid.window_bytes(11) == 3 * 11 * (TM * K + K * TN + TM * TN) * 2
    # the weights block is looked up in the group-id table (row tile -> group): each step taken to fetch it
    assert [table for _, _, table in grid.windows] == [True, True, True]
    assert grid.busiest_core_share(2) == pytest.approx(2 / 3)     # 3 n tiles: 2 on one core, 1 on the other
    base = _kernel_row(hlo_cost(text, timing=TIMING, top=50))
    # one core runs 2 of the 3 n tiles: 2/3 of the work at one core's rate = 4/3 of the two-core time
    split = _kernel_row(hlo_cost(text, timing=TIMING, top=50, rules=CostRules(kernel_core_split=True)))
    assert split.seconds == pytest.approx(base.seconds * 4 / 3)
    # 0.35 us per step on the busiest core: 2 n tiles x the 7 row tiles 512 routed rows visit (4 + 3 boundaries)
    load = GroupedMatmulLoad(512)
    steps = _kernel_row(hlo_cost(text, timing=TIMING, top=50, grouped_matmul_load=load,
                                 rules=CostRules(grid_step_seconds=GRID_STEP_SECONDS)))
    visited = _kernel_row(hlo_cost(text, timing=TIMING, top=50, grouped_matmul_load=load))
    assert steps.seconds == pytest.approx(visited.seconds + 2 * 7 * GRID_STEP_SECONDS)
    # bytes by the grid: 3 n tiles x 7 visited row tiles, each step its three blocks
    by_grid = hlo_cost(text, timing=TIMING, top=50, grouped_matmul_load=load, rules=CostRules(kernel_grid_bytes=True))
    assert _kernel_row(by_grid).bytes == 3 * 7 * (TM * K + K * TN + TM * TN) * 2
    assert by_grid.grid_steps == 3 * 7 and by_grid.kernels_without_grid == []


@_needs_libtpu
def test_one_parallel_tile_runs_on_one_core():
    text = _gmm_hlo(TN)
    base = _kernel_row(hlo_cost(text, timing=TIMING, top=50))
    split = _kernel_row(hlo_cost(text, timing=TIMING, top=50, rules=CostRules(kernel_core_split=True)))
    assert split.seconds == pytest.approx(2 * base.seconds)
    # a chip with one TensorCore: no split to lose
    one = _kernel_row(hlo_cost(text, timing=TIMING, top=50, rules=CostRules(kernel_core_split=True, cores_per_chip=1)))
    assert one.seconds == pytest.approx(base.seconds)


def _int4_hlo(cost_blocks, n=9, m=16, K=512, N=512, E=4, group=32) -> str:
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.int4_matmul import kernel

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    s = SingleDeviceSharding(device)
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731

    def fn(x, block_expert, n_used, packed, scale):
        return kernel.int4_block_matmul(x, block_expert, n_used, packed, scale, group_size=group, tile_n=128,
                                        tile_k=256, cost_blocks=cost_blocks)

    return jax.jit(fn).lower(spec((n, m, K)), spec((n,), jnp.int32), spec((), jnp.int32),
                             spec((E, K // 8, N), jnp.int32), spec((E, K // group, N))).compile().as_text()


@_needs_libtpu
def test_int4_kernel_runs_its_declared_row_blocks():
    """The INT4 expert kernel ([9 blocks of 16 rows, K = 512] x [512, 512] in 128 x 256 tiles) declaring 2.5
    used blocks: grid (4 output tiles, row blocks up to n_used: dynamic, 2 contraction tiles), only the
    output-tile axis parallel. The cost model runs 2.5 row blocks: 4 x 2.5 x 2 = 20 steps, 10 on the busiest
    core; each step moves an activation block [16, 256] bf16, packed words [32, 128] int32 and scales
    [1, 8, 128] bf16, each (output tile, row block) one [16, 128] fp32 output block."""
    text = _int4_hlo(2.5)
    line = next(x for x in text.splitlines() if "tpu_custom_call" in x)
    grid = kernel_grid(line)
    assert grid.name == "int4_block_matmul"
    assert grid.bounds == (4, None, 2) and grid.parallel == (True, False, False)
    flops = 2 * 2.5 * 16 * 512 * 512
    by_grid = hlo_cost(text, timing=TIMING, top=50, rules=CostRules(kernel_grid_bytes=True))
    assert by_grid.kernel_flops == flops and by_grid.grid_steps == 20
    step_bytes = 16 * 256 * 2 + 32 * 128 * 4 + 8 * 128 * 2
    (row,) = [t for t in by_grid.top_instructions if t.opcode == "custom-call"]
    assert row.bytes == 20 * step_bytes + 4 * 2.5 * 16 * 128 * 4
    # 0.35 us per step on the busiest core (2 of the 4 output tiles) on top of the kernel's roofline
    plain = [t for t in hlo_cost(text, timing=TIMING, top=50).top_instructions if t.opcode == "custom-call"][0]
    steps = hlo_cost(text, timing=TIMING, top=50, rules=CostRules(grid_step_seconds=GRID_STEP_SECONDS))
    (timed,) = [t for t in steps.top_instructions if t.opcode == "custom-call"]
    assert timed.seconds == pytest.approx(plain.seconds + 10 * GRID_STEP_SECONDS)
    # no estimate of its blocks (all 9 declared): every block's steps
    assert hlo_cost(_int4_hlo(None), rules=CostRules(kernel_grid_bytes=True)).grid_steps == 4 * 9 * 2


def test_per_op_cost_and_ring_hbm_passes_on_hand_built_hlo():
    f32 = 4
    timing = StepTiming(1e30, 1e30, lambda op: 0.0)
    # top-level ops: the dot and the SparseCores' reduce-scatter (parameters, the token, the tuple, the
    # async call's start and done launch nothing of their own)
    cost = hlo_cost(SPARSECORE_STEP, timing=timing, rules=CostRules(op_fixed_seconds=1e-6))
    assert cost.top_level_ops == 2 and cost.roofline_seconds == pytest.approx(2e-6)
    # the ring reduce-scatter reads its own chunk, reads the received one and writes the sum each step:
    # 3 x its operand, where one read of the operand and one write of the result count 1 + 1/4
    plain = hlo_cost(SPARSECORE_STEP)
    passes = hlo_cost(SPARSECORE_STEP, rules=CostRules(collective_hbm_passes=True))
    operand = f32 * 4096 * 128
    assert passes.bytes_accessed - plain.bytes_accessed == 3 * operand - (operand + operand // 4)


def test_sparsecore_reduce_scatter_at_its_conservative_rate():
    (op, _), = hlo_cost(SPARSECORE_STEP).collectives.items()
    assert op.offloaded and op.kind == "reduce-scatter"
    coords = [(i, 0, 0) for i in range(4)]
    link = CollectiveModel(coords, (4, 4, 4), link_bandwidth=1.0)
    slow = CollectiveModel(coords, (4, 4, 4), link_bandwidth=1.0, sparsecore_factor=3.0)
    assert slow.seconds(op) == pytest.approx(3 * link.seconds(op))
    # a TensorCore reduce-scatter of the same groups keeps the link rate
    on_tc = dataclasses.replace(op, offloaded=False)
    assert slow.seconds(on_tc) == pytest.approx(link.seconds(on_tc))


def test_all_to_all_by_its_busiest_link():
    """32 chips on an 8 x 4 block of an 8x16x16 torus: the 8-long side wraps round, the 4 positions of the
    16-long side do not. Routed x first (a ring of 8): a directed x link carries, per source row, the pairs
    1, 2, 3 apart crossing it (1 + 2 + 3) and half of the 4-apart ones (2), to each of 4 destination rows:
    8 x 4 = 32 messages; the balanced model spreads 31 messages x 3.355 mean hops over 4 links: 26."""
    coords = [(x, y, 0) for y in range(4) for x in range(8)]
    op = CollectiveOp("all-to-all", 32, (tuple(range(32)),), False, "moe")
    balanced = CollectiveModel(coords, (8, 16, 16), link_bandwidth=1.0)
    busiest = CollectiveModel(coords, (8, 16, 16), link_bandwidth=1.0, all_to_all_link_model="busiest_link")
    assert balanced.seconds(op) == pytest.approx(26.0)
    assert busiest.seconds(op) == pytest.approx(32.0)       # 32 messages of 32 / 32 bytes on one link
    # two neighbours: one message each way on their one link; the balanced model credits the pair with
    # both links of its dim (one each way round the ring), half the time
    pair = CollectiveOp("all-to-all", 2, ((0, 1),), False, "moe")
    assert busiest.seconds(pair) == pytest.approx(1.0) and balanced.seconds(pair) == pytest.approx(0.5)


def test_multi_dim_ring_per_dimension():
    """An FSDP all-gather over 4 positions 4 hops apart (on a 16-ring, 4 such groups interleaved: each link
    carries 4 ring edges, 2 x 85 / 4 GB/s per chip) x 16 neighbours (2 x 85 GB/s). Dims added: 212.5 GB/s.
    One ring per dim, the 4-position dim first: it carries 3/63 of the bytes at 42.5 GB/s, the 16-position
    dim 60/63 at 170 GB/s, the busiest of the two: 63/60 x 170 = 178.5 GB/s (the other order is slower)."""
    coords = [(x, y, 0) for x in range(16) for y in range(16)]
    at = {c: i for i, c in enumerate(coords)}
    groups = tuple(tuple(at[(o + 4 * k, y, 0)] for k in range(4) for y in range(16)) for o in range(4))
    op = CollectiveOp("all-gather", 64 * 64, groups, False, "fsdp")
    moved = 64 * 63
    add = CollectiveModel(coords, (16, 16, 4), link_bandwidth=85e9)
    per_dim = CollectiveModel(coords, (16, 16, 4), link_bandwidth=85e9, ring_dims="per_dimension")
    assert moved / add.seconds(op) == pytest.approx(212.5e9)
    assert moved / per_dim.seconds(op) == pytest.approx(178.5e9)


def test_busiest_chip_expert_load():
    """The grouped matmuls of a synchronous step run at the busiest chip's load: its capacity buffer,
    moe_capacity_factor x the mean routed rows."""
    from glm5_jax.model.config import ModelConfig
    from glm5_jax.train.compile_report import grouped_matmul_load

    cfg = ModelConfig(n_routed_experts=256, num_experts_per_tok=8)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, moe_ep="a2a", moe_capacity_factor=1.25,
                                                               moe_a2a_chunks=2))
    exp = types.SimpleNamespace(data=types.SimpleNamespace(batch_size=8, seq_len=4096),
                                train=types.SimpleNamespace(grad_accum=1))
    sharding = types.SimpleNamespace(shard_shape=lambda shape: (1, shape[1] // 2))    # 2048 tokens per shard
    trainer = types.SimpleNamespace(model_cfg=cfg, batch_sharding=sharding)
    assert grouped_matmul_load(exp, trainer, "mean").rows == 8192          # 1024 tokens per chunk x K = 8
    assert grouped_matmul_load(exp, trainer, "busiest").rows == 8192 * 1.25


def _flash_forward_hlo(T: int, H: int, D: int, block: int) -> str:
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.flash_attention import ops as flash_ops

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    s = SingleDeviceSharding(device)
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731

    def forward(q, k, v, pos, seg):
        return flash_ops.flash_attention(q, k, v, pos, pos, seg, seg, scale=D**-0.5, impl="pallas", block=block)[0]

    args = (spec((1, T, H, D)),) * 3 + (spec((1, T), jnp.int32),) * 2
    return jax.jit(forward).lower(*args).compile().as_text()


@_needs_libtpu
def test_flash_forward_rereads_keys_per_query_block():
    """One causal sequence of T = 1024 in blocks of 256 (n = 4 per side), 2 heads of 128: grid (batch 1,
    heads 2, query blocks 4, key steps 4). Per (head, query block) the q block, the out block and its
    per-row vectors move once (8 times); the k / v blocks and the keys' per-row vectors come from the
    causal schedule's tables: 4 + 3 + 2 + 1 = 10 of the 16 steps per head fetch (n + 1) / 2n = 5/8 of them."""
    T, H, D, block = 1024, 2, 128, 256
    line = next(x for x in _flash_forward_hlo(T, H, D, block).splitlines()
                if "tpu_custom_call" in x and "flash_attention_fwd" in x)
    grid = kernel_grid(line)
    assert grid.bounds == (1, H, 4, 4) and grid.parallel == (True, True, True, False)
    rows, bf16, s32, f32 = block, 2, 4, 4
    once = rows * D * bf16 * 2 + rows * s32 * 2 + rows * f32          # q, out; q positions, segments; lse
    scheduled = rows * D * bf16 * 2 + rows * s32 * 2                  # k, v; key positions, segments
    assert table_fraction(grid, line) == 5 / 8
    assert grid.window_bytes(1, table_fraction(grid, line)) == H * 4 * once + H * 10 * scheduled


def _row_gather_hlo(L, B, S, C, K, block):
    """The compiled per-row form (the tile-group DMAs; not the streamed layer slice, which these shapes would
    otherwise choose: K x 8 > S)."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pallas_kernels.row_gather import kernel

    # one chip's program (a one-device mesh: Mosaic's lowering reads the chip from the mesh)
    mesh = Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[:1]), ("x",))
    s = NamedSharding(mesh, P())
    gather = functools.partial(kernel.stacked_row_gather, block=block, stream=False)
    fn = jax.shard_map(gather, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((L, B, S, C), jnp.bfloat16, sharding=s),
                             jax.ShapeDtypeStruct((), jnp.int32, sharding=s),
                             jax.ShapeDtypeStruct((B, K), jnp.int32, sharding=s)).compile().as_text()


@_needs_libtpu
def test_row_gather_counts_a_tile_group_per_row():
    """The stacked row gather (pallas_kernels/row_gather) DMAs each selected row's 8-row tile group from the
    cache it takes whole (memory space ANY: no window); its windows are only the output block and the two
    index blocks. B = 2 rows x K = 200 selected rows of C = 576 in blocks of 128 (K padded to 256): grid (2
    halves, 2 blocks). Hand count per (padded) selected row: 8 rows x 5 lane tiles x 128 x 2 bytes read (576
    padded to 640), 576 x 2 written, 2 x 4 bytes of index; the grid's windows alone see only the last two."""
    L, B, S, C, K, block = 2, 2, 1024, 576, 200, 128
    text = _row_gather_hlo(L, B, S, C, K, block)
    line = next(x for x in text.splitlines() if "tpu_custom_call" in x and "stacked_row_gather" in x)
    grid = kernel_grid(line)
    assert grid.bounds == (2, 2) and grid.parallel == (True, False) and grid.unwindowed == 1
    K = 256
    windows = B * K * (C * 2 + 2 * 4)
    assert grid.window_bytes() == windows
    hand = B * K * 8 * 640 * 2 + windows
    row = next(t for t in hlo_cost(text, timing=TIMING, top=50, rules=CONSERVATIVE).top_instructions
               if t.opcode == "custom-call" and "stacked_row_gather" in t.op_name)
    assert row.bytes == hand                       # the declared bytes, above the windows' (max of the two)


def _row_scatter_hlo(parts, B=1, S=1024, N=4096, W=640, block=512, window=256) -> str:
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pallas_kernels.row_scatter import kernel, packing

    mesh = Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[:1]), ("x",))
    s = NamedSharding(mesh, P())
    scatter = functools.partial(kernel.sorted_row_scatter_add, block=block, window=window, parts=parts)
    fn = jax.shard_map(scatter, mesh=mesh, in_specs=(P(),) * 4, out_specs=P(), check_vma=False)
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((B, S, W), jnp.float32, sharding=s),
                             jax.ShapeDtypeStruct((B, N, 1, packing.packed_width(W)), jnp.uint32, sharding=s),
                             jax.ShapeDtypeStruct((B, N), jnp.int32, sharding=s),
                             jax.ShapeDtypeStruct((B, N), jnp.int32, sharding=s)).compile().as_text()


@_needs_libtpu
def test_row_scatter_parts_split_over_both_cores():
    """The sorted row scatter-add (pallas_kernels/row_scatter) over 4,096 packed updates in blocks of 512:
    grid (parts: parallel, batch, update blocks: dynamic). Two parts run ceil(4096 / (2 x 512)) + 1 = 5
    blocks each (the block holding the cut read by both): 10 grid steps, 5 on each core, no core excess;
    one part runs all 8 blocks on one core: twice the two-core time plus 8 steps."""
    rules = CostRules(kernel_core_split=True, grid_step_seconds=GRID_STEP_SECONDS)

    def row(text, rules):
        cost = hlo_cost(text, timing=TIMING, top=50, rules=rules)
        return cost, next(t for t in cost.top_instructions if t.opcode == "custom-call")

    two, one = _row_scatter_hlo(2), _row_scatter_hlo(1)
    grid = kernel_grid(next(x for x in two.splitlines() if "tpu_custom_call" in x))
    assert grid.name == "sorted_row_scatter_add"
    assert grid.bounds == (2, 1, None) and grid.parallel == (True, False, False)
    (_, plain2), (cost2, ruled2) = row(two, CostRules()), row(two, rules)
    assert cost2.grid_steps == 10
    assert ruled2.seconds == pytest.approx(plain2.seconds + 5 * GRID_STEP_SECONDS)
    (_, plain1), (cost1, ruled1) = row(one, CostRules()), row(one, rules)
    assert cost1.grid_steps == 8
    assert ruled1.seconds == pytest.approx(2 * plain1.seconds + 8 * GRID_STEP_SECONDS)
    assert plain1.bytes == plain2.bytes                  # the same declared bytes: only the split differs
