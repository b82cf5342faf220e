"""Token-sparse MLA attention in the absorbed ("MQA") form, plain XLA (spec §4.5).

All H query heads (width C = d_c + d_r, e.g. 576) attend to one shared latent KV row per selected key:
the key is the whole row ``[c; k_rot]`` and the value its first ``v_dim`` (= d_c, e.g. 512) entries.
Per query the k selected rows are gathered once and shared by every head. Softmax in fp32; slots
marked invalid are excluded; a row with no valid slot returns zeros and lse = -inf.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.chunking import chunked_over_queries


def _masked_softmax(logits, allowed):
    """fp32 softmax over the last axis restricted to ``allowed`` -> (probs, lse); empty rows give 0, -inf."""
    logits = jnp.where(allowed, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return probs, lse


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, q_chunk=256):
    """Attention of q [B,T,H,C] over the rows idx [B,T,k] of latent kv [B,S,C] (valid slots only).

    Returns (out [B,T,H,v_dim] in q's dtype, lse [B,T,H] fp32).
    """

    def chunk(q, idx, valid):
        rows_BTKC = jax.vmap(lambda kv, i: kv[i])(kv_BSC, idx)
        logits = jnp.einsum("bthc,btkc->bthk", q, rows_BTKC, preferred_element_type=jnp.float32) * scale
        probs, lse = _masked_softmax(logits, valid[:, :, None, :])
        out = jnp.einsum("bthk,btkv->bthv", probs.astype(kv_BSC.dtype), rows_BTKC[..., :v_dim],
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    return chunked_over_queries(chunk, q_chunk, q_BTHC.shape[1], q_BTHC, idx_BTK, valid_BTK)


def dense_mla(q_BTHC, kv_BSC, visible_BTS, *, scale, v_dim, q_chunk=256):
    """The same absorbed attention over every visible key (DSA's dense stage, or S <= k)."""

    def chunk(q, visible):
        logits = jnp.einsum("bthc,bsc->bths", q, kv_BSC, preferred_element_type=jnp.float32) * scale
        probs, lse = _masked_softmax(logits, visible[:, :, None, :])
        out = jnp.einsum("bths,bsv->bthv", probs.astype(kv_BSC.dtype), kv_BSC[..., :v_dim],
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse

    return chunked_over_queries(chunk, q_chunk, q_BTHC.shape[1], q_BTHC, visible_BTS)
