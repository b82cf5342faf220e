"""Row scatter-add d[b, target[b, n]] += rows[b, n] behind an ``impl`` switch, differentiable.

"reference" / "xla": XLA's scatter-add (reference.py). "pallas" / "pallas_interpret": the updates sorted by
target row (an XLA sort of the [B, N] targets), then the windowed Pallas kernel (kernel.py), which reads and
writes each row of d at most once instead of a whole tile per update. Masked updates (``valid`` false) are
dropped. Gradients: d's cotangent passes through, each update's row gets the cotangent's row at its target
(zero when masked). Rows may also come packed (uint32 [B, N, packed_width(W)] bf16 pairs, packing.py): added
in fp32 after unpacking, and not differentiable (integer lanes).
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.row_scatter import kernel, reference
from pallas_kernels.row_scatter.packing import unpack_bf16_pairs

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def row_scatter_add(d_BSW, rows_BNW, target_BN, valid_BN=None, *, impl):
    """d [B, S, W] fp32 plus every valid update rows[b, n] [W] at row target[b, n]."""
    if impl not in IMPLS:
        raise ValueError(f"row_scatter_add: unknown impl {impl!r}; choose one of {IMPLS}")
    S = d_BSW.shape[1]
    target = jnp.where(valid_BN, target_BN, S) if valid_BN is not None else target_BN
    target = jnp.where((target >= 0) & (target < S), target, S).astype(jnp.int32)
    if rows_BNW.dtype == jnp.uint32:
        return _forward(d_BSW, rows_BNW, target, impl)
    return _scatter(d_BSW, rows_BNW, target, impl)


def _forward(d, rows, target, impl):
    if impl in PALLAS_IMPLS:
        order = jnp.argsort(target, axis=1, stable=True).astype(jnp.int32)
        sorted_target = jnp.take_along_axis(target, order, axis=1)
        return kernel.sorted_row_scatter_add(d, rows[:, :, None, :], order, sorted_target,
                                             interpret=impl == PALLAS_INTERPRET)
    if rows.dtype == jnp.uint32:
        rows = unpack_bf16_pairs(rows, d.shape[-1])
    return reference.row_scatter_add(d, rows, target)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scatter(d, rows, target, impl):
    return _forward(d, rows, target, impl)


def _scatter_fwd(d, rows, target, impl):
    return _forward(d, rows, target, impl), (target, jnp.zeros((), rows.dtype))


def _scatter_bwd(impl, residuals, g_BSW):
    target, rows_dtype_scalar = residuals
    S = g_BSW.shape[1]
    d_rows = jax.vmap(lambda g, t: jnp.where((t < S)[:, None], g[jnp.minimum(t, S - 1)], 0.0))(g_BSW, target)
    return g_BSW, d_rows.astype(rows_dtype_scalar.dtype), None


_scatter.defvjp(_scatter_fwd, _scatter_bwd)
