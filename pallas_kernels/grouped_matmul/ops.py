"""Grouped matmul behind an ``impl`` switch.

* ``"ragged_dot"``: reference.py (`jax.lax.ragged_dot`, differentiated by JAX);
* ``"gmm"`` / ``"gmm_interpret"``: kernel.py's megablox kernels (TPU / Pallas interpreter) under a
  `jax.custom_vjp`: d lhs is `gmm` against the transposed weights, d rhs is `tgmm`;
* ``"auto"``: the same custom_vjp whose forward and backward each choose at lowering time with
  `jax.lax.platform_dependent`: the kernels when the program is lowered for TPU (also ahead of time from
  a CPU host), the ragged_dot reference and its VJP on any other platform.

Every impl takes rows sorted by group; rows past ``sum(group_sizes)`` come out zero and get a zero
gradient. Pallas TPU kernels cannot be partitioned automatically: on a multi-device mesh call this per
shard (inside `shard_map`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import kernel, reference
from pallas_kernels.impls import AUTO, GMM, GMM_INTERPRET, RAGGED_DOT

IMPLS = (RAGGED_DOT, GMM, GMM_INTERPRET, AUTO)


def grouped_matmul(lhs_MK, rhs_EKN, group_sizes_E, *, impl=RAGGED_DOT, out_dtype=jnp.float32, transpose_rhs=False):
    """y[m] = lhs[m] @ rhs[group of m] -> [M, N] in ``out_dtype``, accumulated in fp32.

    lhs_MK: rows sorted by group; rhs_EKN: one [K, N] matrix per group (with ``transpose_rhs``: one [N, K]
    matrix per group, used as its transpose; its gradient comes in that layout too); group_sizes_E: int rows
    per group.
    """
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: unknown impl {impl!r}; choose one of {IMPLS}")
    k_axis = 2 if transpose_rhs else 1
    if lhs_MK.ndim != 2 or rhs_EKN.ndim != 3 or lhs_MK.shape[1] != rhs_EKN.shape[k_axis]:
        want = "[E, N, K]" if transpose_rhs else "[E, K, N]"
        raise ValueError(f"grouped_matmul: lhs [M, K] and rhs {want} expected, got {lhs_MK.shape} and "
                         f"{rhs_EKN.shape}")
    if group_sizes_E.shape != rhs_EKN.shape[:1]:
        raise ValueError(f"grouped_matmul: group_sizes {group_sizes_E.shape} needs one entry per rhs group "
                         f"({rhs_EKN.shape[0]})")
    group_sizes_E = group_sizes_E.astype(jnp.int32)
    if impl == RAGGED_DOT:
        return reference.grouped_matmul(lhs_MK, _as_kn(rhs_EKN, transpose_rhs), group_sizes_E, out_dtype)
    return _kernel_grouped_matmul(lhs_MK, rhs_EKN, group_sizes_E, impl, jnp.dtype(out_dtype), transpose_rhs)


def _on_tpu_else_reference(kernel_fn, reference_fn, *args):
    """kernel_fn(*args) when lowered for TPU, reference_fn(*args) otherwise."""
    return jax.lax.platform_dependent(*args, tpu=kernel_fn, default=reference_fn)


def _as_kn(rhs, transpose_rhs):
    return jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs


def _forward(lhs, rhs, group_sizes, impl, out_dtype, transpose_rhs):
    def run_kernel(lhs, rhs, group_sizes, interpret=False):
        return kernel.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                          interpret=interpret)

    def run_reference(lhs, rhs, group_sizes):
        return reference.grouped_matmul(lhs, _as_kn(rhs, transpose_rhs), group_sizes, out_dtype)

    if impl == AUTO:
        return _on_tpu_else_reference(run_kernel, run_reference, lhs, rhs, group_sizes)
    return run_kernel(lhs, rhs, group_sizes, interpret=impl == GMM_INTERPRET)


def _backward(lhs, rhs, group_sizes, dy, impl, transpose_rhs):
    """(d lhs, d rhs) in the operands' dtypes (d rhs in rhs's layout). The kernels take the output cotangent
    in lhs's (compute) dtype; the reference differentiates ragged_dot as JAX does. With rhs stored [E, N, K]
    its gradient is tgmm(dy, lhs) = dy^T lhs per group, directly in that layout."""

    def run_kernel(lhs, rhs, group_sizes, dy, interpret=False):
        dy = dy.astype(lhs.dtype)
        d_lhs = kernel.gmm(dy, rhs, group_sizes, transpose_rhs=not transpose_rhs, out_dtype=lhs.dtype,
                           interpret=interpret)
        d_rhs = (kernel.tgmm(dy, lhs, group_sizes, out_dtype=rhs.dtype, interpret=interpret) if transpose_rhs
                 else kernel.tgmm(lhs, dy, group_sizes, out_dtype=rhs.dtype, interpret=interpret))
        return d_lhs, d_rhs

    def run_reference(lhs, rhs, group_sizes, dy):
        _, vjp = jax.vjp(lambda a, b: reference.grouped_matmul(a, _as_kn(b, transpose_rhs), group_sizes,
                                                               jnp.float32), lhs, rhs)
        d_lhs, d_rhs = vjp(dy.astype(jnp.float32))
        return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)

    if impl == AUTO:
        return _on_tpu_else_reference(run_kernel, run_reference, lhs, rhs, group_sizes, dy)
    return run_kernel(lhs, rhs, group_sizes, dy, interpret=impl == GMM_INTERPRET)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _kernel_grouped_matmul(lhs, rhs, group_sizes, impl, out_dtype, transpose_rhs):
    return _forward(lhs, rhs, group_sizes, impl, out_dtype, transpose_rhs)


def _fwd(lhs, rhs, group_sizes, impl, out_dtype, transpose_rhs):
    return _forward(lhs, rhs, group_sizes, impl, out_dtype, transpose_rhs), (lhs, rhs, group_sizes)


def _bwd(impl, out_dtype, transpose_rhs, residuals, dy):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = _backward(lhs, rhs, group_sizes, dy, impl, transpose_rhs)
    return d_lhs, d_rhs, None


_kernel_grouped_matmul.defvjp(_fwd, _bwd)
