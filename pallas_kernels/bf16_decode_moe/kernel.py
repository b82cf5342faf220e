"""Pallas TPU kernel: a chip's routed-expert sum for a few tokens, bf16 experts, in one call (the computation:
reference.py). The bf16 twin of pallas_kernels/int4_decode_moe.

At decode batch 1 a chip of an expert group holds ~1 of the token's 8 assignments. Through the grouped matmul
the layer scan copies out each layer's slice of the chip's expert weights (a scanned parameter is a slice, copied
before a custom call can read it) and the dispatch sorts, pads and scatters the assignments in ~60 small XLA ops.
Here the grid walks (assignment m = 0 .. M - 1, width tile t): the local expert of each assignment arrives by
scalar prefetch and the weight BlockSpecs read that expert's gate, up and down tiles of layer ``layer`` in place
from the stacked [L, E, ...] arrays. A step of another chip's assignment computes nothing and fetches nothing
(pallas_kernels/decode_assignments.py). A local step runs gate and up on all (padded) token rows for its tile of
the width F, the SwiGLU, then the tile's share of down, and adds gate[m] x its token's row into the [n, D] fp32
accumulator, resident in VMEM for the whole grid. The SwiGLU is elementwise over F, so the width tiles' down
products sum to the whole expert's.

Legend: n tokens, M = n K assignments, L layers, E local experts, D model width, F the chip's expert width,
T the width tile.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_assignments import add_gated_row, local_expert, token_rows, weights_expert, weights_tile
from pallas_kernels.kernel_math import mm

NAME = "bf16_decode_moe"
MAX_ASSIGNMENTS = 32
ROWS = 16                  # token rows padded to a bf16 sublane tile
VMEM_LIMIT = 48 << 20
WEIGHT_VMEM = 24 << 20     # the double-buffered gate, up and down tiles stay within this


def width_tile(D: int, F: int, itemsize: int, budget: int = WEIGHT_VMEM) -> int:
    """The widest tile T of the expert width F (F itself, or F halved while it stays a multiple of 128) whose
    double-buffered gate, up and down tiles (3 x D x T each, ``itemsize`` bytes) fit ``budget``."""
    T = F
    while 2 * 3 * D * T * itemsize > budget and T % 256 == 0:
        T //= 2
    return T


def _kernel(layer_ref, offset_ref, key_ref, gate_w_ref, x_ref, g_ref, u_ref, d_ref, out_ref, acc_ref, *,
            n_local, top_k, dtype):
    m, t = pl.program_id(0), pl.program_id(1)

    @pl.when((m == 0) & (t == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(local_expert(key_ref, offset_ref, m, n_local)[1])
    def _():
        x = token_rows(x_ref, ROWS, dtype)                                      # [ROWS, D]
        g, u = (mm(x, w[...].astype(dtype)).astype(dtype).astype(jnp.float32) for w in (g_ref, u_ref))
        h = (jax.nn.silu(g) * u).astype(dtype)                                   # [ROWS, T]
        y = mm(h, d_ref[...].astype(dtype))[:x_ref.shape[0]]                     # [n, D] fp32
        add_gated_row(acc_ref, y, gate_w_ref[m], m // top_k)

    @pl.when((m == pl.num_programs(0) - 1) & (t == pl.num_programs(1) - 1))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def cost(n_assignments, n, D, F, weight_itemsize, out_itemsize) -> pl.CostEstimate:
    """What ``n_assignments`` local assignments cost (an expectation: may be fractional): three products on the
    token rows padded to `ROWS` each, each assignment's expert weights read once, the n token rows read (fp32)
    and the output written."""
    return pl.CostEstimate(flops=round(n_assignments * 2 * ROWS * 3 * D * F),
                           transcendentals=round(n_assignments * ROWS * F),
                           bytes_accessed=round(n_assignments * 3 * D * F * weight_itemsize
                                                + n * D * (4 + out_itemsize)))


def bf16_decode_moe(x_nD, key_M, gates_M, w_gate, w_up, w_down, layer, offset=0, *, dtype,
                    out_dtype=jnp.float32, cost_assignments=None, tile=None, interpret=False):
    """[n, D] in ``out_dtype`` (summed in fp32; reference.py). Weights stacked [L, E_local, ...]; ``key_M``
    int32 expert ids, this chip's experts ``offset`` .. ``offset`` + E_local - 1 (others skipped), ``gates_M``
    fp32; x is read in fp32 and rounded to ``dtype`` in the kernel; ``cost_assignments``: the local assignments
    expected on the busiest chip, for the declared cost (default: all M); ``tile``: the width tile (default
    `width_tile`)."""
    n, D = x_nD.shape
    M = key_M.shape[0]
    L, E, _, F = w_gate.shape
    T = width_tile(D, F, w_gate.dtype.itemsize) if tile is None else tile
    if (M % n or M > MAX_ASSIGNMENTS or n > ROWS or gates_M.shape != (M,) or w_up.shape != w_gate.shape
            or w_gate.shape[2] != D or w_down.shape != (L, E, F, D) or F % T or (T != F and T % 128)):
        raise ValueError(f"bf16_decode_moe: want x [n <= {ROWS}, D], key / gates [n K <= {MAX_ASSIGNMENTS}], gate "
                         f"/ up [L, E, D, F], down [L, E, F, D], a width tile dividing F (F or a multiple of 128); "
                         f"got x {x_nD.shape}, key {key_M.shape}, gates {gates_M.shape}, gate {w_gate.shape}, up "
                         f"{w_up.shape}, down {w_down.shape}, tile {T}")
    n_tiles = F // T

    def place(m, t, layer_ref, off_ref, key_ref):      # (layer, local expert, width tile) of step (m, t)
        return (layer_ref[0], weights_expert(m, key_ref, off_ref, E, M),
                weights_tile(m, t, n_tiles, key_ref, off_ref, E, M))

    def up_index(m, t, layer_ref, off_ref, key_ref, _):                     # [D, T] tiles of gate and up
        layer_, e, tile_ = place(m, t, layer_ref, off_ref, key_ref)
        return layer_, e, 0, tile_

    def down_index(m, t, layer_ref, off_ref, key_ref, _):                   # [T, D] tiles of down
        return (*place(m, t, layer_ref, off_ref, key_ref), 0)

    up_spec = pl.BlockSpec((None, None, D, T), up_index)
    down_spec = pl.BlockSpec((None, None, T, D), down_index)
    whole = pl.BlockSpec((n, D), lambda m, t, *_: (0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, n_local=E, top_k=M // n, dtype=dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(M, n_tiles),
            in_specs=[whole, up_spec, up_spec, down_spec],
            out_specs=whole,
            scratch_shapes=[pltpu.VMEM((n, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((n, D), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=NAME,
        cost_estimate=cost(M if cost_assignments is None else min(M, cost_assignments), n, D, F,
                           w_gate.dtype.itemsize, jnp.dtype(out_dtype).itemsize),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), jnp.reshape(jnp.asarray(offset, jnp.int32), (1,)),
      key_M.astype(jnp.int32), gates_M.astype(jnp.float32), x_nD.astype(jnp.float32), w_gate, w_up, w_down)
