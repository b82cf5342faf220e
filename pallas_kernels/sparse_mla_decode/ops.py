"""Sparse MLA decode (one token per batch row over its selected latent rows of one layer of a stacked cache)
behind an ``impl`` switch: "reference" / "xla" the row gather and XLA's attention (reference.py); "pallas" /
"pallas_interpret" the fused kernel (kernel.py), which streams each batch row's layer slice through VMEM.

Not differentiable through the kernel: decoding is never differentiated, so the Pallas impls raise under
`jax.grad` instead of giving a wrong gradient (the XLA impls differentiate as JAX derives)."""
import functools

import jax

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.sparse_mla_decode import kernel, reference

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def sparse_mla_decode(cache_LBSC, layer, idx_BK, valid_BK, q_BHC, new_BC, pos_B, *, scale, v_dim, impl):
    """[B, H, v_dim] (reference.py for the computation and the shapes)."""
    if impl not in IMPLS:
        raise ValueError(f"sparse_mla_decode: unknown impl {impl!r}; choose one of {IMPLS}")
    if impl in PALLAS_IMPLS:
        return _kernel(cache_LBSC, layer, idx_BK, valid_BK, q_BHC, new_BC, pos_B, float(scale), v_dim,
                       impl == PALLAS_INTERPRET)
    return reference.sparse_mla_decode(cache_LBSC, layer, idx_BK, valid_BK, q_BHC, new_BC, pos_B, scale=scale,
                                       v_dim=v_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _kernel(cache, layer, idx, valid, q, new, pos, scale, v_dim, interpret):
    return kernel.sparse_mla_decode(cache, layer, idx, valid, q, new, pos, scale=scale, v_dim=v_dim,
                                    interpret=interpret)


def _kernel_fwd(cache, layer, idx, valid, q, new, pos, scale, v_dim, interpret):
    return _kernel(cache, layer, idx, valid, q, new, pos, scale, v_dim, interpret), None


def _kernel_bwd(scale, v_dim, interpret, residuals, g):
    raise NotImplementedError("sparse_mla_decode: the Pallas impls have no gradient (a decode-only kernel); "
                              "use impl='xla' where a gradient is needed")


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
