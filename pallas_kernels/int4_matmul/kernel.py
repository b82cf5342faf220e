"""Pallas TPU kernel: grouped dequantise-matmul over expert-aligned row blocks with packed INT4 weights.

Grid (output tile j, row block i, contraction tile k). The expert of each row block and the number of
blocks holding rows (``n_used``) arrive by scalar prefetch; the weight BlockSpec picks the block's expert,
so only packed INT4 words (K*N/2 bytes per expert) and their scales travel from HBM. In VMEM each chunk of
8G contraction rows is rebuilt from its G packed rows: nibble j of those words is scale group j of the
chunk (layout in packing.py), so a shift, a mask, a subtract and one broadcast scale row per group give the
fp32 weights q * s, cast to the activation dtype for the MXU; products accumulate in an fp32 VMEM scratch
over the k tiles.

The row-block axis is bounded at run time by ``n_used`` (at least 1), as JAX's megablox grouped matmul
bounds its row tiles: blocks past ``n_used`` (the capacity padding) cost no grid step and their output is
NEVER WRITTEN (unspecified; consumers mask them, ops.py). That axis is "arbitrary" (megablox's choice for
its dynamic axis too: only static "parallel" axes are known to be split over a megacore chip's two
TensorCores), and the output-tile axis, first, is the "parallel" one. Tiles: tiling.py.

Weights may carry a leading layers axis ([L, E, K/8, N], a scanned model's stacked parameters) with the
layer to use as a third scalar: the BlockSpecs then read that layer's tiles straight from the stacked
array, so a layer loop needs no per-layer copy of its weights for the custom call.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int4_matmul import tiling
from pallas_kernels.kernel_math import mm

PER_WORD = tiling.PER_WORD
NAME = "int4_block_matmul"     # the kernel's name in its Mosaic custom call (the cost model's rule reads it)


def dequantized_chunk(packed_ref, scale_ref, c: int, s: int, sub: int, group_size: int, dtype):
    """Contraction chunk c (8G rows) of output columns s : s + sub, dequantised: [8G, sub] in ``dtype``, from its G
    packed rows of ``packed_ref`` [K/8, N] and its scale rows ``scale_ref[c]`` [8, N] (nibble j: group j)."""
    G = group_size
    words = packed_ref[c * G:(c + 1) * G, s:s + sub]                     # [G, sub] int32
    groups = []
    for j in range(PER_WORD):
        q = (jax.lax.shift_right_logical(words, 4 * j) & 0xF) - 8
        groups.append(q.astype(jnp.float32) * scale_ref[c, j:j + 1, s:s + sub].astype(jnp.float32))
    return jnp.concatenate(groups, axis=0).astype(dtype)


def accumulate_dequantized_product(acc_ref, x, packed_ref, scale_ref, group_size: int):
    """acc_ref [r, N] += x [r, Kc] @ dequantised [Kc, N] (packed_ref [Kc/8, N] int32, scale_ref [Kc/8G, 8, N]): per
    `tiling.sub_tile` of output columns, the contraction chunk by chunk in order, each chunk's product added to the
    accumulator."""
    G = group_size
    N = packed_ref.shape[-1]
    sub = tiling.sub_tile(N)
    for s in range(0, N, sub):                                           # output columns s : s + sub
        for c in range(scale_ref.shape[0]):
            w = dequantized_chunk(packed_ref, scale_ref, c, s, sub, G, x.dtype)            # [8G, sub]
            acc_ref[:, s:s + sub] += mm(x[:, c * PER_WORD * G:(c + 1) * PER_WORD * G], w)


def _kernel(layer_ref, block_expert_ref, n_used_ref, x_ref, packed_ref, scale_ref, y_ref, acc_ref, *, group_size):
    i, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(i < n_used_ref[0])          # only an empty dispatch (n_used = 0) runs a block it skips
    def _():
        accumulate_dequantized_product(acc_ref, x_ref[...], packed_ref, scale_ref, group_size)   # x [m, tk]

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        y_ref[...] = acc_ref[...]


def cost_estimate(n_blocks, m, K, N, group_size, x_itemsize, scale_itemsize) -> pl.CostEstimate:
    """What ``n_blocks`` computed row blocks cost (an expectation: may be fractional): their products,
    activations, outputs, and each block's expert weights streamed once (packed words and scales). The cost
    model reads the blocks back as flops / (2 m K N) (glm5_jax/cost/hlo_cost/kernels.py)."""
    weight_bytes = K * N // 2 + K // group_size * N * scale_itemsize
    return pl.CostEstimate(flops=round(2 * n_blocks * m * K * N), transcendentals=0,
                           bytes_accessed=round(n_blocks * (m * K * x_itemsize + weight_bytes + m * N * 4)))


@functools.partial(jax.jit, static_argnames=("group_size", "tile_n", "tile_k", "interpret", "cost_blocks"))
def int4_block_matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer=None, *, group_size,
                      tile_n=None, tile_k=None, interpret=False, cost_blocks=None):
    """[n, m, K] activations x packed INT4 [E, K, N] (block i uses expert block_expert[i]) -> [n, m, N] fp32,
    blocks from ``n_used`` on unwritten (module docstring).

    With ``layer`` (int32 scalar) the weights are stacked [L, E, K/8, N] / [L, E, K/G, N] and layer
    ``layer`` is used, read in place. ``tile_n`` / ``tile_k``: the largest fitting tiles up to these, default
    `tiling.pick_tiles`. ``cost_blocks``: the row blocks expected to hold rows (n_used is known only at run
    time; may be fractional, an expectation), for the kernel's declared cost estimate; default all n."""
    if layer is None:                     # one layer: a leading axis of 1 (a bitcast, no copy)
        packed_EkN, scale_EgN, layer = packed_EkN[None], scale_EgN[None], 0
    n, m, K = x_nmK.shape
    L, E, _, N = packed_EkN.shape
    G = group_size
    chunk = PER_WORD * G
    if K % chunk or packed_EkN.shape[2] * PER_WORD != K or scale_EgN.shape != (L, E, K // G, N):
        raise ValueError(f"int4_block_matmul: x {x_nmK.shape}, packed {packed_EkN.shape}, scale "
                         f"{scale_EgN.shape} do not describe K={K} in groups of {G} (K a multiple of {chunk})")
    tk, tn = tiling.pick_tiles(m, K, N, G, x_nmK.dtype.itemsize, scale_EgN.dtype.itemsize)
    tk = tk if tile_k is None else tiling.fitting_tile(K, tile_k, chunk)
    tn = tn if tile_n is None else tiling.fitting_tile(N, tile_n, tiling.LANES)
    scale_EcjN = scale_EgN.reshape(L, E, K // chunk, PER_WORD, N)       # [chunk, group-in-chunk] split
    n_used = jnp.reshape(n_used, (1,)).astype(jnp.int32)
    grid = (N // tn, jnp.clip(n_used[0], 1, n), K // tk)               # the row blocks: dynamic, >= 1
    return pl.pallas_call(
        functools.partial(_kernel, group_size=G),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=grid,
            in_specs=[
                pl.BlockSpec((None, m, tk), lambda j, i, k, ly, be, nu: (i, 0, k)),
                pl.BlockSpec((None, None, tk // PER_WORD, tn), lambda j, i, k, ly, be, nu: (ly[0], be[i], k, j)),
                pl.BlockSpec((None, None, tk // chunk, PER_WORD, tn),
                             lambda j, i, k, ly, be, nu: (ly[0], be[i], k, 0, j)),
            ],
            out_specs=pl.BlockSpec((None, m, tn), lambda j, i, k, ly, be, nu: (i, 0, j)),
            scratch_shapes=[pltpu.VMEM((m, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((n, m, N), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name=NAME,
        cost_estimate=cost_estimate(n if cost_blocks is None else min(n, cost_blocks), m, K, N, G,
                                    x_nmK.dtype.itemsize, scale_EgN.dtype.itemsize),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), block_expert_n.astype(jnp.int32), n_used, x_nmK, packed_EkN,
      scale_EcjN)
