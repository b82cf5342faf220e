"""Grouped matmul on TPU: JAX's megablox Pallas kernels (`gmm`, and `tgmm` for the weight gradient) with
the tiling chosen here for GLM-5's expert widths.

Both kernels walk only the row tiles that hold rows of some group (a group whose rows start or end inside
a tile costs that whole tile), so each of the three products of a grouped matmul costs about
2 * rows * K * N over the rows actually routed to each expert, whatever the number of groups; rows past
``sum(group_sizes)`` are never multiplied.

What the wrappers add to megablox:

* rows are padded to a multiple of the row tile (megablox requires it); padding rows lie past
  ``sum(group_sizes)``;
* `gmm` leaves output rows it does not visit (past ``sum(group_sizes)``) uninitialised: they are set to
  zero here, so the result is `jax.lax.ragged_dot`'s;
* `tgmm` visits every empty group once and writes zeros there: an expert without rows gets an exactly zero
  weight gradient.

Tiles (rows, contraction, output columns), chosen by `bench/gmm_tiling_compile.py` (Mosaic compiles for v5p
at the 744B config's per-chip shapes: 10,240-row buffers with ~8,192 routed rows over 8 local experts, D =
6144, F = 2048, bf16; results in bench/results/gmm_tiling.json). v5p has 64 MiB of VMEM per TensorCore, but
Mosaic's default scoped limit is 16 MiB; each kernel double-buffers its input and output blocks and keeps
one fp32 accumulator:

* `gmm` (256, 2048, 1024): lhs 256x2048 (1 MiB), rhs 2048x1024 (4 MiB), out 256x1024 (0.5 MiB), each x2,
  + fp32 accumulator 1 MiB = 12 MiB. A 2048-deep contraction tile halves the grid steps of the D = 6144-deep
  products and takes the F = 2048-deep ones whole; each grid step costs ~0.35 us beside its MXU work, so one
  SwiGLU pass's 7 products take 6.40 ms against 6.71 at (256, 1024, 1024) under the conservative cost rules
  (4 tile-aligned experts, a full buffer: bench/results/gmm_tiling_conservative.json). megablox splits only
  its output-column tiles over v5p's two TensorCores (its other grid axes are "arbitrary"), so the number of
  column tiles should be even: at 2048 columns the gate / up products and the down product's input gradient
  (2048 wide: one tile) run on one core, and the down product and the gate / up input gradients (6144 wide:
  3 tiles) take 4/3 of the two-core time; at 1024 every product splits evenly. Under the cost model's
  conservative rules (docs/cost_model.md), with 1024-deep tiles, the 744B pretraining step's 912
  grouped-matmul calls take 1.11 s at 2048 columns and 0.71 s at 1024 (the lhs is read
  once more per extra column tile: 1.26 -> 1.40 GB per gate / up call at the busiest chip's 43 row tiles).
  megablox visits only the row tiles its groups cover, and a group boundary inside a row tile costs that
  whole tile twice (glm5_jax.cost.hlo_cost `grouped_matmul_tiles`): with 8
  groups the boundaries add 7 tiles, 22% of the routed rows' work at 256 rows, 44% at 512 (the a2a transport
  can start each group on a tile instead, `moe_group_align`: half a tile of padding per group). It reads the lhs
  once per output-column tile and one group's weights per visited row tile. One SwiGLU pass (7 gmm
  products) at the 744B shapes, under the optimistic rules (both cores for every kernel, no grid-step
  cost): 4.93 ms, compute-bound (10.2 GB; 9.4 GB at 2048-wide tiles, the same time), against 5.73 ms at
  (512, 1024, 1024) (7.8 GB, 1.44x the routed rows' MXU work); 128 rows is memory-bound (15.7 GB, 6.66 ms).
* `tgmm` (256, 1024, 1024): lhs^T and d out 256x1024 (0.5 MiB each), out 1024x1024 in the weight dtype
  (2 MiB bf16), each x2, + fp32 accumulator 4 MiB = 10 MiB. Compute-bound at 256 rows (3 products: 2.1 GB,
  1.92 ms against 2.26 at 512 rows). 128 rows would win again on paper (1.74 ms), but a grid step of
  128 x 1024 x 1024 is 0.7 us of MXU work, about twice the fixed cost of a Pallas grid step (which the
  cost model's conservative rules count). Larger column tiles (2048) run out of scoped VMEM.
GLM-5's widths D = 6144 and F = 2048 are multiples of 1024; a dimension at most the preferred tile is taken
whole.
"""
from __future__ import annotations

import jax.numpy as jnp
# the module, not the package's re-exported custom_vjp of the same name
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm as megablox_gmm, tgmm as megablox_tgmm

from pallas_kernels.tpu_utils import pad_axis, round_up

GMM_TILING = (256, 2048, 1024)      # (rows, contraction, output columns) of the forward and input gradient
TGMM_TILING = (256, 1024, 1024)     # (rows, lhs columns, d out columns) of the weight gradient


def _tile(dim: int, preferred: int, what: str) -> int:
    """The whole dimension if it fits the preferred tile, else the largest multiple of 128 <= preferred
    that divides it."""
    if dim <= preferred:
        return dim
    for t in range(preferred - preferred % 128, 0, -128):
        if dim % t == 0:
            return t
    raise ValueError(f"grouped_matmul: {what}={dim} has no multiple-of-128 tile <= {preferred} dividing it")


def row_tile(m: int, preferred: int) -> int:
    return min(preferred, round_up(m, 8))


def _rows_in_groups(m: int, group_sizes_E):
    """[m, 1] mask of the rows that belong to a group (row < sum(group_sizes))."""
    return (jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes_E))[:, None]


def gmm(lhs_MK, rhs_EKN, group_sizes_E, *, transpose_rhs=False, out_dtype=jnp.float32, interpret=False,
        tiling=GMM_TILING):
    """y[m] = lhs[m] @ rhs[group of m] (rhs[g]^T with ``transpose_rhs``) -> [M, N]; rows past
    sum(group_sizes) are zero."""
    M, K = lhs_MK.shape
    N = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
    tm = row_tile(M, tiling[0])
    tiles = (tm, _tile(K, tiling[1], "contraction"), _tile(N, tiling[2], "output width"))
    y = megablox_gmm(pad_axis(lhs_MK, 0, round_up(M, tm)), rhs_EKN, group_sizes_E.astype(jnp.int32),
                     preferred_element_type=out_dtype, tiling=tiles, transpose_rhs=transpose_rhs,
                     interpret=interpret)[:M]
    return jnp.where(_rows_in_groups(M, group_sizes_E), y, 0).astype(out_dtype)


def tgmm(lhs_MK, dy_MN, group_sizes_E, *, out_dtype, interpret=False, tiling=TGMM_TILING):
    """d rhs[g] = lhs[rows of g]^T @ dy[rows of g] -> [E, K, N]; zero for an empty group; rows past
    sum(group_sizes) are ignored."""
    M, K = lhs_MK.shape
    N = dy_MN.shape[1]
    tm = row_tile(M, tiling[0])
    tiles = (tm, _tile(K, tiling[1], "lhs width"), _tile(N, tiling[2], "d out width"))
    Mp = round_up(M, tm)
    return megablox_tgmm(pad_axis(lhs_MK, 0, Mp).T, pad_axis(dy_MN, 0, Mp), group_sizes_E.astype(jnp.int32),
                         preferred_element_type=out_dtype, tiling=tiles, interpret=interpret)
