"""Token-sparse MLA attention computed densely over a selection mask, plain XLA.

Background: docs/architecture.md#sparse-attention-absorbed-form.

The same function as ``reference.sparse_mla``, for hosts where gathering k latent rows per query is
the slow part (XLA:CPU): the per-query products [k, C] @ [C, H] of the gather form run at a fraction of
matmul speed, while scoring every earlier key with one matmul per query block, [T_q * H, C] @ [C, S_c],
and masking to the selected set runs near the matmul peak. A scored key runs several times cheaper than a
gathered one, so the dense form wins for the query blocks that score at most a few times k keys
(``dense_prefix``); later blocks of a long sequence gather.

Causal key blocks: query block c (queries [c * T_q, (c + 1) * T_q)) scores only keys [0, (c + 1) * T_q).
That is exact when every *selected* key sits at or before its query (true for training rows: top-k
picks visible keys, and in a packed row a later index is a later position or another segment); a
selected key past its query block would be dropped. Not for decode caches, whose slots can run ahead.

A hand-written VJP keeps the backward matmul-shaped too (flash-attention style: residuals are q, kv,
the selection, out and lse; the probabilities are recomputed per block).
"""
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.masking import selection_mask
from pallas_kernels.sparse_mla.attention_vjp import attention_vjp

# a causal query block runs dense while it scores <= this x k keys per query: a scored key costs a
# fraction of a gathered one (dense matmul vs per-query gather); bench/train_step.py has the measurements.
DENSE_BLOCK_FACTOR = 4.0
Q_CHUNK = 128  # queries per causal block (the [Q_CHUNK * H, C] @ [C, S_c] logits matmul)
SAVED_NAMES = ("masked_dense_out", "masked_dense_lse")  # the forward's results, for remat policies


def dense_prefix(T, k, q_chunk, factor=DENSE_BLOCK_FACTOR):
    """How many leading queries of T to attend densely: whole causal blocks that each score at most
    ``factor * k`` keys (T when every block does). The rest gather their k keys."""
    return min(T, int(factor * k) // q_chunk * q_chunk)


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, q_chunk=Q_CHUNK, with_target=False):
    """(out [B,T,H,v_dim], lse [B,T,H] fp32) and with ``with_target`` the indexer KL target [B,T,k]
    (head-mean of the attention probabilities at the selected slots, no gradient): see reference.py.
    Keys are the first T rows of kv (training: queries and keys are the same tokens).

    The forward runs on detached inputs and its out / lse are named (SAVED_NAMES) before `_with_grads`
    attaches the gradient: a remat policy saving those names then never reruns the forward, which a
    custom_vjp's own fwd rule would be (its residuals are not visible to the policy)."""
    T = q_BTHC.shape[1]
    if kv_BSC.shape[1] != T:
        raise ValueError(f"masked-dense sparse_mla needs keys = queries (training rows); got T={T}, "
                         f"S={kv_BSC.shape[1]}")
    out, lse, target = _forward(jax.lax.stop_gradient(q_BTHC), jax.lax.stop_gradient(kv_BSC), idx_BTK, valid_BTK,
                                float(scale), v_dim, q_chunk)
    out, lse = checkpoint_name(out, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
    out, lse = _with_grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, out, lse, (float(scale), v_dim, q_chunk))
    return (out, lse, target) if with_target else (out, lse)


def _blocks(T, q_chunk):
    """(start, end) of each causal block's queries; the block scores keys [0, end)."""
    return [(s, min(T, s + q_chunk)) for s in range(0, T, q_chunk)]


def _selection_bias(idx_BTK, valid_BTK, num_keys):
    """Additive logit bias [B, T, num_keys]: 0 at selected keys, -inf elsewhere. Adding it, rather than
    a select on the [B, T, H, S] logits, keeps the masking to one add."""
    return jnp.where(selection_mask(idx_BTK, valid_BTK, num_keys), 0.0, -jnp.inf).astype(jnp.float32)


def _probs_from_logits(logits, lse=None):
    """(probs, lse) over the last axis of fp32 logits; with ``lse`` given, probs from it (the backward).
    A query with no selected key has lse = -inf and probs 0."""
    if lse is None:
        lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), lse


def _block_probs(q, kv, bias_BTS, scale, lse=None):
    """fp32 logits of one block -> (probs [B, t, H, S], lse [B, t, H]) (`_probs_from_logits`)."""
    logits = jnp.einsum("bthc,bsc->bths", q, kv, preferred_element_type=jnp.float32) * scale + bias_BTS[:, :, None, :]
    return _probs_from_logits(logits, lse)


def _forward(q_BTHC, kv_BSC, idx_BTK, valid_BTK, scale, v_dim, q_chunk):
    outs, lses, targets = [], [], []
    for t0, t1 in _blocks(q_BTHC.shape[1], q_chunk):
        kv = kv_BSC[:, :t1]
        idx, valid = idx_BTK[:, t0:t1], valid_BTK[:, t0:t1]
        probs, lse = _block_probs(q_BTHC[:, t0:t1], kv, _selection_bias(idx, valid, t1), scale)
        outs.append(jnp.einsum("bths,bsv->bthv", probs.astype(kv.dtype), kv[..., :v_dim],
                               preferred_element_type=jnp.float32).astype(q_BTHC.dtype))
        lses.append(lse)
        # KL target: head-mean probability of each selected slot (an invalid slot reads 0)
        mean_BTS = jnp.mean(probs, axis=2)
        targets.append(jnp.where(valid, jnp.take_along_axis(mean_BTS, jnp.where(valid, idx, 0), axis=-1), 0.0))
    cat = functools.partial(jnp.concatenate, axis=1)
    return cat(outs), cat(lses), cat(targets)


def _grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, dout, lse_BTH, delta_BTH, scale, v_dim, q_chunk):
    """Per block: dP = dO V^T, dS = P (dP - delta), dq = dS K, dK += dS^T q, dV += P^T dO (flash-attention
    style: P recomputed from q, kv and lse)."""
    dkv = jnp.zeros(kv_BSC.shape, jnp.float32)
    dqs = []
    for t0, t1 in _blocks(q_BTHC.shape[1], q_chunk):
        q, kv, do = q_BTHC[:, t0:t1], kv_BSC[:, :t1], dout[:, t0:t1]
        bias = _selection_bias(idx_BTK[:, t0:t1], valid_BTK[:, t0:t1], t1)
        probs, _ = _block_probs(q, kv, bias, scale, lse=lse_BTH[:, t0:t1])
        dprobs = jnp.einsum("bthv,bsv->bths", do, kv[..., :v_dim], preferred_element_type=jnp.float32)
        dlogits = (probs * (dprobs - delta_BTH[:, t0:t1, :, None]) * scale).astype(kv.dtype)
        dqs.append(jnp.einsum("bths,bsc->bthc", dlogits, kv, preferred_element_type=jnp.float32))
        # key gradients as [C, S] products, so the big [t h, s] operands stay in their natural layout
        dk_BCS = jnp.einsum("bthc,bths->bcs", q, dlogits, preferred_element_type=jnp.float32)
        dv_BVS = jnp.einsum("bthv,bths->bvs", do, probs.astype(kv.dtype), preferred_element_type=jnp.float32)
        dkv = dkv.at[:, :t1].add(jnp.swapaxes(dk_BCS.at[:, :v_dim].add(dv_BVS), 1, 2))
    return jnp.concatenate(dqs, axis=1), dkv


_with_grads = attention_vjp(_grads)   # identity on (out, lse); its VJP is `_grads`
