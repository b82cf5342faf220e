"""Rows idx[b, k] of layer ``layer`` of a stacked cache [L, B, S, C] -> [B, K, C], behind an ``impl`` switch.

"reference" / "xla": the layer sliced out and XLA's gather (reference.py). "pallas" / "pallas_interpret": the
Pallas kernel (kernel.py) reading the stacked cache in place, one tile-group DMA per row (or each batch row's
layer slice streamed whole where that reads fewer bytes). Indices outside [0, S) and a layer outside [0, L) are clamped into range by both (XLA's gather rule); masking the rows a
caller must not use is the caller's job.

Not differentiable through the kernel: the decode path that uses it is never differentiated, so the Pallas
impls raise under `jax.grad` instead of giving a wrong gradient (the XLA impls differentiate as JAX derives).
"""
import functools

import jax

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.row_gather import kernel, reference

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def stacked_row_gather(cache_LBSC, layer, idx_BK, *, impl):
    """[B, K, C]: cache[layer, b, idx[b, k]] (module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"stacked_row_gather: unknown impl {impl!r}; choose one of {IMPLS}")
    if impl in PALLAS_IMPLS:
        return _kernel_gather(cache_LBSC, layer, idx_BK, impl == PALLAS_INTERPRET)
    return reference.stacked_row_gather(cache_LBSC, layer, idx_BK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_gather(cache, layer, idx, interpret):
    return kernel.stacked_row_gather(cache, layer, idx, interpret=interpret)


def _kernel_gather_fwd(cache, layer, idx, interpret):
    return _kernel_gather(cache, layer, idx, interpret), None


def _kernel_gather_bwd(interpret, residuals, g):
    raise NotImplementedError("stacked_row_gather: the Pallas impls have no gradient (a decode-only gather); "
                              "use impl='xla' where a gradient is needed")


_kernel_gather.defvjp(_kernel_gather_fwd, _kernel_gather_bwd)
