"""Math on VMEM values inside Pallas TPU kernel bodies: MXU products with fp32 accumulation, and the flip of
a per-row vector between its row [1, N] and column [N, 1] forms."""
import jax
import jax.numpy as jnp

from pallas_kernels.tpu_utils import mxu_precision


def mm(a, b):
    """a @ b with fp32 accumulation."""
    return jnp.dot(a, b, precision=mxu_precision(a, b), preferred_element_type=jnp.float32)


def mm_nt(a, b):
    """a @ b^T with fp32 accumulation (contract the last dims; the MXU's native transposed form)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=mxu_precision(a, b),
                               preferred_element_type=jnp.float32)


def _eye(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)


def row_to_column(row_1N):
    """[1, N] -> [N, 1] with a diagonal select and a lane reduction (no small-shape transpose)."""
    return jnp.sum(jnp.where(_eye(row_1N.shape[1]), row_1N, 0.0), axis=1, keepdims=True)


def column_to_row(col_N1):
    """[N, 1] -> [1, N] with a diagonal select and a sublane reduction."""
    return jnp.sum(jnp.where(_eye(col_N1.shape[0]), col_N1, 0.0), axis=0, keepdims=True)


def mm_tn(a, b):
    """a^T @ b with fp32 accumulation (contract the first dims)."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=mxu_precision(a, b),
                               preferred_element_type=jnp.float32)
