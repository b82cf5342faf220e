"""Pallas TPU kernel: a chip's routed-expert SwiGLU of the rows it received, packed INT4 experts, in one call
(the computation: reference.py).

A decode step with many tokens per chip sends each (token, choice) row to its expert's chip
(glm5_jax/model/moe/decode_a2a.py). The rows a chip receives, R = chips x capacity of them, most of them empty
send slots, arrive as [R, D/128, 128] (each row its own HBM tiles). The XLA form around the INT4 block kernel
(`decode_a2a.expert_rows` without this kernel) gathers them into expert-sorted row blocks, relays them out to
[blocks, rows, D], runs three INT4 calls (gate, up, down) with fp32 [blocks, rows, F] and [blocks, rows, D]
results between them, casts, relays out and gathers each received row's result back: ~8 passes over
capacity-padded arrays a layer. Here:

    grid (2 parts "parallel", used blocks / 2 (dynamic), F tiles): part p's step u runs row block g = 2u + p
    (the two TensorCores of a chip take alternate blocks, so the few used ones split evenly);
    f == 0: DMA the block's rows (slot table ``slot_row``: the received row in each slot, R for a padding
            slot, which is never read or written) from HBM into VMEM and lay them out [rows, D];
    every f: gate and up for F columns f*tf .. (f+1)*tf (block's expert by scalar prefetch, its packed words
            and scales read in place from the stacked [L, E, ...] arrays, layer by scalar prefetch), SwiGLU,
            rounded to the compute dtype, and its down-product share added to an fp32 [rows, D] accumulator;
    last f: the accumulator rounded to the rows' dtype, DMA'd row by row to the received row's place in the
            output [R, D/128, 128] (rows of padding and empty slots are NEVER WRITTEN: unspecified).

The dequantisation and the products' accumulation order are the INT4 block kernel's
(pallas_kernels/int4_matmul: chunks of 8G contraction rows, fp32 partial sums added chunk by chunk), so the
result equals that path's gate / up / SwiGLU / down rounded to the compute dtype.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int4_matmul import tiling
from pallas_kernels.int4_matmul.kernel import accumulate_dequantized_product
from pallas_kernels.tpu_utils import LANES

NAME = "int4_moe_rows"
PER_WORD = tiling.PER_WORD
PARTS = 2                       # a chip's TensorCores (v4 / v5p megacore): alternate row blocks
WEIGHT_BUDGET = 20 << 20        # the three double-buffered weight windows of one F tile
VMEM_LIMIT = 56 << 20


def f_tile(D: int, F: int, group_size: int, budget: int = WEIGHT_BUDGET) -> int:
    """F columns per grid step: the largest divisor of F in whole chunks of 8G whose gate, up and down windows
    (packed words, double-buffered) fit ``budget`` (the smallest chunk when none does)."""
    chunk = PER_WORD * group_size
    fits = [t for t in tiling.divisors(F, chunk) if t % chunk == 0 and 2 * 3 * D * t // 2 <= budget]
    return fits[0] if fits else chunk


def _kernel(layer_ref, block_expert_ref, n_used_ref, slot_ref, rows_hbm, gp_ref, gs_ref, up_ref, us_ref, dp_ref,
            ds_ref, y_hbm, tiles, x_ref, gate_acc, up_acc, acc, sem, *, R, group_size, dtype):
    # slot_ref (SMEM) [n x rows]: every block's slots (a rank-1 SMEM window must be the whole array or >= 128);
    # rows_hbm / y_hbm [R, D/128, 128] (HBM); tiles (VMEM) [rows, D/128, 128]: the block's rows as DMA'd and its
    # results before their DMAs; x_ref [rows, D] in ``dtype``; gate_acc / up_acc [rows, tf] fp32; acc [rows, D]
    # fp32
    p, u, f = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = PARTS * u + p
    used = g < n_used_ref[0]
    rows, n_tiles = tiles.shape[0], tiles.shape[1]

    def each_row(action):
        def body(i, carry):
            r = slot_ref[g * rows + i]

            @pl.when(r < R)
            def _():
                action(i, jnp.clip(r, 0, R - 1))
            return carry
        jax.lax.fori_loop(0, rows, body, 0)

    @pl.when(used & (f == 0))
    def _load_rows():
        each_row(lambda i, r: pltpu.make_async_copy(rows_hbm.at[r], tiles.at[i], sem.at[0]).start())
        each_row(lambda i, r: pltpu.make_async_copy(rows_hbm.at[r], tiles.at[i], sem.at[0]).wait())
        for j in range(n_tiles):
            x_ref[:, j * LANES:(j + 1) * LANES] = tiles[:, j, :].astype(x_ref.dtype)
        acc[...] = jnp.zeros_like(acc)

    @pl.when(used)
    def _swiglu():
        x = x_ref[...]
        gate_acc[...] = jnp.zeros_like(gate_acc)
        up_acc[...] = jnp.zeros_like(up_acc)
        accumulate_dequantized_product(gate_acc, x, gp_ref, gs_ref, group_size)
        accumulate_dequantized_product(up_acc, x, up_ref, us_ref, group_size)
        h = (jax.nn.silu(gate_acc[...]) * up_acc[...]).astype(dtype)
        accumulate_dequantized_product(acc, h, dp_ref, ds_ref, group_size)

    @pl.when(used & (f == pl.num_programs(2) - 1))
    def _store_rows():
        y = acc[...].astype(tiles.dtype)
        for j in range(n_tiles):
            tiles[:, j, :] = y[:, j * LANES:(j + 1) * LANES]
        each_row(lambda i, r: pltpu.make_async_copy(tiles.at[i], y_hbm.at[r], sem.at[1]).start())
        each_row(lambda i, r: pltpu.make_async_copy(tiles.at[i], y_hbm.at[r], sem.at[1]).wait())


def cost(n_blocks, rows, D, F, group_size, row_itemsize, scale_itemsize, slots) -> pl.CostEstimate:
    """What ``n_blocks`` used row blocks cost (an expectation: may be fractional): three products on all their
    ``rows`` rows, each block's expert weights read once (packed words and scales), its rows read and written
    once by DMA; the slot table of all ``slots`` read once. The cost model reads the blocks back as
    flops / (2 rows 3 D F) (glm5_jax/cost/hlo_cost/kernels.py)."""
    weights = 3 * (D * F // 2 + D // group_size * F * scale_itemsize)
    return pl.CostEstimate(flops=round(n_blocks * 2 * rows * 3 * D * F),
                           transcendentals=round(n_blocks * rows * F),
                           bytes_accessed=round(n_blocks * (weights + 2 * rows * D * row_itemsize) + slots * 4))


def int4_moe_rows(rows_RtL, slot_row_P, block_expert_n, n_used, gate_packed, gate_scale, up_packed, up_scale,
                  down_packed, down_scale, layer=None, *, group_size, dtype, cost_blocks=None, tile_f=None,
                  interpret=False):
    """[R, D/128, 128] in the rows' dtype (reference.py): row r's SwiGLU by the expert of the block whose slot
    holds it, rows no used slot holds unspecified. ``rows`` [R, D/128, 128]; ``slot_row`` int32 [n x rows]: the
    received row in each slot of n blocks of ``rows`` (R: padding); ``block_expert`` [n] local experts; blocks
    from ``n_used`` on are skipped. Weights stacked [L, E, ...] with ``layer`` (int32 scalar), or [E, ...]
    without: gate / up words [.., D/8, F] and scales [.., D/G, F], down [.., F/8, D] / [.., F/G, D].
    ``cost_blocks``: the used blocks expected on the busiest chip (declared cost; default all n)."""
    if layer is None:
        gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale = (
            w[None] for w in (gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale))
        layer = 0
    R, n_tiles, lanes = rows_RtL.shape
    D = n_tiles * lanes
    n = block_expert_n.shape[0]
    L, E, _, F = gate_packed.shape
    G = group_size
    chunk = PER_WORD * G
    rows = slot_row_P.shape[0] // max(n, 1)
    if (lanes != LANES or slot_row_P.shape != (n * rows,) or rows % 8 or D % chunk or F % chunk
            or up_packed.shape != gate_packed.shape or gate_packed.shape[2] * PER_WORD != D
            or gate_scale.shape != (L, E, D // G, F) or up_scale.shape != gate_scale.shape
            or down_packed.shape != (L, E, F // PER_WORD, D) or down_scale.shape != (L, E, F // G, D)):
        raise ValueError(f"int4_moe_rows: want rows [R, D/128, 128], slot_row [n x rows] (rows a multiple of 8), "
                         f"block_expert [n], gate / up words [L, E, D/8, F] and scales [L, E, D/G, F], down "
                         f"[L, E, F/8, D] / [L, E, F/G, D], D and F multiples of 8G = {chunk}; got rows "
                         f"{rows_RtL.shape}, slot_row {slot_row_P.shape}, block_expert {block_expert_n.shape}, "
                         f"gate {gate_packed.shape} / {gate_scale.shape}, up {up_packed.shape} / {up_scale.shape}, "
                         f"down {down_packed.shape} / {down_scale.shape}")
    tf = f_tile(D, F, G) if tile_f is None else tiling.fitting_tile(F, tile_f, chunk)
    half = -(-n // PARTS)
    n_used = jnp.reshape(n_used, (1,)).astype(jnp.int32)
    # n_used >= 0: a truncating division (jnp's floor division adds sign corrections, each a scalar op)
    grid = (PARTS, jnp.clip(jax.lax.div(n_used[0] + 1, jnp.int32(PARTS)), 1, half), F // tf)
    by_chunk = lambda s, k: s.reshape(L, E, k // chunk, PER_WORD, s.shape[-1])   # noqa: E731  [chunk, group]

    def expert(p, u, ly, be, nu):
        # a skipped block (past n_used) names the last used block's expert: the pipeline fetches nothing new
        return be[jnp.clip(jnp.minimum(PARTS * u + p, nu[0] - 1), 0, n - 1)]

    def weights(cols_of_f):
        return lambda rows_, cols: pl.BlockSpec(
            (None, None, rows_, cols),
            lambda p, u, f, ly, be, nu: (ly[0], expert(p, u, ly, be, nu), *cols_of_f(f)))

    up_block = weights(lambda f: (0, f))
    down_block = weights(lambda f: (f, 0))

    def up_scale_block():
        return pl.BlockSpec((None, None, D // chunk, PER_WORD, tf),
                            lambda p, u, f, ly, be, nu: (ly[0], expert(p, u, ly, be, nu), 0, 0, f))

    def down_scale_block():
        return pl.BlockSpec((None, None, tf // chunk, PER_WORD, D),
                            lambda p, u, f, ly, be, nu: (ly[0], expert(p, u, ly, be, nu), f, 0, 0))

    return pl.pallas_call(
        functools.partial(_kernel, R=R, group_size=G, dtype=dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=grid,
            in_specs=[pl.BlockSpec((n * rows,), lambda p, u, f, *_: (0,), memory_space=pltpu.SMEM),
                      pl.BlockSpec(memory_space=pl.ANY),
                      up_block(D // PER_WORD, tf), up_scale_block(),
                      up_block(D // PER_WORD, tf), up_scale_block(),
                      down_block(tf // PER_WORD, D), down_scale_block()],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((rows, n_tiles, LANES), rows_RtL.dtype), pltpu.VMEM((rows, D), dtype),
                            pltpu.VMEM((rows, tf), jnp.float32), pltpu.VMEM((rows, tf), jnp.float32),
                            pltpu.VMEM((rows, D), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct(rows_RtL.shape, rows_RtL.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=NAME,
        cost_estimate=cost(n if cost_blocks is None else min(n, cost_blocks), rows, D, F, G,
                           rows_RtL.dtype.itemsize, gate_scale.dtype.itemsize, n * rows),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), block_expert_n.astype(jnp.int32), n_used,
      slot_row_P.astype(jnp.int32), rows_RtL, gate_packed, by_chunk(gate_scale, D), up_packed, by_chunk(up_scale, D),
      down_packed, by_chunk(down_scale, F))
