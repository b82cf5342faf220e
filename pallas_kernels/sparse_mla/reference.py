"""Token-sparse MLA attention in the absorbed ("MQA") form, plain XLA.

Background: docs/architecture.md#sparse-attention-absorbed-form.

All H query heads (width C = d_c + d_r, e.g. 576) attend to one shared latent KV row per selected key:
the key is the whole row ``[c; k_rot]`` and the value its first ``v_dim`` (= d_c, e.g. 512) entries.
Per query the k selected rows are gathered once and shared by every head. Softmax in fp32; slots
marked invalid are excluded; a row with no valid slot returns zeros and lse = -inf.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.chunking import chunked_over_queries
from pallas_kernels.row_scatter import reference as row_scatter_reference


def _masked_softmax(logits, allowed, axis=-1):
    """fp32 softmax over ``axis`` restricted to ``allowed`` -> (probs, lse); empty rows give 0, -inf."""
    logits = jnp.where(allowed, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=axis)
    probs = jnp.exp(logits - jnp.expand_dims(jnp.where(jnp.isfinite(lse), lse, 0.0), axis))
    return probs, lse


# Bytes of gathered rows [B, q_chunk, k, C] one query chunk may hold: small enough that the rows written
# by the gather are still in cache when both products read them (bench shape B=2, k=256, C=144: 4 queries;
# the whole T = 4096 train step took 0.84x the time of 64-query chunks, which gather 19 MB each).
ROWS_CHUNK_BYTES = 3 << 19


def rows_q_chunk(B, k, C, itemsize, budget=ROWS_CHUNK_BYTES):
    """Queries per chunk: the largest power of two whose gathered rows fit ``budget`` (at least 1)."""
    fit = max(1, budget // (B * k * C * itemsize))
    return 1 << (fit.bit_length() - 1)


def gather_rows(kv_BSC, idx_BTK):
    """The selected latent rows [B, T, k, C] of kv [B, S, C]."""
    return jax.vmap(lambda kv, i: kv[i])(kv_BSC, idx_BTK)


def scatter_add_rows(d_BSC, idx_BTK, rows_BTKC, valid_BTK=None):
    """The transpose of `gather_rows`: d[b, idx[b, t, j]] += rows[b, t, j] for every slot, or for the
    ``valid`` slots only (the others are sent out of range and dropped). A row may have more than one
    dim (d [B, S, ...], rows [B, T, k, ...])."""
    B, S = d_BSC.shape[:2]
    target = idx_BTK if valid_BTK is None else jnp.where(valid_BTK, idx_BTK, S)
    return row_scatter_reference.row_scatter_add(d_BSC, rows_BTKC.reshape(B, -1, *d_BSC.shape[2:]),
                                                 target.reshape(B, -1))


def attend_rows(q_BTHC, kv_BSC, idx_BTK, valid_BTK, scale, v_dim):
    """One query chunk: (out [B,T,H,v_dim] in q's dtype, lse [B,T,H], probabilities [B,T,k,H] fp32)."""
    rows_BTKC = gather_rows(kv_BSC, idx_BTK)
    logits_BTKH = jnp.einsum("btkc,bthc->btkh", rows_BTKC, q_BTHC, preferred_element_type=jnp.float32) * scale
    probs_BTKH, lse = _masked_softmax(logits_BTKH, valid_BTK[:, :, :, None], axis=2)
    out = jnp.einsum("btkh,btkc->bthc", probs_BTKH.astype(kv_BSC.dtype), rows_BTKC,
                     preferred_element_type=jnp.float32)[..., :v_dim]
    return out.astype(q_BTHC.dtype), lse, probs_BTKH


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, q_chunk=None, with_target=False):
    """Attention of q [B,T,H,C] over the rows idx [B,T,k] of latent kv [B,S,C] (valid slots only).

    Returns (out [B,T,H,v_dim] in q's dtype, lse [B,T,H] fp32); with ``with_target`` also the DSA
    indexer's sparse-stage KL target [B,T,k] fp32 (no gradient): the attention probabilities averaged
    over heads, i.e. head-summed and L1-normalised over the selected slots
    (docs/architecture.md#dsa-training-stages-and-the-indexer-kl), from these logits.

    Layout (XLA:CPU speed, same maths): per query the logits are computed key-major, [k, C] @ [C, H]
    -> [k, H], and the softmax runs over that k axis; with the few heads as the small matmul side this
    is several times faster than [H, C] @ [C, k]. The value product uses the whole gathered row and
    slices v_dim afterwards (slicing the rows first materialises a copy of them). Small query chunks
    keep one chunk's gathered rows [B, q_chunk, k, C] cache-sized (``q_chunk=None``: `rows_q_chunk`).
    """
    if q_chunk is None:
        q_chunk = rows_q_chunk(kv_BSC.shape[0], idx_BTK.shape[2], kv_BSC.shape[2], kv_BSC.dtype.itemsize)

    def chunk(q, idx, valid):
        out, lse, probs_BTKH = attend_rows(q, kv_BSC, idx, valid, scale, v_dim)
        if with_target:
            return out, lse, jax.lax.stop_gradient(jnp.mean(probs_BTKH, axis=-1))
        return out, lse

    # Rematerialised per chunk: differentiating the loop would otherwise stack every chunk's gathered
    # rows [B, q_chunk, k, C] as residuals (k/S times the whole latent per query) and copy them back out.
    return chunked_over_queries(jax.checkpoint(chunk), q_chunk, q_BTHC.shape[1], q_BTHC, idx_BTK, valid_BTK)


def dense_mla(q_BTHC, kv_BSC, visible_BTS, *, scale, v_dim, q_chunk=256):
    """The same absorbed attention over every visible key (DSA's dense stage, or S <= k)."""

    def chunk(q, visible):
        logits = jnp.einsum("bthc,bsc->bths", q, kv_BSC, preferred_element_type=jnp.float32) * scale
        probs, lse = _masked_softmax(logits, visible[:, :, None, :])
        out = jnp.einsum("bths,bsv->bthv", probs.astype(kv_BSC.dtype), kv_BSC[..., :v_dim],
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    return chunked_over_queries(chunk, q_chunk, q_BTHC.shape[1], q_BTHC, visible_BTS)
