"""The routed experts' SwiGLU on packed INT4 weights through the Pallas dequantise-matmul.

Assignments are sorted by expert and each expert's rows padded to whole blocks of `block` rows, so every
row block multiplies by one expert's packed weights (pallas_kernels/int4_matmul). At most E - 1 blocks
of padding; the kernel's grid stops at the last used block (later blocks are unwritten: rows are read
through `ops.block_rows`). Small batches (decode) use blocks of
ceil(N*K / 16) * 16 rows, so each chosen expert's INT4 words are read once per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.moe.experts import expert_blocks
from glm5_jax.parallel.shard_map import logical_shard_map
from pallas_kernels.int4_matmul import ops

MAX_BLOCK = 128
ROW_MULTIPLE = 16            # sublane tile of bf16 activations


def grouped_swiglu(x_ND, expert_idx_NK, w_gate, w_up, w_down, dtype, cfg: ModelConfig):
    """y[n, k] = SwiGLU_{expert_idx[n, k]}(x[n]) with `Int4Weight` experts -> [N, K, D] fp32."""
    N, K = expert_idx_NK.shape
    E = w_gate.packed.shape[0]
    M = N * K
    block = min(MAX_BLOCK, -(-M // ROW_MULTIPLE) * ROW_MULTIPLE)
    flat_expert = expert_idx_NK.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    x_sorted = x_ND.astype(dtype)[order // K]
    group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
    x_blocks, block_expert, n_used, dest = expert_blocks(x_sorted, group_sizes, block)

    def swiglu(x_blocks, block_expert, n_used, *weights):
        gp, gs, up, us, dp, ds = weights

        def mm(x, packed, scale):
            return ops.int4_block_matmul(x, block_expert, n_used, packed, scale,
                                         group_size=cfg.quant_group_size, impl=cfg.runtime.quant_matmul)

        h = (jax.nn.silu(mm(x_blocks, gp, gs)) * mm(x_blocks, up, us)).astype(dtype)
        return mm(h, dp, ds)

    # on a multi-device mesh the kernel runs per device on replicated operands
    replicated = (None,) * 3
    run = logical_shard_map(swiglu, in_axes=((None,) * 3, (None,), (), *(replicated,) * 6),
                            out_axes=(None,) * 3)
    y_blocks = run(x_blocks, block_expert, n_used, w_gate.packed, w_gate.scale, w_up.packed, w_up.scale,
                   w_down.packed, w_down.scale)
    y_sorted = ops.block_rows(y_blocks, dest, n_used)
    return y_sorted[jnp.argsort(order)].reshape(N, K, -1)
