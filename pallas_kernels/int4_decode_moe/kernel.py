"""Pallas TPU kernel: a chip's routed-expert sum for a few tokens, packed INT4 experts, in one call (the
computation: reference.py).

At decode batch 1 a chip of an expert group holds ~1 of the token's 8 assignments. The sorted dispatch around
pallas_kernels/int4_matmul lays them out in row blocks (comparisons, one-hot row moves, block tables) and calls
the kernel three times (gate, up, down), with the SwiGLU and the gate-weighted sum between: ~25 small XLA ops a
layer, each a fixed cost far above its bytes. Here the grid walks the assignments themselves, m = 0 .. M - 1
(token m // K's choice m % K), "arbitrary": the local expert of each arrives by scalar prefetch and the weight
BlockSpecs read that expert's packed gate, up and down weights of layer ``layer`` (read in place from the stacked
[L, E, ...] arrays). A step whose assignment is another chip's computes nothing and fetches nothing
(pallas_kernels/decode_assignments.py). A local step dequantises as the
INT4 kernel does (chunks of 8G contraction rows from G packed rows, one scale row per group, fp32 then cast),
runs gate and up on all (padded) token rows, the SwiGLU, then down, and adds gate[m] x its token's row into the
[n, D] fp32 output, resident in VMEM for the whole grid.

Used for at most `MAX_ASSIGNMENTS` assignments (the index maps unroll over them); more take the blocked path.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_assignments import add_gated_row, local_expert, token_rows, weights_expert
from pallas_kernels.int4_matmul import tiling
from pallas_kernels.int4_matmul.kernel import dequantized_chunk
from pallas_kernels.kernel_math import mm

NAME = "int4_decode_moe"
MAX_ASSIGNMENTS = 32
ROWS = 16                  # token rows padded to a bf16 sublane tile
PER_WORD = tiling.PER_WORD
VMEM_LIMIT = 32 << 20


def _dequant_mm(x, packed_ref, scale_ref, group_size: int):
    """x [r, Kc] @ dequantised [Kc, N] -> [r, N] fp32; packed_ref [Kc / 8, N] int32, scale_ref [Kc / 8G, 8, N]
    (the INT4 kernel's layout and arithmetic, the contraction in chunks of 8G rows in order)."""
    G = group_size
    N = packed_ref.shape[-1]
    sub = tiling.sub_tile(N)
    cols = []
    for s in range(0, N, sub):
        acc = None
        for c in range(scale_ref.shape[0]):
            w = dequantized_chunk(packed_ref, scale_ref, c, s, sub, G, x.dtype)    # [8G, sub]
            part = mm(x[:, c * PER_WORD * G:(c + 1) * PER_WORD * G], w)
            acc = part if acc is None else acc + part
        cols.append(acc)
    return jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]


