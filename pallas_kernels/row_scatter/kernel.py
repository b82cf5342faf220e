"""Pallas TPU kernel: add many rows into a large fp32 array at given rows, walking the updates sorted by
target row through a VMEM window of the target array.

XLA's scatter-add reads and writes back, for every update, the whole (8, 128) HBM tile its target row lies
in: 8 rows of 128 fp32 lanes (4 KiB) for a 512-byte row. When the updates are many and spread over the whole
array (the key gradient of a long-context shard: two million updates into 202,752 rows), almost every tile is
touched many times. Here the updates arrive sorted by target (``order``: which update comes n-th; ``target``:
its row, ascending, the sentinel S last for masked ones). The rows are fp32 (or bf16) [B, N, 1, W], or bf16 pairs
packed in uint32 lanes [B, N, 1, packed_width(W)] (packing.py; 40% fewer bytes at W = 640), unpacked in VMEM and
added in fp32. The kernel keeps one window of ``window`` consecutive
rows of d in VMEM; an update past the window writes the window back and loads the one starting at its row (8-
aligned): every row of d is read and written at most once per call, each update's row is one row DMA (W
32-bit words, from the (1, 128)-tiled [B, N, 1, W] rows array), and the adds are single-row read-modify-writes
in VMEM. Sorted, two updates of one row add one after the other: no race.

Two TensorCores (a megacore chip, v4 / v5p) split the work: each batch row's sorted updates are cut at an
8-aligned row near their median target (clamped so that either side holds a whole window), and grid axis 0
("parallel", one index per core) picks the side. A part owns the rows of d on its side: it adds only the
updates that target them (the update block holding the cut is read by both parts, each skipping the other's)
and keeps its windows there, so the two cores never write the same row. Grid (parts, B, update blocks): the
block axis is bounded at run time by the most blocks a part needs (a dynamic grid dimension, as megablox
bounds its row tiles), the later two sequential (the window is carried from step to step). Step (p, b, u)
takes part p's u-th update block: the row DMAs of its next block are started before this block's are waited
for (a second SMEM view of the order and target arrays, one block ahead, names their sources), so the gather
overlaps the adds.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.row_scatter.packing import packed_width, unpack_bf16_pairs
from pallas_kernels.tpu_utils import pad_axis, round_up

NAME = "sorted_row_scatter_add"   # the pallas_call's (and its Mosaic function's) name
SUBLANES = 8     # rows of a (8, 128) fp32 tile: window starts are multiples of it (tile-aligned DMAs)


def _kernel(split_ref, blocks_ref, order_ref, next_order_ref, target_ref, next_target_ref, rows_hbm, d_in_hbm,
            d_hbm, buf, sem, window_ref, window_sem, start_ref, *, n_parts, block, window, n_rows, n_rows_pad, W):
    # split_ref (SMEM) [B]: the first row of the last part; blocks_ref (SMEM) [n_parts * B * 2 + 1]: each
    # (part, batch row)'s first update block and the block past its last, then the grid's block count.
    # order_ref / next_order_ref / target_ref / next_target_ref (SMEM) [block]: this block's and the next
    # block's sources and targets; rows_hbm [B, N_pad, 1, W] (uint32 [.., 1, Wp]: packed); d_hbm [B, S_pad, W]
    # fp32 (d_in_hbm, the same buffer); buf [2, block, 1, W] fp32; window_ref [window, W] fp32; start_ref
    # (SMEM) [1]: the window's first row, -1 while none is loaded.
    del d_in_hbm                                    # aliased to d_hbm: read and written through that ref
    p, b, u = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_batch = pl.num_programs(1)
    part = p * n_batch + b
    n = blocks_ref[2 * part] + u                    # the update block this step adds
    end = blocks_ref[2 * part + 1]
    last_step = blocks_ref[2 * n_parts * n_batch] - 1
    slot = u % 2
    # the rows this part owns: [lo, hi) of d (hi_pad: where its windows must end, a multiple of 8)
    split = split_ref[b]
    lo = jnp.where(p == 0, 0, split)
    hi = jnp.where(p == n_parts - 1, n_rows, split)
    hi_pad = jnp.where(p == n_parts - 1, n_rows_pad, split)

    def owned(t):
        return (t >= lo) & (t < hi)

    def row_copy(source, s, j):
        return pltpu.make_async_copy(rows_hbm.at[b, source], buf.at[s, j], sem.at[s])

    def start_block(src_ref, tgt_ref, s):
        def start_row(j, carry):
            @pl.when(owned(tgt_ref[j]))             # the other part's (and masked) updates move nothing
            def _start():
                row_copy(src_ref[j], s, j).start()
            return carry
        jax.lax.fori_loop(0, block, start_row, 0)

    def window_copy(first, load):
        rows = d_hbm.at[b, pl.ds(pl.multiple_of(first, SUBLANES), window)]
        copy = pltpu.make_async_copy(rows, window_ref, window_sem) if load else \
            pltpu.make_async_copy(window_ref, rows, window_sem)
        copy.start()
        copy.wait()

    @pl.when(u == 0)
    def _first_step():
        start_ref[0] = -1

        @pl.when(n < end)
        def _first_block():
            start_block(order_ref, target_ref, 0)

    @pl.when(n + 1 < end)
    def _prefetch_next_block():
        start_block(next_order_ref, next_target_ref, 1 - slot)

    @pl.when(n < end)
    def _add_block():
        def wait_row(j, carry):
            @pl.when(owned(target_ref[j]))
            def _wait():
                row_copy(0, slot, j).wait()         # same-sized descriptor: waits for one row's bytes
            return carry

        jax.lax.fori_loop(0, block, wait_row, 0)

        def add(j, carry):
            t = target_ref[j]

            @pl.when(owned(t))                      # masked updates carry the sentinel n_rows, sorted last
            def _add():
                first = start_ref[0]

                @pl.when((first < 0) | (t >= first + window))
                def _move_window():
                    @pl.when(first >= 0)
                    def _write_back():
                        window_copy(first, load=False)
                    new_first = jnp.minimum((t // SUBLANES) * SUBLANES, hi_pad - window)
                    window_copy(new_first, load=True)
                    start_ref[0] = new_first

                r = t - start_ref[0]
                row = buf[slot, j]
                row = unpack_bf16_pairs(row, W) if row.dtype == jnp.uint32 else row.astype(jnp.float32)
                window_ref[pl.ds(r, 1), :] += row
            return carry

        jax.lax.fori_loop(0, block, add, 0)

    @pl.when((u == last_step) & (start_ref[0] >= 0))
    def _last_write_back():
        window_copy(start_ref[0], load=False)


def _cost(B, n_updates_pad, n_rows_pad, window, W, row_words):
    """Per call: each update's row (one DMA of ``row_words`` 32-bit words), its source (read twice: this block's and the
    previous step's look-ahead) and target; d's rows at most once in and once out per window load (every
    window but the last starts past the previous one)."""
    loads = min(n_updates_pad, -(-n_rows_pad // window) + 1)
    d_bytes = 2 * min(loads * window, n_rows_pad + window) * W * 4
    return pl.CostEstimate(flops=B * n_updates_pad * W, transcendentals=0,
                           bytes_accessed=B * (n_updates_pad * (row_words * 4 + 12) + d_bytes))


def _part_blocks(target_BN, *, n_parts, n_rows, n_rows_pad, window, block):
    """(split [B], blocks [n_parts * B * 2 + 1]): each batch row's updates (sorted targets, the sentinel
    ``n_rows`` last) cut at an 8-aligned row near the median valid target, clamped so that each part's rows hold
    a whole window; each (part, batch row)'s first update block and the block past its last (the block holding
    the cut is read by both parts, each adding only its own rows); last, the most blocks a part runs (>= 1)."""
    B, _ = target_BN.shape
    n_valid = jnp.sum(target_BN < n_rows, axis=1).astype(jnp.int32)
    ceil_blocks = lambda n: (n + block - 1) // block  # noqa: E731
    if n_parts == 1:
        split = jnp.full((B,), n_rows_pad, jnp.int32)
        bounds = jnp.stack([jnp.zeros_like(n_valid), ceil_blocks(n_valid)], -1)[None]
    else:
        median = jnp.take_along_axis(target_BN, (n_valid // 2)[:, None], axis=1)[:, 0]
        split = jnp.clip(median // SUBLANES * SUBLANES, window, n_rows_pad - window).astype(jnp.int32)
        n_low = jnp.sum(target_BN < split[:, None], axis=1).astype(jnp.int32)
        bounds = jnp.stack([jnp.stack([jnp.zeros_like(n_low), ceil_blocks(n_low)], -1),
                            jnp.stack([n_low // block, ceil_blocks(n_valid)], -1)])
    steps = jnp.maximum(jnp.max(bounds[..., 1] - bounds[..., 0]), 1)
    return split, jnp.concatenate([bounds.reshape(-1), steps[None]]).astype(jnp.int32)


def sorted_row_scatter_add(d_BSW, rows_BN1W, order_BN, target_BN, *, block=512, window=2048, parts=2,
                           interpret=False):
    """d [B, S, W] fp32 with d[b, target[b, n]] += rows[b, order[b, n]] for every n whose target < S.
    ``target`` ascending per batch row (masked updates: S, last), ``order`` the updates' positions in rows
    [B, N, 1, W] (W a multiple of 128: the rows array's (1, 128) tiles make each row one DMA), or uint32 rows
    [B, N, 1, packed_width(W)] of packed bf16 pairs (packing.py). S is padded to a multiple of 8 and N to
    ``block`` here. ``parts``: the updates are cut into that many runs of rows (2: one per TensorCore of a
    megacore chip, when S holds two windows), each a "parallel" grid index with its own window (module
    docstring)."""
    B, S, W = d_BSW.shape
    N = rows_BN1W.shape[1]
    Wr = packed_width(W) if rows_BN1W.dtype == jnp.uint32 else W
    if d_BSW.dtype != jnp.float32 or W % 128 or rows_BN1W.shape != (B, N, 1, Wr) or order_BN.shape != (B, N) \
            or target_BN.shape != (B, N):
        raise ValueError(f"sorted_row_scatter_add: want fp32 d [B, S, W] (W a multiple of 128), rows [B, N, 1, W] "
                         f"(uint32 packed: [B, N, 1, {Wr}]), order and target [B, N]; got d {d_BSW.shape} "
                         f"{d_BSW.dtype}, rows {rows_BN1W.shape} {rows_BN1W.dtype}, order {order_BN.shape}, "
                         f"target {target_BN.shape}")
    if parts not in (1, 2):
        raise ValueError(f"sorted_row_scatter_add: parts is 1 or 2, got {parts}")
    S_pad = round_up(S, SUBLANES)
    window = min(round_up(window, SUBLANES), S_pad)
    n_parts = parts if S_pad >= parts * window else 1
    block = min(block, round_up(N, 8))
    N_pad = round_up(N, block)
    n_blocks = N_pad // block
    d = pad_axis(d_BSW, 1, S_pad)
    target_BN = pad_axis(target_BN.astype(jnp.int32), 1, N_pad, value=S)
    split, blocks = _part_blocks(target_BN, n_parts=n_parts, n_rows=S, n_rows_pad=S_pad, window=window, block=block)
    order = pad_axis(order_BN.astype(jnp.int32), 1, N_pad).reshape(-1)
    target = target_BN.reshape(-1)
    rows = pad_axis(rows_BN1W, 1, N_pad)

    def update_block(ahead):
        def index(p, b, u, split_ref, blocks_ref):
            del split_ref
            return (b * n_blocks + jnp.minimum(blocks_ref[2 * (p * B + b)] + u + ahead, n_blocks - 1),)
        return pl.BlockSpec((block,), index, memory_space=pltpu.SMEM)

    out = pl.pallas_call(
        functools.partial(_kernel, n_parts=n_parts, block=block, window=window, n_rows=S, n_rows_pad=S_pad, W=W),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_parts, B, blocks[-1]),                         # the update blocks: dynamic, >= 1
            in_specs=[update_block(0), update_block(1), update_block(0), update_block(1),
                      pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((2, block, 1, Wr), rows.dtype), pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((window, W), jnp.float32), pltpu.SemaphoreType.DMA(()),
                            pltpu.SMEM((1,), jnp.int32)]),
        out_shape=jax.ShapeDtypeStruct(d.shape, jnp.float32),
        input_output_aliases={7: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name=NAME,
        cost_estimate=_cost(B, N_pad, S_pad, window, W, Wr * max(rows.dtype.itemsize, 4) // 4),
    )(split, blocks, order, order, target, target, rows, d)
    return out[:, :S]
