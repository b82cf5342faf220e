"""Grouped matmul, the readable XLA oracle: `jax.lax.ragged_dot`.

Rows of ``lhs_MK`` are sorted by group; the first ``group_sizes_E[0]`` rows use ``rhs_EKN[0]``, the next
``group_sizes_E[1]`` rows ``rhs_EKN[1]``, and so on. Rows past ``sum(group_sizes_E)`` belong to no group
and come out zero. JAX differentiates it: d lhs is a grouped matmul with each group's ``rhs`` transposed,
d rhs[e] = lhs[rows of e]^T @ dy[rows of e] (zero for an empty group).
"""
import jax
import jax.numpy as jnp


def grouped_matmul(lhs_MK, rhs_EKN, group_sizes_E, out_dtype=jnp.float32):
    """y[m] = lhs[m] @ rhs[group of m] -> [M, N] in ``out_dtype`` (products accumulate in fp32)."""
    return jax.lax.ragged_dot(lhs_MK, rhs_EKN, group_sizes_E, preferred_element_type=jnp.float32).astype(out_dtype)
