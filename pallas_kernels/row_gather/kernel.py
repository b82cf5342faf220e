"""Pallas TPU kernel: gather rows idx[b, k] of one layer of a stacked cache [L, B, S, C], read in place.

The decode layer scan holds every layer's latent cache stacked [L, B, S, C]. Slicing a layer out
(``dynamic_index_in_dim``) for an XLA gather copies the layer's whole [B, S, C] slice before the gather
reads it. Here the stacked cache stays in HBM (memory space ANY: the custom call takes the stacked buffer,
never a slice) and the layer arrives by scalar prefetch.

Tile granularity: XLA:TPU lays a 16- or 32-bit [.., S, C] array out in (8, 128) tiles over its two minor
dims (bf16 as (8, 128)(2, 1): row pairs share 32-bit words), and Mosaic's DMAs may only start a slice of a
tiled dim at a tile boundary. So a selected row's DMA brings its whole 8-row tile group (8 x C values) into
VMEM; the row is then read out of VMEM (a 32-bit dynamic-sublane load; for bf16 the word row holding the
pair, and the half for the row's parity: the even row in the low 16 bits) and written to the output block.
Each row therefore costs 8 rows of HBM reads (`tile_group_bytes`, what the declared cost says).

Rows are walked in blocks of ``block`` (the indices of a block in SMEM, a BlockSpec window of the flat
[B * K] index array). Grid (P, n): P parallel halves (a chip's TensorCores), each running n consecutive
blocks in order; block g = p * n + u. The DMAs of block g + 1 are started before block g's are waited for
(a second SMEM view of the indices, one block ahead, names their sources), so up to 2 x ``block`` DMAs are
in flight. Indices outside [0, S) (and a layer outside [0, L)) are clamped into range before the DMA, as
XLA's gather clamps its start indices: no DMA reads outside the layer's rows; the caller masks what it must
not use.

Streamed form: when the selected rows' tile groups would cost more HBM bytes than the batch row's whole layer
slice (K x 8 > S, e.g. 2048 of 8192 slots: twice the slice) and that slice fits VMEM, each grid step b instead
reads layer ``layer``'s [S, C] rows of batch row b whole (one blocked, double-buffered copy, the layer chosen
by scalar prefetch) and picks the K rows out of VMEM as above. Same rows, same order: the output is identical.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu_utils import LANES, pad_axis, round_up

STREAM_MAX_SLICE_BYTES = 12 << 20   # a batch row's [S, C] layer slice in VMEM, double-buffered (v5p: 64 MiB/core)
STREAM_VMEM_LIMIT = 44 << 20
TILE_ROWS = 8        # rows of an XLA:TPU HBM tile of a 16- or 32-bit array: the smallest row DMA
GROUP = 16           # output rows assembled and stored at once (a bf16 VMEM tile's rows: aligned stores)
_HIGH_HALF = 0xFFFF0000


def _row_of_tile(tile_ref, j, r):
    """Row r (dynamic) of VMEM tile group tile_ref[j] ([8, C]) as fp32 [1, C]. A row narrower than one lane tile
    (C < 128) cannot be loaded at a dynamic sublane: the group is then summed over its rows with all but row r
    masked (one vreg)."""
    if tile_ref.shape[-1] < LANES:
        group = tile_ref[j].astype(jnp.float32)
        pick = jax.lax.broadcasted_iota(jnp.int32, group.shape, 0) == r
        return jnp.sum(jnp.where(pick, group, 0.0), axis=0, keepdims=True)
    if tile_ref.dtype == jnp.float32:
        return tile_ref[j, pl.ds(r, 1), :]
    words = tile_ref.bitcast(jnp.uint32)[j, pl.ds(r // 2, 1), :]           # the row pair (r & ~1, r | 1)
    bits = jnp.where(r % 2 == 0, words << 16, words & jnp.uint32(_HIGH_HALF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)                # bf16 bits in the high half: exact


def _row_of_slice(rows_ref, r):
    """Row r (dynamic) of the VMEM slice rows_ref ([1, 1, S, C]: Mosaic bitcasts the block's full rank) as fp32
    [1, C], read as `_row_of_tile` reads a tile group's row (the 8-row group at r when C < 128)."""
    if rows_ref.shape[-1] < LANES:
        group = rows_ref[0, 0, pl.ds(pl.multiple_of((r // TILE_ROWS) * TILE_ROWS, TILE_ROWS), TILE_ROWS), :]
        pick = jax.lax.broadcasted_iota(jnp.int32, group.shape, 0) == r % TILE_ROWS
        return jnp.sum(jnp.where(pick, group.astype(jnp.float32), 0.0), axis=0, keepdims=True)
    if rows_ref.dtype == jnp.float32:
        return rows_ref[0, 0, pl.ds(r, 1), :]
    words = rows_ref.bitcast(jnp.uint32)[0, 0, pl.ds(r // 2, 1), :]
    bits = jnp.where(r % 2 == 0, words << 16, words & jnp.uint32(_HIGH_HALF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _stream_kernel(layer_ref, idx_ref, rows_ref, out_ref, *, K_pad, S):
    # idx_ref (SMEM) [K_pad]: batch row b's indices; rows_ref (VMEM) [1, 1, S, C]: its layer slice; out_ref [K_pad, C]
    def store_group(m, carry):
        rows = [_row_of_slice(rows_ref, jnp.clip(idx_ref[m * GROUP + i], 0, S - 1)) for i in range(GROUP)]
        out_ref[pl.ds(pl.multiple_of(m * GROUP, GROUP), GROUP), :] = jnp.concatenate(rows, 0).astype(out_ref.dtype)
        return carry
    jax.lax.fori_loop(0, K_pad // GROUP, store_group, 0)


def slice_bytes(S: int, C: int, itemsize: int) -> int:
    """HBM (and VMEM) bytes of one batch row's [S, C] layer slice, C padded to whole 128-lane tiles."""
    return S * round_up(C, LANES) * itemsize


def streams(B: int, S: int, C: int, K_pad: int, itemsize: int) -> bool:
    """Whether the streamed form reads fewer bytes than the tile-group DMAs (module docstring): K_pad tile groups
    cost more than the slice, the slice fits VMEM, the batch rows split evenly over a chip's two cores or there is
    one (its core streams the slice while the DMAs would read half of 2 x the slice on each core: the same bytes on
    the busiest core, in one bulk copy and one grid step instead of K_pad row DMAs), and K_pad is a power of two
    (Mosaic's 1-D SMEM index window)."""
    return (K_pad & (K_pad - 1) == 0 and K_pad * tile_group_bytes(C, itemsize) > slice_bytes(S, C, itemsize)
            and slice_bytes(S, C, itemsize) <= STREAM_MAX_SLICE_BYTES and (B % 2 == 0 or B == 1))


def _stream_gather(cache_LBSC, layer, idx, K_pad, interpret):
    L, B, S, C = cache_LBSC.shape
    itemsize = cache_LBSC.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_stream_kernel, K_pad=K_pad, S=S),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B,),
            in_specs=[pl.BlockSpec((K_pad,), lambda b, layer_ref: (b,), memory_space=pltpu.SMEM),
                      pl.BlockSpec((1, 1, S, C),
                                   lambda b, layer_ref: (jnp.clip(layer_ref[0], 0, L - 1), b, 0, 0))],
            out_specs=pl.BlockSpec((None, K_pad, C), lambda b, layer_ref: (b, 0, 0)),
        ),
        out_shape=jax.ShapeDtypeStruct((B, K_pad, C), cache_LBSC.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=STREAM_VMEM_LIMIT),
        interpret=interpret,
        name="stacked_row_gather_streamed",
        # every batch row's slice read, the K rows of C written, each index read once
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=B * (slice_bytes(S, C, itemsize) + K_pad * (C * itemsize + 4))),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), idx, cache_LBSC)


def _kernel(layer_ref, idx_ref, next_idx_ref, cache_hbm, out_ref, buf, sem, *, n, blocks_per_row, block, S, L):
    # layer_ref (SMEM, scalar prefetch) [1]; idx_ref / next_idx_ref (SMEM) [block]: this block's rows and the
    # next block's; cache_hbm [L, B, S, C] (HBM); out_ref [block, C] (VMEM, the output window); buf [2 * block,
    # 8, C] (VMEM): each row's tile group, slot s holding entries s * block ..; sem: one DMA semaphore per slot.
    p, u = pl.program_id(0), pl.program_id(1)
    g = p * n + u
    slot = u % 2
    layer = jnp.clip(layer_ref[0], 0, L - 1)

    def tile_copy(b, row, s, j):
        first = pl.multiple_of((row // TILE_ROWS) * TILE_ROWS, TILE_ROWS)
        return pltpu.make_async_copy(cache_hbm.at[layer, b, pl.ds(first, TILE_ROWS)], buf.at[s * block + j],
                                     sem.at[s])

    def start_block(src_ref, blk, s):
        b = blk // blocks_per_row

        def start_row(j, carry):
            tile_copy(b, jnp.clip(src_ref[j], 0, S - 1), s, j).start()
            return carry
        jax.lax.fori_loop(0, block, start_row, 0)

    @pl.when(u == 0)
    def _first_block():
        start_block(idx_ref, g, slot)

    @pl.when(u + 1 < n)
    def _prefetch_next_block():
        start_block(next_idx_ref, g + 1, 1 - slot)

    def wait_row(j, carry):
        tile_copy(0, 0, slot, j).wait()             # same-sized descriptor: waits for one tile group's bytes
        return carry
    jax.lax.fori_loop(0, block, wait_row, 0)

    def store_group(m, carry):
        rows = [_row_of_tile(buf, slot * block + m * GROUP + i, jnp.clip(idx_ref[m * GROUP + i], 0, S - 1) % TILE_ROWS)
                for i in range(GROUP)]
        out_ref[pl.ds(pl.multiple_of(m * GROUP, GROUP), GROUP), :] = jnp.concatenate(rows, 0).astype(out_ref.dtype)
        return carry
    jax.lax.fori_loop(0, block // GROUP, store_group, 0)


def tile_group_bytes(C: int, itemsize: int) -> int:
    """HBM bytes one selected row's DMA reads: its 8-row tile group, C padded to whole 128-lane tiles (module
    docstring; docs/cost_model.md, HBM bytes)."""
    return TILE_ROWS * round_up(C, LANES) * itemsize


def _cost(B, K_pad, C, itemsize):
    """Per call: every (padded) row's tile group read, the K rows of C written, each index read twice (this
    block's and the previous step's look-ahead)."""
    return pl.CostEstimate(flops=0, transcendentals=0,
                           bytes_accessed=B * K_pad * (tile_group_bytes(C, itemsize) + C * itemsize + 8))


def stacked_row_gather(cache_LBSC, layer, idx_BK, *, block=128, interpret=False, stream=None):
    """[B, K, C]: rows idx[b, k] (clamped into [0, S)) of layer ``layer`` (int32 scalar, clamped into [0, L))
    of ``cache`` [L, B, S, C] (bf16 or fp32, S a multiple of 8). K is padded to a multiple of ``block`` here
    (padding rows gather row 0, DMAs included). Mosaic takes a 1-D SMEM index window of a power of two >= 128
    entries, so ``block`` is one; the interpreter also takes smaller multiples of 16 (K rounded up to 16 at
    most: small test models). ``stream``: the streamed form (module docstring) or the tile-group DMAs; None:
    the streamed form where `streams`."""
    L, B, S, C = cache_LBSC.shape
    K = idx_BK.shape[1]
    if interpret:
        block = min(block, round_up(K, GROUP))
    if idx_BK.shape != (B, K) or block % GROUP or not (interpret or (block >= 128 and block & (block - 1) == 0)) \
            or S % TILE_ROWS or cache_LBSC.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"stacked_row_gather: want a bf16 or fp32 cache [L, B, S, C] (S a multiple of {TILE_ROWS}), "
                         f"idx [B={B}, K], a block a power of two >= 128 (interpreted: a multiple of {GROUP}); got "
                         f"cache {cache_LBSC.shape} {cache_LBSC.dtype}, idx {idx_BK.shape}, block {block}")
    K_pad = round_up(K, block)
    idx = pad_axis(idx_BK.astype(jnp.int32), 1, K_pad).reshape(-1)
    if streams(B, S, C, K_pad, cache_LBSC.dtype.itemsize) if stream is None else stream:
        return _stream_gather(cache_LBSC, layer, idx, K_pad, interpret)[:, :K]
    blocks_per_row = K_pad // block
    n_blocks = B * blocks_per_row
    P = 2 if n_blocks % 2 == 0 else 1            # two halves: one per TensorCore of a megacore chip
    n = n_blocks // P
    smem_block = functools.partial(pl.BlockSpec, (block,), memory_space=pltpu.SMEM)

    def out_block(p, u, layer_ref):
        return (p * n + u) // blocks_per_row, (p * n + u) % blocks_per_row, 0

    out = pl.pallas_call(
        functools.partial(_kernel, n=n, blocks_per_row=blocks_per_row, block=block, S=S, L=L),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(P, n),
            in_specs=[smem_block(lambda p, u, layer_ref: (p * n + u,)),
                      smem_block(lambda p, u, layer_ref: (p * n + jnp.minimum(u + 1, n - 1),)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, block, C), out_block),
            scratch_shapes=[pltpu.VMEM((2 * block, TILE_ROWS, C), cache_LBSC.dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct((B, K_pad, C), cache_LBSC.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="stacked_row_gather",
        cost_estimate=_cost(B, K_pad, C, cache_LBSC.dtype.itemsize),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), idx, idx, cache_LBSC)
    return out[:, :K]
