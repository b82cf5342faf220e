"""The routed experts' SwiGLU as grouped matmuls over rows sorted by expert.

    h = silu(x @ W_gate[e]) * (x @ W_up[e]);  y = h @ W_down[e]      for each row x of expert e

The three products are grouped matmuls (`pallas_kernels.grouped_matmul`), so each costs
2 * rows * D * F over the rows routed to each expert. ``impl`` (``ModelConfig.moe_impl``, less
"blocked", which has its own module) picks the grouped matmul: "ragged_dot" (XLA), "gmm" / "gmm_interpret"
(the Pallas TPU kernel / its interpreter) or "auto" (the kernel when lowered for TPU, ragged_dot elsewhere).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model.layers import swiglu
from pallas_kernels.grouped_matmul.ops import grouped_matmul
from pallas_kernels.impls import GMM_IMPLS

KERNEL_IMPLS = GMM_IMPLS   # Pallas calls: must run per shard on a multi-device mesh
# the gate and up products of `swiglu_rows` ([M, F] each in the compute dtype), named for remat policies: a
# policy that keeps them (decoder.REMAT_POLICIES "experts_saveable") reruns only the down product of the
# experts' forward
EXPERT_SAVED_NAMES = ("moe_gate_out", "moe_up_out")
# the rows the experts multiply ([M, D], sorted by expert): a policy that keeps them and the gate / up products
# and the experts' outputs (decoder.REMAT_POLICIES "moe_saveable") reruns neither the transport (gathers,
# all-to-all) nor any expert product
EXPERT_ROWS_NAME = "moe_expert_rows"
# the experts' outputs per (token, choice) before the gate-weighted sum ([N, K, D]; the router's gradient needs them)
EXPERT_OUT_NAME = "moe_expert_out"


def sort_by_expert(expert_idx_NK, n_experts):
    """(order [N*K]: flat assignments grouped by expert, stable; group_sizes [E] int32)."""
    flat = expert_idx_NK.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def swiglu_rows(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, impl, gate_up_transposed=False,
                out_dtype=jnp.float32, limit=None):
    """SwiGLU of rows sorted by expert -> [M, D] in ``out_dtype``; rows past sum(group_sizes) come out zero.
    With ``gate_up_transposed`` the gate and up weights come as [E, F, D] (their gradients too).

    Every product accumulates in fp32; the gate and up products leave the grouped matmul in ``dtype`` (the
    compute dtype: in bf16 they and what a remat policy keeps of them are half the bytes of fp32, and the
    SwiGLU's result is rounded to it anyway before the down product). ``limit``: the clamped SwiGLU
    (`glm5_jax.model.layers.swiglu`)."""
    def gmm(lhs, rhs, transpose_rhs=False, out=dtype):
        return grouped_matmul(lhs.astype(dtype), rhs.astype(dtype), group_sizes_E, impl=impl,
                              transpose_rhs=transpose_rhs, out_dtype=out)

    x_MD = checkpoint_name(x_MD.astype(dtype), EXPERT_ROWS_NAME)

    gate, up = (checkpoint_name(gmm(x_MD, w, gate_up_transposed), name)
                for w, name in zip((w_gate_EDF, w_up_EDF), EXPERT_SAVED_NAMES))
    h = swiglu(gate.astype(jnp.float32), up.astype(jnp.float32), limit).astype(dtype)
    return gmm(h, w_down_EFD, out=out_dtype)


def sorted_swiglu(x_ND, expert_idx_NK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, impl, limit=None):
    """y[n, k] = SwiGLU_{expert_idx[n,k]}(x[n]) via sort-by-expert + grouped matmuls -> [N, K, D] fp32."""
    N, K = expert_idx_NK.shape
    order, group_sizes = sort_by_expert(expert_idx_NK, w_gate_EDF.shape[0])
    y_sorted = swiglu_rows(x_ND.astype(dtype)[order // K], group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD,
                           dtype, impl, limit=limit)
    return y_sorted[jnp.argsort(order)].reshape(N, K, -1)


def max_blocks(M: int, E: int, block: int) -> int:
    """Row blocks M rows in E expert groups can fill, each group padded to whole blocks: the G <= min(E, M)
    non-empty groups take sum ceil(g / block) <= sum (g + block - 1) / block = (M + G (block - 1)) / block
    (at most ceil(M / block) + E - 1; a decode chip's 8 rows over 33 groups: 8 blocks, not 33)."""
    return max(1, (M + min(E, M) * (block - 1)) // block)


def expert_blocks(x_MD, group_sizes_E, block):
    """Expert-sorted rows [M, D] -> (x_blocks [n, block, D], block_expert [n], n_used, dest_M): row r
    sits at flat slot dest_M[r] of the blocks; n = `max_blocks` (static)."""
    M, D = x_MD.shape
    src, block_expert, n_used, dest_M = block_layout(group_sizes_E, M, block)
    x_blocks = jnp.concatenate([x_MD, jnp.zeros((1, D), x_MD.dtype)])[src].reshape(-1, block, D)
    return x_blocks, block_expert, n_used, dest_M


def div_nonneg(a, b):
    """a // b for non-negative int arrays a and a positive int b: one truncating division (a shift for powers
    of two), not jnp's floor division with its sign corrections (~8 small ops on a TPU, each a fixed cost)."""
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def ceil_div_nonneg(a, b):
    """-(-a // b) for non-negative int arrays a and a positive int b (`div_nonneg`)."""
    return div_nonneg(a + (b - 1), b)


def block_layout(group_sizes_E, M, block):
    """`expert_blocks`' layout of M expert-sorted rows without the rows: (src [n * block]: the sorted row in each
    flat slot, M for a padding slot; block_expert [n]; n_used; dest_M: each row's slot)."""
    E = group_sizes_E.shape[0]
    n_blocks = max_blocks(M, E, block)
    padded_sizes = ceil_div_nonneg(group_sizes_E, block) * block
    padded_end = jnp.cumsum(padded_sizes)
    padded_start = padded_end - padded_sizes
    group_start = jnp.cumsum(group_sizes_E) - group_sizes_E
    expert_of_row = jnp.repeat(jnp.arange(E), group_sizes_E, total_repeat_length=M)
    dest_M = padded_start[expert_of_row] + jnp.arange(M) - group_start[expert_of_row]
    src = jnp.full((n_blocks * block,), M, jnp.int32).at[dest_M].set(jnp.arange(M, dtype=jnp.int32))
    # one [n, E] comparison (a fusion), not the default binary-search loop (~36 tiny ops per call at decode)
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(n_blocks) * block, side="right",
                                                method="compare_all"), E - 1)
    n_used = div_nonneg(padded_end[-1], block).astype(jnp.int32)
    return src, block_expert.astype(jnp.int32), n_used, dest_M
