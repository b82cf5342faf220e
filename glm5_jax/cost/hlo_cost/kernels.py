"""What Mosaic custom calls (Pallas kernels) cost: the `pl.CostEstimate` a kernel declares, the ragged-dot
lowering's matmul from its shapes, megablox grouped matmuls by the row tiles their groups visit
(`GroupedMatmulLoad`, `grouped_matmul_tiles`), and the INT4 expert kernel's dynamic row blocks by the
blocks it declares (`declared_row_blocks`), the sorted row scatter-add's update blocks by an even cut over its
parts (`scatter_part_blocks`), the few-token decode MoE kernels' weight fetches by their local assignments
(`decode_moe_fetch_fraction`), the received-rows INT4 MoE kernel's row blocks per part by the blocks it
declares (`moe_rows_part_blocks`)."""
from __future__ import annotations

import dataclasses
import math
import re

from glm5_jax.cost.hlo_cost.parsing import arrays_of, dense_bytes
from pallas_kernels.bf16_decode_moe.kernel import NAME as BF16_DECODE_MOE, ROWS as BF16_DECODE_MOE_ROWS
from pallas_kernels.int4_decode_moe.kernel import NAME as INT4_DECODE_MOE, ROWS as INT4_DECODE_MOE_ROWS
from pallas_kernels.int4_matmul.kernel import NAME as INT4_BLOCK_MATMUL
from pallas_kernels.int4_moe_rows.kernel import NAME as INT4_MOE_ROWS, PARTS as INT4_MOE_ROWS_PARTS
from pallas_kernels.row_scatter.kernel import NAME as SORTED_ROW_SCATTER_ADD

_COST_ESTIMATE = re.compile(r'"cost_estimate"\s*:\s*\{([^}]*)\}')


def _declared(attrs: str) -> dict:
    """The fields of a kernel's declared cost estimate ({} when it declares none)."""
    m = _COST_ESTIMATE.search(attrs)
    return dict(re.findall(r'"(\w+)"\s*:\s*"?(\d+)', m.group(1))) if m else {}


def kernel_cost(shape: str, operand_shapes: list[str], attrs: str):
    """(FLOPs, bytes or None) of a Mosaic custom call: the kernel's declared `pl.CostEstimate` (written
    into the backend config's custom_call_config.cost_estimate), else for the ragged-dot lowering
    2 x m x k x n from its shapes (lhs [m, k], rhs [groups, k, n]); a kernel with integer results only
    (e.g. the ragged dot's group metadata) does no matmul; None when none of these applies."""
    fields = _declared(attrs)
    if "flops" in fields:
        nbytes = int(fields["bytes_accessed"]) if "bytes_accessed" in fields else None
        return float(fields["flops"]), nbytes
    if all(dt[0] in "sup" for dt, _ in arrays_of(shape)):
        return 0.0, None                            # integer/bool results only: index bookkeeping, no matmul
    if "ragged_dot" in attrs or "ragged-dot" in attrs:
        arrays = [a for t in operand_shapes for a in arrays_of(t)]
        out = arrays_of(shape)
        mats = [s for _, s in arrays if len(s) >= 2]
        if out and len(mats) >= 2 and len(mats[-2]) == 2 and len(mats[-1]) == 3:
            (m_, k), n = mats[-2], out[0][1][-1]
            return 2.0 * m_ * k * n, None
    return None


# JAX's megablox grouped matmuls (jax.experimental.pallas.ops.tpu.megablox.gmm: `gmm`, and `tgmm` for the
# weight gradient) run a grid whose row-tile count is an operand: they visit only the row tiles their
# groups cover, and a tile that a group boundary cuts is visited once per group, in full. Their declared
# estimate is 2 x m x k x n over all m rows of the buffer, whatever the groups hold.
_GROUPED_MATMUL = re.compile(r"jit\((t?gmm)\)/pallas_call")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulLoad:
    """What the routed experts' grouped matmuls hold, on average: ``rows`` routed rows per call (None: every
    row of the call's buffer), and whether each group starts on a row tile (``aligned``: the groups' sizes
    are padded to whole tiles, so no tile is cut)."""
    rows: float | None = None
    aligned: bool = False


def grouped_matmul_tiles(rows: float, tile: int, groups: int, aligned: bool = False) -> float:
    """Row tiles a megablox grouped matmul visits for ``rows`` rows in ``groups`` contiguous groups. Groups
    packed back to back: the tiles the rows cover plus one for each of the G - 1 boundaries, which falls
    inside a tile unless the sizes happen to be tile multiples (megablox's make_group_metadata runs a
    group's tiles from its first row rounded down to its last rounded up, so a cut tile is computed by
    both groups). Groups padded to whole tiles: the rows' tiles plus half a tile of padding per group, on
    average (within a tile of megablox's count for random sizes)."""
    if aligned:
        return rows / tile + groups / 2
    return float(math.ceil(rows / tile) + groups - 1)


