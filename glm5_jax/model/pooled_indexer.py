"""GLM-5.3-Flash's pooled DSA indexer (transformers' ``Glm5NextTextIndexer``): the indexer scores groups
of ``index_kpool`` = P consecutive tokens instead of single tokens.

Within each document, tokens p*P .. p*P + P - 1 (positions) form pool p. A pool's key is a learned
softmax-weighted mean of its tokens' indexer keys, the weights from a gate projection of the hidden
state plus a per-slot offset (``index_kpool_compress_gate``, ``index_kpool_compress_ape``). A query
scores every complete pool it sees (its last token at or before the query) like the lightning indexer
(sum over heads of w_h ReLU(q_h . key)), attends to the tokens of the index_topk / P best pools, and,
with ``index_kpool_always_select_tail``, to the tokens of its own incomplete pool (the "tail").

Pool keys are computed at every token (over the P tokens ending there) and kept where a pool ends, so
the same code runs over a sequence and over decode-cache slots (slot s = position s).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig

_HI = jax.lax.Precision.HIGHEST


def selection_width(cfg: ModelConfig, num_keys: int) -> int:
    """Entries of a pooled selection over ``num_keys`` keys: whole pools, then the tail's P - 1 (>= 1)."""
    P = cfg.index_kpool
    pools = min(cfg.index_topk // P, num_keys // P)
    return max(pools * P + (P - 1 if cfg.index_kpool_always_select_tail else 0), 1)


def pool_keys(k_BSd, gate_BSd, ape_Pd):
    """Key of the pool ending at each slot s: softmax_j(gate[s-P+1+j] + ape[j]) weighted keys -> [B, S, d]
    fp32 (meaningful where a pool ends)."""
    P = ape_Pd.shape[0]
    S = k_BSd.shape[1]

    def back(x, n):   # x shifted n slots later (slot s holds x[s - n])
        return jnp.pad(x, ((0, 0), (n, 0), (0, 0)))[:, :S]

    keys = jnp.stack([back(k_BSd, P - 1 - j) for j in range(P)], axis=2).astype(jnp.float32)      # [B,S,P,d]
    logits = jnp.stack([back(gate_BSd, P - 1 - j) for j in range(P)], axis=2).astype(jnp.float32)
    probs = jax.nn.softmax(logits + ape_Pd.astype(jnp.float32), axis=2)
    return jnp.sum(probs * keys, axis=2)


def pooled_topk(cfg: ModelConfig, q_BTHd, w_BTH, k_BSd, gate_BSd, ape_Pd, q_pos_BT, kv_pos_BS, q_seg_BT,
                kv_seg_BS, q_slot_BT):
    """The selection (idx [B, T, n], valid [B, T, n]) with n = `selection_width`; ``q_slot`` is each query's
    own key slot (its index in the sequence, or its position in a decode cache). Queries run
    ``cfg.attention_q_chunk`` at a time, so the scores take [B, chunk, H_I, S], not [B, T, H_I, S]."""
    pooled = pool_keys(k_BSd, gate_BSd, ape_Pd)
    B, T = q_pos_BT.shape
    C = cfg.runtime.attention_q_chunk
    if T <= C:
        return _select(cfg, q_BTHd, w_BTH, pooled, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, q_slot_BT)
    n = -(-T // C)

    def chunks(x):   # [B, T, ...] -> [n, B, C, ...] (the padding queries: segment 0, nothing selected)
        x = jnp.pad(x, ((0, 0), (0, n * C - T)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 1, 0)

    def one(args):
        return _select(cfg, *args[:2], pooled, args[2], kv_pos_BS, args[3], kv_seg_BS, args[4])

    idx, valid = jax.lax.map(one, tuple(chunks(x) for x in (q_BTHd, w_BTH, q_pos_BT, q_seg_BT, q_slot_BT)))
    return tuple(jnp.moveaxis(x, 0, 1).reshape((B, n * C) + x.shape[3:])[:, :T] for x in (idx, valid))


def _select(cfg: ModelConfig, q_BTHd, w_BTH, pooled, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, q_slot_BT):
    P = cfg.index_kpool
    S = pooled.shape[1]
    scores = jnp.einsum("bthd,bsd->bths", q_BTHd.astype(jnp.float32), pooled, precision=_HI)
    scores = jnp.einsum("bth,bths->bts", w_BTH.astype(jnp.float32), jax.nn.relu(scores), precision=_HI)
    ends = (kv_pos_BS % P == P - 1) & (kv_seg_BS > 0)
    candidate = (ends[:, None, :] & (kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None])
                 & (kv_seg_BS[:, None, :] == q_seg_BT[:, :, None]) & (q_seg_BT > 0)[:, :, None])
    n_pools = min(cfg.index_topk // P, S // P)
    parts_idx, parts_valid = [], []
    if n_pools:
        top, end_idx = jax.lax.top_k(jnp.where(candidate, scores, -jnp.inf), n_pools)
        offsets = jnp.arange(P) - (P - 1)
        parts_idx.append((end_idx[..., None] + offsets).reshape(end_idx.shape[:2] + (-1,)))
        parts_valid.append(jnp.repeat(jnp.isfinite(top), P, axis=-1))
    if cfg.index_kpool_always_select_tail and P > 1:
        tail_count = (q_pos_BT + 1) % P                                    # tokens of the query's open pool
        j = jnp.arange(P - 1)
        parts_idx.append(q_slot_BT[..., None] - tail_count[..., None] + 1 + j)
        parts_valid.append((j < tail_count[..., None]) & (q_seg_BT > 0)[..., None])
    if not parts_idx:
        B, T = q_pos_BT.shape
        return jnp.zeros((B, T, 1), jnp.int32), jnp.zeros((B, T, 1), bool)
    idx, valid = jnp.concatenate(parts_idx, -1), jnp.concatenate(parts_valid, -1)
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid
