"""A chip's routed-expert SwiGLU of the rows it received, packed INT4 experts, in plain XLA: the oracle for
kernel.py.

Shapes: rows [R, D/128, 128] (each received row laid out in its own lane tiles); slot_row [n x m]: the received
row in each of n blocks' m slots (R: a padding slot), block_expert [n] (local experts), blocks from ``n_used``
on unused; weights of the chip's E local experts packed as pallas_kernels/int4_matmul lays them out (int32
words [L, E, K/8, N], scales [L, E, K/G, N], layer ``layer``; or [E, ...] without one): gate and up [D -> F],
down [F -> D]. -> y [R, D/128, 128] in the rows' dtype: for a row r in slot (i, j) of a used block,
down_e(h) with e = block_expert[i], h = silu(r gate_e) * (r up_e) rounded to ``dtype``, each product in fp32
from ``dtype`` operands; 0 for rows no used slot holds (the kernel leaves them unspecified).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.int4_matmul.reference import int4_block_matmul


def int4_moe_rows(rows_RtL, slot_row_P, block_expert_n, n_used, gate_packed, gate_scale, up_packed, up_scale,
                  down_packed, down_scale, layer=None, *, group_size, dtype):
    R = rows_RtL.shape[0]
    D = rows_RtL.shape[1] * rows_RtL.shape[2]
    n = block_expert_n.shape[0]
    m = slot_row_P.shape[0] // n
    x_RD = jnp.concatenate([rows_RtL.reshape(R, D), jnp.zeros((1, D), rows_RtL.dtype)])
    x_nmD = x_RD[jnp.clip(slot_row_P, 0, R)].reshape(n, m, D).astype(dtype)
    mm = lambda x, packed, scale: int4_block_matmul(x, block_expert_n, n_used, packed, scale, layer,  # noqa: E731
                                                    group_size=group_size)
    h = (jax.nn.silu(mm(x_nmD, gate_packed, gate_scale)) * mm(x_nmD, up_packed, up_scale)).astype(dtype)
    y_PD = mm(h, down_packed, down_scale).reshape(n * m, D)
    used = (jnp.arange(n * m) // m < n_used) & (slot_row_P < R)
    out = jnp.zeros((R + 1, D), jnp.float32).at[jnp.where(used, slot_row_P, R)].set(y_PD)
    return out[:R].astype(rows_RtL.dtype).reshape(rows_RtL.shape)
