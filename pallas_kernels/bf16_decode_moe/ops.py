"""A chip's routed-expert sum for a few tokens with bf16 experts, behind an ``impl`` switch: "reference" / "xla"
the XLA form (reference.py), "pallas" / "pallas_interpret" the one-call kernel (kernel.py).

Not differentiable through the kernel: decoding is never differentiated, so the Pallas impls raise under
`jax.grad` instead of giving a wrong gradient (the XLA impls differentiate as JAX derives)."""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.bf16_decode_moe import kernel, reference
from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def bf16_decode_moe(x_nD, key_M, gates_M, w_gate, w_up, w_down, layer, offset=0, *, dtype, impl,
                    out_dtype=jnp.float32, cost_assignments=None):
    """[n, D] in ``out_dtype``, summed in fp32 (reference.py for the computation and the shapes)."""
    if impl not in IMPLS:
        raise ValueError(f"bf16_decode_moe: unknown impl {impl!r}; choose one of {IMPLS}")
    if impl in PALLAS_IMPLS:
        return _kernel(x_nD, key_M, gates_M, w_gate, w_up, w_down, layer, offset, dtype, out_dtype, cost_assignments,
                       impl == PALLAS_INTERPRET)
    return reference.bf16_decode_moe(x_nD, key_M, gates_M, w_gate, w_up, w_down, layer, offset,
                                     dtype=dtype).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _kernel(x, key, gates, wg, wu, wd, layer, offset, dtype, out_dtype, cost_assignments, interpret):
    return kernel.bf16_decode_moe(x, key, gates, wg, wu, wd, layer, offset, dtype=dtype, out_dtype=out_dtype,
                                  cost_assignments=cost_assignments, interpret=interpret)


def _kernel_fwd(x, key, gates, wg, wu, wd, layer, offset, dtype, out_dtype, cost_assignments, interpret):
    return _kernel(x, key, gates, wg, wu, wd, layer, offset, dtype, out_dtype, cost_assignments, interpret), None


def _kernel_bwd(dtype, out_dtype, cost_assignments, interpret, residuals, g):
    raise NotImplementedError("bf16_decode_moe: the Pallas impls have no gradient (a decode-only kernel); "
                              "use impl='xla' where a gradient is needed")


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
