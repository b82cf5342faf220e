"""The sparse-stage indexer KL per token on the Pallas kernels (sparse_kernel.py), with their VJP.

JAX cannot differentiate ``pallas_call``: the forward kernel's (kl, lse_I) and the inputs are the
residuals, and the backward kernel gives the gradients of the indexer's q, k and w. The target, the
selection and its mask get no gradient (the target comes from detached attention inputs).
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.indexer_kl import sparse_kernel


def sparse_kl_per_token(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, *, interpret=False,
                        block_k=512, resident=None):
    """(kl [B, T] fp32, has_set [B, T] bool), as reference.indexer_kl_per_token in the sparse stage with a
    given target. ``resident``: ik in VMEM or row DMAs from HBM (default: sparse_kernel.keys_fit_vmem)."""
    kl = _kl(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, jax.lax.stop_gradient(target_BTK),
             (interpret, block_k, resident))
    return kl, jnp.any(valid_BTK, axis=-1)


def _options(static):
    interpret, block_k, resident = static
    return dict(interpret=interpret, block_k=block_k, resident=resident)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kl(iq, ik, iw, idx, valid, target, static):
    return sparse_kernel.sparse_kl_fwd(iq, ik, iw, idx, valid, target, **_options(static))[0]


def _kl_fwd(iq, ik, iw, idx, valid, target, static):
    kl, lse = sparse_kernel.sparse_kl_fwd(iq, ik, iw, idx, valid, target, **_options(static))
    return kl, (iq, ik, iw, idx, valid, target, lse)


def _kl_bwd(static, residuals, g_BT):
    iq, ik, iw, idx, valid, target, lse = residuals
    diq, dik, diw = sparse_kernel.sparse_kl_bwd(iq, ik, iw, idx, valid, target, lse, g_BT, **_options(static))
    return diq.astype(iq.dtype), dik.astype(ik.dtype), diw.astype(iw.dtype), None, None, None


_kl.defvjp(_kl_fwd, _kl_bwd)
