"""Gather-form sparse MLA with a hand-written VJP that keeps the attention probabilities, plain XLA
(docs/architecture.md#sparse-attention-absorbed-form).

The same function as ``reference.sparse_mla``. Differentiating the reference reruns each query chunk's
forward in the backward pass (the chunk is rematerialised so the loop does not stack gathered rows):
the gather, the logits product, the softmax's exp and the value product. Here the forward also returns
the probabilities P [B, T, k, H] (fp32: B * T * k * H values, e.g. 67 MB at B=2, T=4096, k=256, H=8)
and the backward reuses them. Per query chunk it re-gathers the rows R [k, C] and runs only the
gradient products:

    dP = R[:, :v] dO^T        dS = P * (dP - delta) * scale        (delta = rowsum(dO * O) - dlse)
    dq = dS^T R               dR = dS q + P dO (first v columns)   -> scatter-added into d(kv)

The forward runs on detached inputs and names its out / lse / probabilities (SAVED_NAMES) before
`_with_grads` attaches the gradient, so a remat policy keeping those names never reruns it.
"""
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.chunking import chunked_over_queries, merge_queries, split_queries
from pallas_kernels.sparse_mla.reference import attend_rows, gather_rows, rows_q_chunk, scatter_add_rows

SAVED_NAMES = ("sparse_mla_out", "sparse_mla_lse", "sparse_mla_probs")
# Largest probability residual (bytes, per layer call) worth keeping; above it, e.g. GLM-5 sizes on the XLA
# impl (T=8192, k=2048, H=64: 4.3 GB per sequence), callers use the reference and its recompute instead.
PROBS_BYTES_BUDGET = 1 << 30


def fits(B, T, k, H, budget=PROBS_BYTES_BUDGET):
    """Whether the fp32 probabilities [B, T, k, H] of one call fit ``budget``."""
    return 4 * B * T * k * H <= budget


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, q_chunk=None, with_target=False):
    """(out [B,T,H,v_dim], lse [B,T,H] fp32) and with ``with_target`` the indexer KL target [B,T,k]:
    see reference.sparse_mla (same arguments, same layout, same query chunks)."""
    if q_chunk is None:
        q_chunk = rows_q_chunk(kv_BSC.shape[0], idx_BTK.shape[2], kv_BSC.shape[2], kv_BSC.dtype.itemsize)
    sg = jax.lax.stop_gradient
    out, lse, probs = _forward(sg(q_BTHC), sg(kv_BSC), idx_BTK, valid_BTK, float(scale), v_dim, q_chunk)
    out, lse, probs = (checkpoint_name(x, name) for x, name in zip((out, lse, probs), SAVED_NAMES))
    target = jnp.mean(probs, axis=-1) if with_target else None          # head mean per slot, detached
    out, lse = _with_grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, out, lse, probs, float(scale), v_dim, q_chunk)
    return (out, lse, target) if with_target else (out, lse)


def _forward(q_BTHC, kv_BSC, idx_BTK, valid_BTK, scale, v_dim, q_chunk):
    def chunk(q, idx, valid):
        return attend_rows(q, kv_BSC, idx, valid, scale, v_dim)

    return chunked_over_queries(chunk, q_chunk, q_BTHC.shape[1], q_BTHC, idx_BTK, valid_BTK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _with_grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, out, lse, probs, scale, v_dim, q_chunk):
    """Identity on (out, lse), the forward's results; its VJP is the attention's gradient w.r.t. q, kv."""
    return out, lse


def _with_grads_fwd(q_BTHC, kv_BSC, idx_BTK, valid_BTK, out, lse, probs, scale, v_dim, q_chunk):
    return (out, lse), (q_BTHC, kv_BSC, idx_BTK, valid_BTK, out, lse, probs)


def _with_grads_bwd(scale, v_dim, q_chunk, residuals, cotangents):
    q_BTHC, kv_BSC, idx_BTK, valid_BTK, out, lse_BTH, probs_BTKH = residuals
    dout, dlse = cotangents
    dlse = jnp.where(jnp.isfinite(lse_BTH), dlse, 0.0)   # a query with no valid slot does not depend on q/kv
    delta_BTH = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
    B, S, C = kv_BSC.shape
    dt = kv_BSC.dtype
    split = functools.partial(split_queries, q_chunk=q_chunk)   # padded queries: no valid slot, P = 0

    def step(dkv_BSC, chunk):
        q, idx, valid, do, delta, probs = chunk
        rows = gather_rows(kv_BSC, idx)                                              # [B, t, k, C]
        dprobs = jnp.einsum("btkv,bthv->btkh", rows[..., :v_dim], do.astype(dt), preferred_element_type=jnp.float32)
        dlogits = (probs * (dprobs - delta[:, :, None, :]) * scale).astype(dt)    # 0 at invalid slots (P = 0)
        dq = jnp.einsum("btkh,btkc->bthc", dlogits, rows, preferred_element_type=jnp.float32)
        drows = jnp.einsum("btkh,bthc->btkc", dlogits, q, preferred_element_type=jnp.float32)
        drows = drows.at[..., :v_dim].add(jnp.einsum("btkh,bthv->btkv", probs.astype(dt), do.astype(dt),
                                                     preferred_element_type=jnp.float32))
        return scatter_add_rows(dkv_BSC, idx, drows, valid), dq

    chunks = (split(q_BTHC), split(idx_BTK), split(valid_BTK), split(dout), split(delta_BTH), split(probs_BTKH))
    dkv, dq = jax.lax.scan(step, jnp.zeros((B, S, C), jnp.float32), chunks)
    dq = merge_queries(dq, q_BTHC.shape[1])
    return dq.astype(q_BTHC.dtype), dkv.astype(kv_BSC.dtype), None, None, None, None, None


_with_grads.defvjp(_with_grads_fwd, _with_grads_bwd)
