"""INT4 grouped dequantise-matmul behind an ``impl`` switch, differentiable in the activations.

"xla" is reference.py; "pallas" the TPU kernel (kernel.py), "pallas_interpret" the same kernel through the
Pallas interpreter (CPU tests). The packed weights are frozen integers: the VJP gives the activation
gradient dx[i] = dy[i] @ dequantize(w[expert[i]])^T (XLA) and no weight gradient. Weights stacked over
layers ([L, E, ...]) come with the layer to use, which the kernel reads in place (kernel.py).

Blocks from ``n_used`` on are unspecified in the result: the kernel's grid never visits them (kernel.py),
the reference writes 0. Consumers read rows through `block_rows`, which gives 0 there (for every impl).
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.impls import PALLAS, PALLAS_IMPLS, PALLAS_INTERPRET, XLA
from pallas_kernels.int4_matmul import kernel, reference

IMPLS = (XLA, PALLAS, PALLAS_INTERPRET)


def _forward(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer, group_size, impl, cost_blocks=None):
    if impl == XLA:
        return reference.int4_block_matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer,
                                           group_size=group_size)
    if impl in PALLAS_IMPLS:
        return kernel.int4_block_matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer,
                                        group_size=group_size, interpret=impl == PALLAS_INTERPRET,
                                        cost_blocks=cost_blocks)
    raise ValueError(f"int4_block_matmul: unknown impl {impl!r}; choose one of {IMPLS}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer, group_size, impl, cost_blocks):
    return _forward(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer, group_size, impl, cost_blocks)


def _matmul_fwd(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer, group_size, impl, cost_blocks):
    y = _forward(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer, group_size, impl, cost_blocks)
    return y, (x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer)


def _matmul_bwd(group_size, impl, cost_blocks, residuals, dy_nmN):
    x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer = residuals
    if layer is not None:
        packed_EkN, scale_EgN = packed_EkN[layer], scale_EgN[layer]
    w_EKN = reference.dequantized_weights(packed_EkN, scale_EgN, group_size, x_nmK.dtype)
    used = (jnp.arange(x_nmK.shape[0]) < n_used)[:, None, None]
    dx = jnp.einsum("nmf,nkf->nmk", jnp.where(used, dy_nmN, 0).astype(x_nmK.dtype), w_EKN[block_expert_n],
                    preferred_element_type=jnp.float32)
    zero = lambda a: None if not jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros_like(a)
    scale_grad = zero(residuals[4])                     # the shape of the scale passed in (stacked or not)
    return dx.astype(x_nmK.dtype), None, None, None, scale_grad, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def int4_block_matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, *, group_size, impl="xla",
                      cost_blocks=None, layer=None):
    """y[i] = x[i] @ dequantize(w[block_expert[i]]) for blocks i < n_used, unspecified after -> [n, m, N] fp32
    (read rows with `block_rows`). ``layer`` (int32 scalar): the weights are stacked [L, E, ...] and layer
    ``layer``'s are used. ``cost_blocks``: the blocks expected to be used (an expectation, may be fractional),
    for the Pallas kernel's declared cost (default all)."""
    return _matmul(x_nmK, block_expert_n, n_used, packed_EkN, scale_EgN, layer, group_size, impl, cost_blocks)


def block_rows(y_nmN, dest_M, n_used):
    """The rows at flat slots ``dest_M`` of blocks [n, m, N] -> [M, N], 0 for slots in blocks from ``n_used``
    on (which the kernel never writes): a select on the M gathered rows, not a pass over the blocks."""
    m, N = y_nmN.shape[1:]
    return jnp.where((dest_M // m < n_used)[:, None], y_nmN.reshape(-1, N)[dest_M], 0.0)
