"""The sparse-stage indexer KL per token on the Pallas kernels (sparse_kernel.py), with their VJP.

JAX cannot differentiate ``pallas_call``: the forward kernel runs on detached inputs, and an identity on
its kl with a hand-written VJP (the backward kernel: gradients of the indexer's q, k and w from the inputs
and the forward's lse_I) attaches the gradients. The target, the selection and its mask get no gradient
(the target comes from detached attention inputs). The forward's lse is named (``SAVED_NAMES``) and its
kernel is removable when unused: a remat policy that saves the lse never reruns the forward kernel for the
backward (the backward needs only the lse, not the kl).

The key gradient d ik [S, D] is accumulated in VMEM by the backward kernel while it fits
(`sparse_kernel.fits_vmem`: up to 32K keys of 128). Past that (a long-context shard sees every key of the
sequence: 202,752 at GLM-5's longest) the kernel writes each slot's row gradient to HBM instead, one query
chunk at a time, and the sorted row scatter-add kernel (pallas_kernels/row_scatter) adds them into d ik:
each row of d ik read and written once per chunk, where XLA's scatter-add moves a whole 8-row tile per slot.
"""
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.chunking import equal_chunk, merge_queries, split_queries
from pallas_kernels.impls import PALLAS, PALLAS_INTERPRET
from pallas_kernels.indexer_kl import sparse_kernel
from pallas_kernels.row_scatter.ops import row_scatter_add
from pallas_kernels.tpu_utils import LANES, removable_when_unused, round_up

# queries per backward call when the row gradients go through HBM: [B, 1024, k, 128] fp32 is 1 GiB at k = 2048
# (d ik, 104 MB at 202,752 keys, is read and written once per chunk)
ROWS_Q_CHUNK = 1024
SAVED_NAMES = ("indexer_kl_lse",)      # the forward kernel's per-token lse of the indexer distribution


def sparse_kl_per_token(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, *, interpret=False,
                        block_k=sparse_kernel.KL_BLOCK_K, resident=None, dk_in_vmem=None, q_chunk=ROWS_Q_CHUNK):
    """(kl [B, T] fp32, has_set [B, T] bool), as reference.indexer_kl_per_token in the sparse stage with a
    given target. ``resident``: ik in VMEM or row DMAs from HBM (default: sparse_kernel.keys_fit_vmem).
    ``dk_in_vmem``: the backward accumulates d ik in VMEM, or scatter-adds row gradients through HBM in
    chunks of ``q_chunk`` queries (default: sparse_kernel.fits_vmem)."""
    if dk_in_vmem is None:
        dk_in_vmem = sparse_kernel.fits_vmem(*ik_BSD.shape[1:])
    static = (interpret, block_k, resident, dk_in_vmem, q_chunk)
    sg = jax.lax.stop_gradient
    target_BTK = sg(target_BTK)
    kl, lse = removable_when_unused(sparse_kernel.sparse_kl_fwd, sg(iq_BTHD), sg(ik_BSD), sg(iw_BTH), idx_BTK,
                                    valid_BTK, target_BTK, **_options(static))
    lse = checkpoint_name(lse, SAVED_NAMES[0])
    kl = _with_grads(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, kl, lse, static)
    return kl, jnp.any(valid_BTK, axis=-1)


def _options(static):
    interpret, block_k, resident, _, _ = static
    return dict(interpret=interpret, block_k=block_k, resident=resident)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _with_grads(iq, ik, iw, idx, valid, target, kl, lse, static):
    """The identity on ``kl`` (the forward kernel's, given); its VJP runs the backward kernel."""
    return kl


def _with_grads_fwd(iq, ik, iw, idx, valid, target, kl, lse, static):
    return kl, (iq, ik, iw, idx, valid, target, lse)


def _with_grads_bwd(static, residuals, g_BT):
    iq, ik, iw, idx, valid, target, lse = residuals
    dk_in_vmem, q_chunk = static[3], static[4]
    if dk_in_vmem:
        diq, dik, diw = sparse_kernel.sparse_kl_bwd(iq, ik, iw, idx, valid, target, lse, g_BT, **_options(static))
    else:
        diq, dik, diw = _bwd_rows(iq, ik, iw, idx, valid, target, lse, g_BT, q_chunk, _options(static))
    return diq.astype(iq.dtype), dik.astype(ik.dtype), diw.astype(iw.dtype), None, None, None, None, None


_with_grads.defvjp(_with_grads_fwd, _with_grads_bwd)


def _bwd_rows(iq, ik, iw, idx, valid, target, lse, g, q_chunk, options):
    """The backward with d ik accumulated through HBM: the kernel per chunk of queries (T split into equal
    chunks of at most ``q_chunk``, a multiple of 8), each chunk's row gradients [B, chunk, k, W] added into
    d ik [B, S, W] (the loop's carry) by the row scatter-add and gone before the next chunk's exist. Padded
    queries have no valid slot and a zero cotangent."""
    B, T, H, D = iq.shape
    S = ik.shape[1]
    W = round_up(D, LANES)
    split = functools.partial(split_queries, q_chunk=equal_chunk(T, q_chunk))
    scatter_impl = PALLAS_INTERPRET if options["interpret"] else PALLAS

    def step(dk, chunk):
        iq_c, iw_c, idx_c, valid_c, target_c, lse_c, g_c = chunk
        diq, drows, diw = sparse_kernel.sparse_kl_bwd_rows(iq_c, ik, iw_c, idx_c, valid_c, target_c, lse_c, g_c,
                                                           **options)
        Tc, K = idx_c.shape[1:]
        dk = row_scatter_add(dk, drows.reshape(B, Tc * K, W), idx_c.reshape(B, -1), valid_c.reshape(B, -1),
                             impl=scatter_impl)
        return dk, (diq, diw)

    chunks = (split(iq), split(iw), split(idx), split(valid, value=False), split(target), split(lse), split(g))
    dk, (diq, diw) = jax.lax.scan(step, jnp.zeros((B, S, W), jnp.float32), chunks)
    return merge_queries(diq, T), dk[..., :D], merge_queries(diw, T)
