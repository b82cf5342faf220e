"""A chip's routed-expert SwiGLU of its received rows with packed INT4 experts, behind an ``impl`` switch:
"reference" / "xla" the XLA form (reference.py), "pallas" / "pallas_interpret" the one-call kernel
(kernel.py).

Not differentiable through the kernel: decoding is never differentiated, so the Pallas impls raise under
`jax.grad` instead of giving a wrong gradient (the XLA impls differentiate as JAX derives)."""
import functools

import jax

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.int4_moe_rows import kernel, reference

IMPLS = (REFERENCE, XLA) + PALLAS_IMPLS


def int4_moe_rows(rows_RtL, slot_row_P, block_expert_n, n_used, gate_packed, gate_scale, up_packed, up_scale,
                  down_packed, down_scale, layer=None, *, group_size, dtype, impl, cost_blocks=None):
    """[R, D/128, 128] in the rows' dtype (reference.py for the computation and the shapes; the kernel leaves
    rows that no used slot holds unspecified, the XLA form writes 0 there)."""
    if impl not in IMPLS:
        raise ValueError(f"int4_moe_rows: unknown impl {impl!r}; choose one of {IMPLS}")
    weights = (gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    if impl in PALLAS_IMPLS:
        return _kernel(rows_RtL, slot_row_P, block_expert_n, n_used, *weights, layer, group_size, dtype,
                       cost_blocks, impl == PALLAS_INTERPRET)
    return reference.int4_moe_rows(rows_RtL, slot_row_P, block_expert_n, n_used, *weights, layer,
                                   group_size=group_size, dtype=dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13, 14))
def _kernel(rows, slot_row, block_expert, n_used, gp, gs, up, us, dp, ds, layer, group_size, dtype, cost_blocks,
            interpret):
    return kernel.int4_moe_rows(rows, slot_row, block_expert, n_used, gp, gs, up, us, dp, ds, layer,
                                group_size=group_size, dtype=dtype, cost_blocks=cost_blocks, interpret=interpret)


def _kernel_fwd(rows, slot_row, block_expert, n_used, gp, gs, up, us, dp, ds, layer, group_size, dtype, cost_blocks,
                interpret):
    return _kernel(rows, slot_row, block_expert, n_used, gp, gs, up, us, dp, ds, layer, group_size, dtype,
                   cost_blocks, interpret), None


def _kernel_bwd(group_size, dtype, cost_blocks, interpret, residuals, g):
    raise NotImplementedError("int4_moe_rows: the Pallas impls have no gradient (a decode-only kernel); "
                              "use impl='xla' where a gradient is needed")


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