def _grouped_matmul_cost(kind: str, shape: str, operand_shapes: list[str], flops: float, nbytes: int | None,
                         load: GroupedMatmulLoad):
    """(FLOPs, bytes) a megablox `gmm` / `tgmm` call executes under ``load``, from the declared (FLOPs,
    bytes). The operands say the tiling: (tile count, group offsets [G + 1], group ids [L], row-tile ids
    [L], group offset, lhs [m, k], rhs, ...), L = m / tm + G - 1 the most tiles the grid may visit. FLOPs
    and the row-proportional bytes scale by T / (m / tm) for the T = `grouped_matmul_tiles` visited; `gmm`
    reads one group's weights [k, n] per visited tile (declared for all L), `tgmm` writes each group's
    [k, n] gradient once."""
    arrays = [a for t in operand_shapes for a in arrays_of(t)]
    if len(arrays) < 7 or arrays[1][0] != "s32" or len(arrays[5][1]) != 2:
        return flops, nbytes
    groups, most_tiles, m = math.prod(arrays[1][1]) - 1, math.prod(arrays[2][1]), arrays[5][1][0]
    tiles_m = most_tiles - groups + 1
    if groups < 1 or tiles_m < 1 or m % tiles_m:
        return flops, nbytes
    rows = m if load.rows is None else min(load.rows, m)
    visited = min(most_tiles, grouped_matmul_tiles(rows, m // tiles_m, groups, load.aligned))
    scale = visited / tiles_m
    if nbytes is None:
        return flops * scale, None
    if kind == "gmm":
        weight_tile = dense_bytes(arrays[6:7]) / groups
        return flops * scale, int((nbytes - weight_tile * most_tiles) * scale + weight_tile * visited)
    out = dense_bytes(arrays_of(shape))
    return flops * scale, int((nbytes - out) * scale + out)


def declared_row_blocks(shape: str, operand_shapes: list[str], attrs: str) -> float | None:
    """The row blocks the INT4 expert kernel (pallas_kernels/int4_matmul, [n, m, K] x [E, K, N] -> [n, m, N])
    declares it computes: its declared FLOPs / (2 m K N) (kernel.cost_estimate; the decode dispatch declares
    the busiest chip's expected blocks), within [1, n]; None when the shapes do not read as that kernel's."""
    xs = [s for dt, s in (a for t in operand_shapes for a in arrays_of(t)) if dt[0] not in "sup" and len(s) == 3]
    out = arrays_of(shape)
    flops = float(_declared(attrs).get("flops", 0))
    if not xs or not out or len(out[0][1]) != 3 or not flops:
        return None
    (n, m, K), N = xs[0], out[0][1][-1]
    return max(1.0, min(float(n), flops / (2.0 * m * K * N)))


def scatter_part_blocks(operand_shapes: list[str], grid) -> float | None:
    """The update blocks each part of the sorted row scatter-add (pallas_kernels/row_scatter; grid (parts,
    batch, blocks: dynamic)) runs: its N_pad updates (the rows operand [B, N_pad, 1, W]) cut evenly over the
    parts, in blocks of its SMEM update block (the first window, ``block`` int32), plus with two parts the
    block holding the cut, which both read: ceil(N_pad / (parts x block)) (+ 1). None when the shapes do not
    read as that kernel's."""
    rows = [s for dt, s in (a for t in operand_shapes for a in arrays_of(t)) if len(s) == 4]
    if grid is None or not rows or not grid.windows or not grid.bounds or grid.bounds[0] is None:
        return None
    parts, block = grid.bounds[0], grid.windows[0][0] / 4
    return math.ceil(rows[0][1] / (parts * block)) + (1 if parts > 1 else 0)


def moe_rows_part_blocks(operand_shapes: list[str], attrs: str) -> float | None:
    """The row blocks each part of the received-rows INT4 MoE kernel (pallas_kernels/int4_moe_rows; grid (parts,
    blocks: dynamic, F tiles)) runs: the parts take alternate used blocks, so of n used the busiest runs
    ceil(n / parts) <= (n + parts - 1) / parts, n the blocks it declares: its FLOPs / (2 x rows x 3 x D x F).
    Its operands say the shapes: (the dynamic grid bound, layer [1], block_expert [blocks], n_used [1], slot table
    [blocks x rows], the rows [R, D / 128, 128], gate words [L, E, D / 8, F], ...). None when they do not read as
    that kernel's."""
    arrays = [(dt, s) for dt, s in (a for t in operand_shapes for a in arrays_of(t))]
    flops = float(_declared(attrs).get("flops", 0))
    at = next((i for i, (dt, s) in enumerate(arrays) if dt[0] not in "sup" and len(s) == 3), None)
    if at is None or at < 3 or at + 1 >= len(arrays) or not flops:
        return None
    slots, n_blocks, gate = arrays[at - 1][1], arrays[at - 3][1], arrays[at + 1][1]
    if len(slots) != 1 or len(n_blocks) != 1 or len(gate) != 4 or not n_blocks[0]:
        return None
    rows, d_times_f = slots[0] / n_blocks[0], 8 * gate[2] * gate[3]
    blocks = flops / (2 * rows * 3 * d_times_f)
    return (blocks + INT4_MOE_ROWS_PARTS - 1) / INT4_MOE_ROWS_PARTS


def dynamic_grid_bound(operand_shapes: list[str], attrs: str, load: GroupedMatmulLoad | None, shape: str = "",
                       kernel_name: str = "", grid=None) -> float:
    """The iterations of a kernel's dynamic grid axis: a megablox grouped matmul's visited row tiles under
    ``load`` (`grouped_matmul_tiles`), the most its grid may visit without one; the INT4 expert kernel's
    (``kernel_name``, its Mosaic function; ``shape`` its result) declared row blocks (`declared_row_blocks`);
    the sorted row scatter-add's blocks per part (`scatter_part_blocks`, from its ``grid``); the received-rows
    INT4 MoE kernel's blocks per part (`moe_rows_part_blocks`); 1 for other kernels."""
    if kernel_name == SORTED_ROW_SCATTER_ADD:
        blocks = scatter_part_blocks(operand_shapes, grid)
        return 1.0 if blocks is None else float(blocks)
    if kernel_name == INT4_MOE_ROWS:
        blocks = moe_rows_part_blocks(operand_shapes, attrs)
        return 1.0 if blocks is None else blocks
    if kernel_name == INT4_BLOCK_MATMUL:
        blocks = declared_row_blocks(shape, operand_shapes, attrs)
        return 1.0 if blocks is None else blocks
    if not _GROUPED_MATMUL.search(attrs):
        return 1.0
    arrays = [a for t in operand_shapes for a in arrays_of(t)]
    if len(arrays) < 7 or arrays[1][0] != "s32" or len(arrays[5][1]) != 2:
        return 1.0
    groups, most_tiles, m = math.prod(arrays[1][1]) - 1, math.prod(arrays[2][1]), arrays[5][1][0]
    tiles_m = most_tiles - groups + 1
    if load is None or groups < 1 or tiles_m < 1 or m % tiles_m:
        return float(most_tiles)
    rows = m if load.rows is None else min(load.rows, m)
    return min(most_tiles, grouped_matmul_tiles(rows, m // tiles_m, groups, load.aligned))


# the project's flash-attention kernels (pallas_kernels/flash_attention) run a causal block schedule from
# scalar-prefetch tables over their innermost grid axis: a skipped step repeats the last needed block, so of
# n steps per outer block a causal sequence fetches (n + 1) / 2 on average (a zig-zag context shard too)
_BLOCK_SCHEDULE = re.compile(r"flash_attention")


def decode_moe_fetch_fraction(grid, attrs: str) -> float | None:
    """The share of a few-token decode MoE kernel's M assignment steps that fetch expert weights: a step of another
    chip's assignment names the blocks a neighbouring local step reads, so the pipeline fetches once per local
    assignment (per width tile). The kernel declares the busiest chip's expected local assignments as its FLOPs,
    2 x 16 token rows x 3 products x D x F each; its gate weights' window holds D x F / 2 bytes (INT4: packed
    words, grid (M,)) or D x T x 2 (bf16: grid (M, F / T), width tiles of T). None: neither kernel, or its grid
    does not say."""
    if len(grid.windows) < 2 or not grid.bounds or not grid.bounds[0]:
        return None
    gate_window = grid.windows[1][0]
    if grid.name == INT4_DECODE_MOE and len(grid.bounds) == 1:
        rows, d_times_f = INT4_DECODE_MOE_ROWS, 2 * gate_window
    elif grid.name == BF16_DECODE_MOE and len(grid.bounds) == 2 and grid.bounds[1]:
        rows, d_times_f = BF16_DECODE_MOE_ROWS, gate_window / 2 * grid.bounds[1]
    else:
        return None
    flops = float(_declared(attrs).get("flops", 0))
    if not flops or not d_times_f:
        return None
    assignments = flops / (2 * rows * 3 * d_times_f)
    return min(1.0, assignments / grid.bounds[0])


def table_fraction(grid, attrs: str) -> float:
    """The share of its grid steps at which a kernel's table-indexed blocks change (`KernelGrid.window_bytes`):
    the causal share (n + 1) / 2n of the project's flash-attention schedules (n: the innermost axis's steps),
    the few-token decode MoE kernels' local assignments among their steps (`decode_moe_fetch_fraction`), 1 (every
    step) for other kernels."""
    moe = decode_moe_fetch_fraction(grid, attrs)
    if moe is not None:
        return moe
    if not _BLOCK_SCHEDULE.search(attrs) or not grid.bounds or not grid.bounds[-1]:
        return 1.0
    n = grid.bounds[-1]
    return (n + 1) / (2 * n)


def custom_call_cost(shape: str, operand_shapes: list[str], attrs: str, load: GroupedMatmulLoad | None):
    """(FLOPs, bytes or None) of a Mosaic custom call (`kernel_cost`); a megablox grouped matmul, given
    ``load``, charged the row tiles it visits (`_grouped_matmul_cost`). None: no known cost."""
    cost = kernel_cost(shape, operand_shapes, attrs)
    grouped = _GROUPED_MATMUL.search(attrs) if load is not None else None
    if cost is not None and grouped:
        cost = _grouped_matmul_cost(grouped.group(1), shape, operand_shapes, *cost, load)
    return cost
