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

Grid (B, N_pad / U), both sequential (the window is carried from step to step). Step (b, u) takes update
block u: the row DMAs of block u + 1 are started before block u's are waited for (a second SMEM view of the
order array, one block ahead, names their sources), so the gather overlaps the adds.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.row_scatter.packing import packed_width, unpack_bf16_pairs
from pallas_kernels.tpu_utils import pad_axis, round_up

SUBLANES = 8     # rows of a (8, 128) fp32 tile: window starts are multiples of it (tile-aligned DMAs)


def _kernel(order_ref, next_order_ref, target_ref, rows_hbm, d_in_hbm, d_hbm, buf, sem, window_ref, window_sem,
            start_ref, *, n_blocks, block, window, n_rows, n_rows_pad, W):
    # order_ref / next_order_ref / target_ref (SMEM) [block]: this block's sources, the next block's sources,
    # this block's targets; rows_hbm [B, N_pad, 1, W] (uint32 [.., 1, Wp]: packed); d_hbm [B, S_pad, W] fp32 (d_in_hbm, the same buffer);
    # buf [2, block, 1, W] fp32; window_ref [window, W] fp32; start_ref (SMEM) [1]: the window's first row,
    # -1 while none is loaded.
    del d_in_hbm                                    # aliased to d_hbm: read and written through that ref
    b, u = pl.program_id(0), pl.program_id(1)
    slot = u % 2

    def row_copy(source, s, j):
        return pltpu.make_async_copy(rows_hbm.at[b, source], buf.at[s, j], sem.at[s])

    def start_block(src_ref, s):
        def start_row(j, carry):
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
    def _first_block():
        start_ref[0] = -1
        start_block(order_ref, 0)

    @pl.when(u + 1 < n_blocks)
    def _prefetch_next_block():
        start_block(next_order_ref, 1 - slot)

    def wait_row(j, carry):
        row_copy(0, slot, j).wait()                 # same-sized descriptor: waits for one row's bytes
        return carry

    jax.lax.fori_loop(0, block, wait_row, 0)

    def add(j, carry):
        t = target_ref[j]

        @pl.when(t < n_rows)                        # masked updates carry the sentinel n_rows, sorted last
        def _add():
            first = start_ref[0]

            @pl.when((first < 0) | (t >= first + window))
            def _move_window():
                @pl.when(first >= 0)
                def _write_back():
                    window_copy(first, load=False)
                new_first = jnp.minimum((t // SUBLANES) * SUBLANES, n_rows_pad - window)
                window_copy(new_first, load=True)
                start_ref[0] = new_first

            r = t - start_ref[0]
            row = buf[slot, j]
            row = unpack_bf16_pairs(row, W) if row.dtype == jnp.uint32 else row.astype(jnp.float32)
            window_ref[pl.ds(r, 1), :] += row
        return carry

    jax.lax.fori_loop(0, block, add, 0)

    @pl.when((u == n_blocks - 1) & (start_ref[0] >= 0))
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


def sorted_row_scatter_add(d_BSW, rows_BN1W, order_BN, target_BN, *, block=512, window=2048, interpret=False):
    """d [B, S, W] fp32 with d[b, target[b, n]] += rows[b, order[b, n]] for every n whose target < S.
    ``target`` ascending per batch row (masked updates: S, last), ``order`` the updates' positions in rows
    [B, N, 1, W] (W a multiple of 128: the rows array's (1, 128) tiles make each row one DMA), or uint32 rows
    [B, N, 1, packed_width(W)] of packed bf16 pairs (packing.py). S is padded to a multiple of 8 and N to
    ``block`` here."""
    B, S, W = d_BSW.shape
    N = rows_BN1W.shape[1]
    Wr = packed_width(W) if rows_BN1W.dtype == jnp.uint32 else W
    if d_BSW.dtype != jnp.float32 or W % 128 or rows_BN1W.shape != (B, N, 1, Wr) or order_BN.shape != (B, N) \
            or target_BN.shape != (B, N):
        raise ValueError(f"sorted_row_scatter_add: want fp32 d [B, S, W] (W a multiple of 128), rows [B, N, 1, W] "
                         f"(uint32 packed: [B, N, 1, {Wr}]), order and target [B, N]; got d {d_BSW.shape} "
                         f"{d_BSW.dtype}, rows {rows_BN1W.shape} {rows_BN1W.dtype}, order {order_BN.shape}, "
                         f"target {target_BN.shape}")
    S_pad = round_up(S, SUBLANES)
    window = min(round_up(window, SUBLANES), S_pad)
    block = min(block, round_up(N, 8))
    N_pad = round_up(N, block)
    n_blocks = N_pad // block
    d = pad_axis(d_BSW, 1, S_pad)
    order = pad_axis(order_BN.astype(jnp.int32), 1, N_pad).reshape(-1)
    target = pad_axis(target_BN.astype(jnp.int32), 1, N_pad, value=S).reshape(-1)
    rows = pad_axis(rows_BN1W, 1, N_pad)
    smem_block = functools.partial(pl.BlockSpec, (block,), memory_space=pltpu.SMEM)
    out = pl.pallas_call(
        functools.partial(_kernel, n_blocks=n_blocks, block=block, window=window, n_rows=S, n_rows_pad=S_pad, W=W),
        grid=(B, n_blocks),
        in_specs=[smem_block(lambda b, u: (b * n_blocks + u,)),
                  smem_block(lambda b, u: (b * n_blocks + jnp.minimum(u + 1, n_blocks - 1),)),
                  smem_block(lambda b, u: (b * n_blocks + u,)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(d.shape, jnp.float32),
        scratch_shapes=[pltpu.VMEM((2, block, 1, Wr), rows.dtype), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((window, W), jnp.float32), pltpu.SemaphoreType.DMA(()),
                        pltpu.SMEM((1,), jnp.int32)],
        input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="sorted_row_scatter_add",
        cost_estimate=_cost(B, N_pad, S_pad, window, W, Wr * max(rows.dtype.itemsize, 4) // 4),
    )(order, order, target, rows, d)
    return out[:, :S]
