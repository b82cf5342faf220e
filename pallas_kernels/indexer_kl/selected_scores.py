"""Indexer scores of the selected keys only, with a hand-written VJP 
(docs/architecture.md#lightning-indexer, #dsa-training-stages-and-the-indexer-kl):

    I[t, j] = sum_h w[t, h] ReLU(q[t, h] . k[idx[t, j]])        -> [B, T, k] fp32

The sparse-stage KL needs these scores and their gradient with respect to the indexer's q, k and w.
Autodiff of the gather formula differentiates the key-major product "btkd,bthd->btkh" into two batched
products per query, [H, k] @ [k, d] for dq and [k, H] @ [H, d] for the gathered keys' gradient; their
narrow dimension (H_I = 4 heads at bench sizes) makes them several times slower on XLA:CPU than the
same sums written as broadcast multiply-adds. The backward here recomputes the per-head dots (residuals
are the inputs only: nothing of size [B, T, k, H] is kept) and, with g = dI * w * [dots > 0],

    dw[t, h] = sum_j dI[t, j] ReLU(dots[t, j, h])
    dq[t, h] = sum_j g[t, j, h] k[idx[t, j]]
    dk[s]    = sum_{t, j : idx[t, j] = s} sum_h g[t, j, h] q[t, h]      (a scatter-add)

with the two contractions as multiply-adds on CPU and as products elsewhere (`jax.lax.platform_dependent`
picks by the platform compiled for).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.sparse_mla.reference import gather_rows, scatter_add_rows
from pallas_kernels.tpu_utils import mxu_precision


def _dots(keys_BTKD, q_BTHD):
    # key-major per query ([k, D] @ [D, H]), the fastest layout of this product on XLA:CPU; fp32 results
    # from operands in their own dtype (a bf16 x bf16 product is exact in fp32). The precision follows the
    # operands: HIGHEST on bf16 operands would make the TPU compiler upcast them and run fp32 passes.
    return jnp.einsum("btkd,bthd->btkh", keys_BTKD, q_BTHD, precision=mxu_precision(keys_BTKD, q_BTHD),
                      preferred_element_type=jnp.float32)


@jax.custom_vjp
def selected_index_scores(q_BTHD, k_BSD, w_BTH, idx_BTK):
    """I[b, t, j] for the keys idx[b, t, j] (any index in [0, S); masking is the caller's) -> [B, T, k] fp32."""
    return _forward(q_BTHD, k_BSD, w_BTH, idx_BTK)[0]


def _forward(q_BTHD, k_BSD, w_BTH, idx_BTK):
    # the keys are gathered in their own dtype: the [B, T, k, D] rows are the largest array of the KL, and
    # bf16 rows are half the HBM bytes of fp32 ones for the same (exact) products
    w = w_BTH.astype(jnp.float32)
    scores = jnp.sum(jax.nn.relu(_dots(gather_rows(k_BSD, idx_BTK), q_BTHD)) * w[:, :, None, :], axis=-1)
    return scores, (q_BTHD, k_BSD, w_BTH, idx_BTK)


def _multiply_add_grads(g_BTKH, keys_BTKD, q_BTHD):
    dq = jnp.sum(g_BTKH[..., None] * keys_BTKD[:, :, :, None, :], axis=2)
    dkeys = sum(g_BTKH[..., h, None] * q_BTHD[:, :, None, h, :] for h in range(q_BTHD.shape[2]))
    return dq, dkeys


def _product_grads(g_BTKH, keys_BTKD, q_BTHD):
    # MXU operands in the keys' dtype with fp32 accumulation, as the sparse-attention kernel's backward
    # feeds its dS (fp32 operands: exact fp32 products, the CPU path's numbers)
    g = g_BTKH.astype(keys_BTKD.dtype)
    precision = mxu_precision(g, keys_BTKD, q_BTHD)
    return (jnp.einsum("btkh,btkd->bthd", g, keys_BTKD, precision=precision, preferred_element_type=jnp.float32),
            jnp.einsum("btkh,bthd->btkd", g, q_BTHD, precision=precision, preferred_element_type=jnp.float32))


def _backward(residuals, d_scores_BTK):
    q_BTHD, k_BSD, w_BTH, idx_BTK = residuals
    w = w_BTH.astype(jnp.float32)
    keys = gather_rows(k_BSD, idx_BTK)           # own dtype, as in the forward
    dots = _dots(keys, q_BTHD)
    dw = jnp.sum(d_scores_BTK[..., None] * jax.nn.relu(dots), axis=2)
    g = jnp.where(dots > 0, d_scores_BTK[..., None] * w[:, :, None, :], 0.0)
    dq, dkeys = jax.lax.platform_dependent(g, keys, q_BTHD, cpu=_multiply_add_grads, default=_product_grads)
    dk = scatter_add_rows(jnp.zeros(k_BSD.shape, jnp.float32), idx_BTK, dkeys)
    return dq.astype(q_BTHD.dtype), dk.astype(k_BSD.dtype), dw.astype(w_BTH.dtype), None


selected_index_scores.defvjp(_forward, _backward)