def _kernel(layer_ref, offset_ref, key_ref, gate_w_ref, x_ref, gp_ref, gs_ref, up_ref, us_ref, dp_ref, ds_ref,
            out_ref, acc_ref, *, n_local, top_k, group_size, dtype):
    m = pl.program_id(0)

    @pl.when(m == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(local_expert(key_ref, offset_ref, m, n_local)[1])
    def _():
        x = token_rows(x_ref, ROWS, dtype)                                      # [ROWS, D]
        h = jax.nn.silu(_dequant_mm(x, gp_ref, gs_ref, group_size)) * _dequant_mm(x, up_ref, us_ref, group_size)
        y = _dequant_mm(h.astype(dtype), dp_ref, ds_ref, group_size)[:x_ref.shape[0]]   # [n, D] fp32
        add_gated_row(acc_ref, y, gate_w_ref[m], m // top_k)

    @pl.when(m == pl.num_programs(0) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def cost(n_assignments, n, D, F, group_size, scale_itemsize, out_itemsize) -> pl.CostEstimate:
    """What ``n_assignments`` local assignments cost (an expectation: may be fractional): three products on the
    token rows padded to `ROWS` each, each assignment's expert weights read once (packed words and scales), the
    n token rows read (fp32) and the output written."""
    weights = 3 * (D * F // 2 + D // group_size * F * scale_itemsize)
    return pl.CostEstimate(flops=round(n_assignments * 2 * ROWS * 3 * D * F),
                           transcendentals=round(n_assignments * ROWS * F),
                           bytes_accessed=round(n_assignments * weights + n * D * (4 + out_itemsize)))


def int4_decode_moe(x_nD, key_M, gates_M, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                    layer, offset=0, *, group_size, dtype, out_dtype=jnp.float32, cost_assignments=None,
                    interpret=False):
    """[n, D] in ``out_dtype`` (summed in fp32; reference.py). Weights stacked [L, E_local, ...] (packed words, scales); ``key_M`` int32
    expert ids, this chip's experts ``offset`` .. ``offset`` + E_local - 1 (others skipped), ``gates_M`` fp32; x is read in fp32 and rounded to ``dtype`` in the
    kernel; ``cost_assignments``: the local assignments expected
    on the busiest chip, for the declared cost (default: all M)."""
    n, D = x_nD.shape
    M = key_M.shape[0]
    L, E, _, F = gate_packed.shape
    G = group_size
    chunk = PER_WORD * G
    if (M % n or M > MAX_ASSIGNMENTS or n > ROWS or D % chunk or F % chunk or gates_M.shape != (M,)
            or up_packed.shape != gate_packed.shape or down_packed.shape != (L, E, F // PER_WORD, D)
            or gate_scale.shape != (L, E, D // G, F) or down_scale.shape != (L, E, F // G, D)):
        raise ValueError(f"int4_decode_moe: want x [n <= {ROWS}, D], key / gates [n K <= {MAX_ASSIGNMENTS}], gate / "
                         f"up words [L, E, D/8, F] and scales [L, E, D/G, F], down [L, E, F/8, D] / [L, E, F/G, D], "
                         f"D and F multiples of 8G = {chunk}; got x {x_nD.shape}, key {key_M.shape}, gates "
                         f"{gates_M.shape}, gate {gate_packed.shape} / {gate_scale.shape}, down {down_packed.shape} "
                         f"/ {down_scale.shape}")
    by_chunk = lambda s, k: s.reshape(L, E, k // chunk, PER_WORD, s.shape[-1])   # noqa: E731  [chunk, group]

    def weight_block(rows, cols):
        return pl.BlockSpec((None, None, rows, cols),
                            lambda m, layer_ref, off_ref, key_ref, _: (layer_ref[0],
                                                                       weights_expert(m, key_ref, off_ref, E, M), 0, 0))

    def scale_block(chunks, cols):
        return pl.BlockSpec((None, None, chunks, PER_WORD, cols),
                            lambda m, layer_ref, off_ref, key_ref, _: (layer_ref[0],
                                                                       weights_expert(m, key_ref, off_ref, E, M), 0, 0, 0))

    out = pl.pallas_call(
        functools.partial(_kernel, n_local=E, top_k=M // n, group_size=G, dtype=dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(M,),
            in_specs=[pl.BlockSpec((n, D), lambda m, *_: (0, 0)),
                      weight_block(D // PER_WORD, F), scale_block(D // chunk, F),
                      weight_block(D // PER_WORD, F), scale_block(D // chunk, F),
                      weight_block(F // PER_WORD, D), scale_block(F // chunk, D)],
            out_specs=pl.BlockSpec((n, D), lambda m, *_: (0, 0)),
            scratch_shapes=[pltpu.VMEM((n, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((n, D), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=NAME,
        cost_estimate=cost(M if cost_assignments is None else min(M, cost_assignments), n, D, F, G,
                           gate_scale.dtype.itemsize, jnp.dtype(out_dtype).itemsize),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), jnp.reshape(jnp.asarray(offset, jnp.int32), (1,)),
      key_M.astype(jnp.int32), gates_M.astype(jnp.float32),
      x_nD.astype(jnp.float32), gate_packed, by_chunk(gate_scale, D), up_packed, by_chunk(up_scale, D),
      down_packed, by_chunk(down_scale, F))
    return out
