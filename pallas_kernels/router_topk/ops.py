"""The MoE router's top-k choice and gates behind an ``impl`` switch: "reference" / "xla" the XLA form
(reference.py), "pallas" / "pallas_interpret" the one-call kernel (kernel.py).

Not differentiable through the kernel: decoding is never differentiated, so the Pallas impls raise under
`jax.grad` instead of giving a wrong gradient (the XLA impls differentiate as JAX derives)."""
import functools

import jax

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.router_topk import kernel, reference

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def route_topk(scores_NE, bias_E, *, top_k: int, normalize: bool, scale: float, impl: str):
    """(idx [N, K] int32, gates [N, K] fp32) (reference.py)."""
    if impl not in IMPLS:
        raise ValueError(f"router_topk: unknown impl {impl!r}; choose one of {IMPLS}")
    if impl in PALLAS_IMPLS:
        return _kernel(scores_NE, bias_E, top_k, normalize, float(scale), impl == PALLAS_INTERPRET)
    return reference.route_topk(scores_NE, bias_E, top_k=top_k, normalize=normalize, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _kernel(scores, bias, top_k, normalize, scale, interpret):
    return tuple(kernel.route_topk(scores, bias, top_k=top_k, normalize=normalize, scale=scale, interpret=interpret))


def _kernel_fwd(scores, bias, top_k, normalize, scale, interpret):
    return _kernel(scores, bias, top_k, normalize, scale, interpret), None


def _kernel_bwd(top_k, normalize, scale, interpret, residuals, g):
    raise NotImplementedError("router_topk: the Pallas impls have no gradient (a decode-only kernel); "
                              "use impl='xla' where a gradient is needed")


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
