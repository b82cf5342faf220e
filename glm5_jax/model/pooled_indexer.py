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
from pallas_kernels.masking import top_k_mask

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
                kv_seg_BS, q_slot_BT, with_mask=False):
    """The selection (idx [B, T, n], valid [B, T, n]) with n = `selection_width`; ``q_slot`` is each query's
    own key slot (its index in the sequence, or its position in a decode cache). ``with_mask`` also the same
    selection as a mask [B, T, S] int8 (1 = selected; what the masked flash kernel reads). Queries run
    ``cfg.attention_q_chunk`` at a time, so the scores take [B, chunk, H_I, S], not [B, T, H_I, S]."""
    pooled = pool_keys(k_BSd, gate_BSd, ape_Pd)
    B, T = q_pos_BT.shape
    C = cfg.runtime.attention_q_chunk
    if T <= C:
        return _select(cfg, q_BTHd, w_BTH, pooled, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, q_slot_BT, with_mask)
    n = -(-T // C)

    def chunks(x):   # [B, T, ...] -> [n, B, C, ...] (the padding queries: segment 0, nothing selected)
        x = jnp.pad(x, ((0, 0), (0, n * C - T)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 1, 0)

    def one(args):
        return _select(cfg, *args[:2], pooled, args[2], kv_pos_BS, args[3], kv_seg_BS, args[4], with_mask)

    picked = jax.lax.map(one, tuple(chunks(x) for x in (q_BTHd, w_BTH, q_pos_BT, q_seg_BT, q_slot_BT)))
    return tuple(jnp.moveaxis(x, 0, 1).reshape((B, n * C) + x.shape[3:])[:, :T] for x in picked)


def _token_mask(cfg: ModelConfig, ends_BTS, kv_pos_BS, q_pos_BT, q_seg_BT, q_slot_BT):
    """The selection as a token mask [B, T, S] bool, from the selected pool ends ``ends`` [B, T, S]: the P tokens
    of each selected pool and the query's tail. Slot s (position p) belongs to the pool ending at slot
    s + P - 1 - p % P (positions count up one a slot within a document), so of the P shifted copies of the
    ends, slot s takes the one shifted by P - 1 - p % P: elementwise over [T, S], no scatter."""
    P = cfg.index_kpool
    S = ends_BTS.shape[-1]
    to_end = (P - 1 - kv_pos_BS % P)[:, None, :]                       # [B, 1, S]
    mask = jnp.zeros(ends_BTS.shape, bool)
    for j in range(min(P, S)):                                          # a shift by >= S holds nothing
        shifted = jnp.pad(ends_BTS[..., j:], ((0, 0), (0, 0), (0, j)))  # slot s holds ends[s + j]
        mask = mask | (shifted & (to_end == j))
    if cfg.index_kpool_always_select_tail and P > 1:
        tail_count = ((q_pos_BT + 1) % P)[..., None]                     # tokens of the query's open pool
        slot = jnp.arange(S, dtype=q_slot_BT.dtype)
        mask = mask | ((slot > q_slot_BT[..., None] - tail_count) & (slot <= q_slot_BT[..., None])
                       & (q_seg_BT > 0)[..., None])
    return mask


def _select(cfg: ModelConfig, q_BTHd, w_BTH, pooled, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, q_slot_BT,
            with_mask=False):
    P = cfg.index_kpool
    S = pooled.shape[1]
    scores = jnp.einsum("bthd,bsd->bths", q_BTHd.astype(jnp.float32), pooled, precision=_HI)
    scores = jnp.einsum("bth,bths->bts", w_BTH.astype(jnp.float32), jax.nn.relu(scores), precision=_HI)
    ends = (kv_pos_BS % P == P - 1) & (kv_seg_BS > 0)
    candidate = (ends[:, None, :] & (kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None])
                 & (kv_seg_BS[:, None, :] == q_seg_BT[:, :, None]) & (q_seg_BT > 0)[:, :, None])
    n_pools = min(cfg.index_topk // P, S // P)
    parts_idx, parts_valid = [], []
    ends = jnp.zeros(candidate.shape, bool)                              # the selected pools' last slots
    if n_pools:
        pool_scores = jnp.where(candidate, scores, -jnp.inf)
        top, end_idx = jax.lax.top_k(pool_scores, n_pools)
        if with_mask:
            ends = top_k_mask(pool_scores, top, end_idx)
        offsets = jnp.arange(P) - (P - 1)
        parts_idx.append((end_idx[..., None] + offsets).reshape(end_idx.shape[:2] + (-1,)))
        parts_valid.append(jnp.repeat(jnp.isfinite(top), P, axis=-1))
    if cfg.index_kpool_always_select_tail and P > 1:
        tail_count = (q_pos_BT + 1) % P                                    # tokens of the query's open pool
        j = jnp.arange(P - 1)
        parts_idx.append(q_slot_BT[..., None] - tail_count[..., None] + 1 + j)
        parts_valid.append((j < tail_count[..., None]) & (q_seg_BT > 0)[..., None])
    mask = (_token_mask(cfg, ends, kv_pos_BS, q_pos_BT, q_seg_BT, q_slot_BT).astype(jnp.int8),) if with_mask else ()
    if not parts_idx:
        B, T = q_pos_BT.shape
        return (jnp.zeros((B, T, 1), jnp.int32), jnp.zeros((B, T, 1), bool)) + mask
    idx, valid = jnp.concatenate(parts_idx, -1), jnp.concatenate(parts_valid, -1)
    return (jnp.where(valid, idx, 0).astype(jnp.int32), valid) + mask
