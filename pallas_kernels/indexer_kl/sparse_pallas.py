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
                        block_k=512):
    """(kl [B, T] fp32, has_set [B, T] bool), as reference.indexer_kl_per_token in the sparse stage with a
    given target."""
    kl = _kl(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, jax.lax.stop_gradient(target_BTK), interpret, block_k)
    return kl, jnp.any(valid_BTK, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _kl(iq, ik, iw, idx, valid, target, interpret, block_k):
    return sparse_kernel.sparse_kl_fwd(iq, ik, iw, idx, valid, target, block_k=block_k, interpret=interpret)[0]


def _kl_fwd(iq, ik, iw, idx, valid, target, interpret, block_k):
    kl, lse = sparse_kernel.sparse_kl_fwd(iq, ik, iw, idx, valid, target, block_k=block_k, interpret=interpret)
    return kl, (iq, ik, iw, idx, valid, target, lse)


def _kl_bwd(interpret, block_k, residuals, g_BT):
    iq, ik, iw, idx, valid, target, lse = residuals
    diq, dik, diw = sparse_kernel.sparse_kl_bwd(iq, ik, iw, idx, valid, target, lse, g_BT, block_k=block_k,
                                                interpret=interpret)
    return diq.astype(iq.dtype), dik.astype(ik.dtype), diw.astype(iw.dtype), None, None, None


_kl.defvjp(_kl_fwd, _kl_bwd)
