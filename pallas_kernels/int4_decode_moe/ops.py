"""A chip's routed-expert sum for a few tokens with packed INT4 experts, behind an ``impl`` switch: "reference" /
"xla" the XLA form (reference.py), "pallas" / "pallas_interpret" the one-call kernel (kernel.py).

Not differentiable through the kernel: decoding is never differentiated, so the Pallas impls raise under
`jax.grad` instead of giving a wrong gradient (the XLA impls differentiate as JAX derives)."""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.int4_decode_moe import kernel, reference

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def int4_decode_moe(x_nD, key_M, gates_M, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                    layer, offset=0, *, group_size, dtype, impl, out_dtype=jnp.float32, cost_assignments=None):
    """[n, D] in ``out_dtype``, summed in fp32 (reference.py for the computation and the shapes)."""
    if impl not in IMPLS:
        raise ValueError(f"int4_decode_moe: unknown impl {impl!r}; choose one of {IMPLS}")
    weights = (gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    if impl in PALLAS_IMPLS:
        return _kernel(x_nD, key_M, gates_M, *weights, layer, offset, group_size, dtype, out_dtype,
                       cost_assignments, impl == PALLAS_INTERPRET)
    return reference.int4_decode_moe(x_nD, key_M, gates_M, *weights, layer, offset, group_size=group_size,
                                     dtype=dtype).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13, 14, 15))
def _kernel(x, key, gates, gp, gs, up, us, dp, ds, layer, offset, group_size, dtype, out_dtype, cost_assignments,
            interpret):
    return kernel.int4_decode_moe(x, key, gates, gp, gs, up, us, dp, ds, layer, offset, group_size=group_size,
                                  dtype=dtype, out_dtype=out_dtype, cost_assignments=cost_assignments,
                                  interpret=interpret)


def _kernel_fwd(x, key, gates, gp, gs, up, us, dp, ds, layer, offset, group_size, dtype, out_dtype,
                cost_assignments, interpret):
    return _kernel(x, key, gates, gp, gs, up, us, dp, ds, layer, offset, group_size, dtype, out_dtype,
                   cost_assignments, interpret), None


def _kernel_bwd(group_size, dtype, out_dtype, cost_assignments, interpret, residuals, g):
    raise NotImplementedError("int4_decode_moe: the Pallas impls have no gradient (a decode-only kernel); "
                              "use impl='xla' where a gradient is needed")


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
