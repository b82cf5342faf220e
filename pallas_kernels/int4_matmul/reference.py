"""The INT4 grouped dequantise-matmul in plain XLA: the oracle for kernel.py.

Rows come in blocks of m rows that all belong to one expert (the MoE's expert-sorted, block-padded
layout): ``y[i] = x[i] @ dequantize(w[expert[i]])`` for the first ``n_used`` blocks, 0 for the rest.
Weights are packed as `packing` lays them out (int32 words [E, K/8, N], scales [E, K/G, N]).
"""
import jax.numpy as jnp

from pallas_kernels.int4_matmul import packing


def dequantized_weights(packed_EkN, scale_EgN, group_size, dtype):
    """[E, K, N] in `dtype`: fp32 q * scale (exact for bf16 scales), then cast — as the kernel does."""
    return packing.dequantize_packed(packed_EkN, scale_EgN, group_size, jnp.float32).astype(dtype)


def int4_block_matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer=None, *, group_size):
    """[n, m, K] x INT4 [E, K, N] per block -> [n, m, N] fp32; with ``layer``, weights stacked [L, E, ...]."""
    if layer is not None:
        packed_EkN, scale_EgN = packed_EkN[layer], scale_EgN[layer]
    w_EKN = dequantized_weights(packed_EkN, scale_EgN, group_size, x_nmK.dtype)
    y = jnp.einsum("nmk,nkf->nmf", x_nmK, w_EKN[block_expert_n], preferred_element_type=jnp.float32)
    used = jnp.arange(x_nmK.shape[0]) < n_used
    return jnp.where(used[:, None, None], y, 0.0)
