"""One layer's attention core (select, attend, indexer KL) when the sequence is split over shards.

`glm5_jax.parallel.context` describes the layout. Per shard (a `logical_shard_map` over the logical
"batch" and "seq" axes; heads stay whole, so the head-averaged KL target needs no reduction):

    gather    the latent rows [c; k_rot] (kv_lora_rank + qk_rope_head_dim values per token), the
              indexer keys (index_head_dim per token, full layers only) and the key positions / segment
              ids of every shard, in natural order. Nothing per head crosses chips. The sparse core
              takes the latent rows in the order the all-gather delivers them (the layout, shard after
              shard) and maps each selected natural index to its row there
              (`glm5_jax.parallel.context.layout_index`): no copy reorders the widest per-token rows or
              their gradients.
    select    the local queries' top-k over all keys (full layers; earlier shards' keys included)
    attend    the sparse core over the gathered rows of the selected keys (dense / warm-up stages:
              every visible key), locally
    KL        the indexer KL of the local queries, per token

Dense core on TPU (``mha``: the flash kernel in the MHA form, glm5_jax/model/mha_form.py): each shard
up-projects the gathered latent rows of every key to per-head keys and values itself (the latent row is
576 values per token against 64 x 512 per-head values: gathering latent rows moves 57x fewer bytes, for
kv_b_proj FLOPs repeated on every shard of the sequence) and runs the kernel over them with its own queries,
causal by positions; the warm-up KL target comes from the kernel's lse. The sparse stage at short
context (``masked``, glm5_jax/model/attention.py `masked_flash_core`) runs the same core over its queries'
top-k selection as a [T_shard, S] mask, and its indexer KL on the warm-up kernels over that mask.

The backward pass returns each key's gradient to the shard that owns it (the all-gather's transpose
is a reduce-scatter). The sparse core runs with ``training_rows=False``: a local query's keys are not
its own rows, so the XLA impl takes its general form (selection mask while the keys number at most
`sparse_mla.ops.DENSE_DECODE_FACTOR` x k, else the gather).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model import mha_form
from glm5_jax.model.config import ModelConfig
from glm5_jax.parallel.axes import BATCH, SEQ
from glm5_jax.parallel.context import from_layout, gather_sequence, layout_index
from glm5_jax.parallel.shard_map import all_gather_logical, logical_shard_map
from pallas_kernels.impls import PALLAS_IMPLS
from pallas_kernels.indexer_kl import ops as indexer_kl_ops
from pallas_kernels.lightning_indexer import ops as indexer_ops
from pallas_kernels.masking import visible_mask
from pallas_kernels.sparse_mla import ops as sparse_mla_ops

# names for remat policies (decoder.REMAT_POLICIES), given inside the shard's computation where a policy
# sees them: the top-k selection (kept, the backward does not redo the top-k) and the indexer KL target
# (kept with the attention kernel's out and lse, the backward does not rerun the attention forward)
SELECTION_NAME = "dsa_selection"
KL_TARGET_NAME = "indexer_kl_target"
_BT = (BATCH, SEQ)
_AXES = {  # logical axes of each per-token operand: split over batch and sequence, whole otherwise
    "q": _BT + (None, None), "kv": _BT + (None,), "pos": _BT, "seg": _BT, "idx": _BT + (None,),
    "valid": _BT + (None,), "iq": _BT + (None, None), "ik": _BT + (None,), "iw": _BT + (None,),
    "q_mha": _BT + (None, None), "w_kvb": (None, None, None), "allowed": _BT + (None,)}


def indexer_lse_from_topk(cfg: ModelConfig, masked: bool) -> bool:
    """Whether the top-k also returns the log-sum-exp of its selected scores for the indexer KL: the sparse
    stage's KL on the masked flash core (Pallas impls), whose kernels then skip their own lse pass."""
    return masked and cfg.runtime.indexer_loss == "sparse" and cfg.runtime.attention_impl in PALLAS_IMPLS


def context_parallel_attention(cfg: ModelConfig, n_shards, q_abs_BTHC, latent_BTC, positions_BT, segment_ids_BT,
                               selection, indexer_qkw=None, *, select, sparse, kl_stage, mha=None, masked=False):
    """(o_lat [B,T,H,R], selection (idx, valid) [B,T,k] (+ allowed [B,T,S] when ``masked``), (kl, has_set)
    or None): kl and has_set are per token [B,T], or with the warm-up KL kernel (``mha`` on a Pallas impl)
    each shard's sums over its queries [B, shards] (KL and the count of tokens with a non-empty key set);
    `mean_over_tokens` of either is the loss.

    All [B, T, ...] operands and results are in the sequence layout over ``n_shards``; a selected index
    is a natural token index. ``indexer_qkw``: the indexer's (q, k, w) on full layers; ``select``: run the
    top-k (else ``selection`` is used); ``sparse``: top-k attention (else every visible key);
    ``kl_stage``: "none", "warmup" or "sparse"; ``mha``: (MHA query [B,T,H,D], kv_b_proj [R,H,d_nope+d_v])
    for the dense core on the flash kernel, which then returns the per-head output [B,T,H,d_v] as o;
    ``masked``: sparse attention on that flash core over the selection as a mask (the selection carries it).
    """
    args = {"q": q_abs_BTHC, "kv": latent_BTC, "pos": positions_BT, "seg": segment_ids_BT,
            "idx": selection[0], "valid": selection[1]}
    if indexer_qkw is not None:
        args.update(zip(("iq", "ik", "iw"), indexer_qkw))
    if masked != (sparse and mha is not None):
        raise ValueError("context_parallel_attention: the masked flash core is sparse attention with an MHA core")
    if masked and not select:
        args["allowed"] = selection[2]
    if mha is not None:
        del args["q"]                                        # the absorbed query is not computed
        args.update(q_mha=mha[0], w_kvb=mha[1])
    names = sorted(args)
    R = cfg.kv_lora_rank

    def _core(q, kv, idx, valid, q_pos, kv_pos, q_seg, kv_seg):
        """(o, KL target or None): top-k attention when ``sparse``, else every visible key."""
        if sparse:
            with_target = kl_stage == "sparse"
            attended = sparse_mla_ops.sparse_mla(q, kv, idx, valid, scale=cfg.softmax_scale, v_dim=R,
                                                 impl=cfg.runtime.attention_impl, training_rows=False,
                                                 with_target=with_target)
            target = None if attended.target is None else checkpoint_name(attended.target, KL_TARGET_NAME)
            return attended.out, target
        visible = visible_mask(q_pos, kv_pos, q_seg, kv_seg)
        o, _ = sparse_mla_ops.dense_mla(q, kv, visible, scale=cfg.softmax_scale, v_dim=R,
                                        q_chunk=cfg.runtime.attention_q_chunk)
        return o, None

    rows_in_layout = sparse and mha is None

    def per_shard(*values):
        a = dict(zip(names, values))
        kv_pos, kv_seg = (gather_sequence(a[x], n_shards) for x in ("pos", "seg"))
        if rows_in_layout:      # the gathered rows as delivered; selected indices mapped to them below
            kv = all_gather_logical(a["kv"], SEQ, axis=1)
        else:
            kv = gather_sequence(a["kv"], n_shards)
        ik = gather_sequence(a["ik"], n_shards) if "ik" in a else None
        idx, valid, allowed, index_lse = a["idx"], a["valid"], a.get("allowed"), None
        if select:
            with_lse = indexer_lse_from_topk(cfg, masked)
            with jax.named_scope("lightning_indexer"):      # scope names: glm5_jax.cost.categories
                picked = indexer_ops.indexer_topk(a["iq"], ik, a["iw"], a["pos"], kv_pos, a["seg"], kv_seg,
                                                  topk=cfg.index_topk, impl=cfg.runtime.attention_impl,
                                                  with_mask=masked, with_lse=with_lse)
            picked = tuple(checkpoint_name(x, SELECTION_NAME) for x in picked)
            if with_lse:
                picked, index_lse = picked[:3], picked[3]
            idx, valid, allowed = picked if masked else picked + (None,)
        if mha is not None:
            k_m, v_m = mha_form.mha_keys_values(cfg, kv[..., :R], kv[..., R:], a["w_kvb"])
            with jax.named_scope("attention_core"):
                o, lse = mha_form.flash_core(cfg, a["q_mha"], k_m, v_m, a["pos"], kv_pos, a["seg"], kv_seg,
                                             block=mha_form.chunk_block(a["pos"].shape[1] // 2,
                                                                        cfg.runtime.attention_block),
                                             allowed_BTS=allowed)
            target, kl_q, kl_kv, kl_lse = None, a["q_mha"], k_m, lse   # the KL target from the lse
        else:
            rows_idx = layout_index(idx, n_shards, kv.shape[1]) if rows_in_layout else idx
            with jax.named_scope("attention_core"):
                o, target = _core(a["q"], kv, rows_idx, valid, a["pos"], kv_pos, a["seg"], kv_seg)
            # the KL without the core's target recomputes it from the rows at natural indices
            kl_q, kl_kv, kl_lse = a["q"], from_layout(kv, n_shards) if rows_in_layout and target is None else kv, None
        if kl_stage == "none":
            kl, has_set = jnp.zeros(a["pos"].shape, jnp.float32), jnp.zeros(a["pos"].shape, bool)
        elif mha is not None and (kl_stage == "warmup" or masked) and cfg.runtime.attention_impl in PALLAS_IMPLS:
            # the kernel's per-row sums over this shard's queries, [B, 1] per shard: summed over the
            # shards by mean_over_tokens like per-token values; over the selected keys when masked
            sg = jax.lax.stop_gradient
            with jax.named_scope("indexer_kl"):
                kl, has_set = indexer_kl_ops.warmup_kl_sums(
                    sg(kl_q), sg(kl_kv), sg(kl_lse), a["iq"], ik, a["iw"], a["pos"], kv_pos, a["seg"], kv_seg,
                    scale=cfg.softmax_scale, impl=cfg.runtime.attention_impl,
                    block_q=min(indexer_kl_ops.BLOCK_Q, mha_form.chunk_block(a["pos"].shape[1] // 2)),
                    allowed_BTS=allowed, index_lse_BT=index_lse)
            kl, has_set = kl[:, None], has_set[:, None]
        elif kl_stage == "sparse" and target is not None and cfg.runtime.attention_impl in PALLAS_IMPLS:
            with jax.named_scope("indexer_kl"):
                kl, has_set = indexer_kl_ops.sparse_kl_per_token(a["iq"], ik, a["iw"], idx, valid, target,
                                                                 impl=cfg.runtime.attention_impl)
        else:
            sg = jax.lax.stop_gradient
            picked = dict(idx_BTK=idx, valid_BTK=valid, target_BTK=target) if kl_stage == "sparse" else {}
            with jax.named_scope("indexer_kl"):
                kl, has_set = indexer_kl_ops.indexer_kl_per_token(
                    sg(kl_q), sg(kl_kv), a["iq"], ik, a["iw"], a["pos"], kv_pos, a["seg"], kv_seg,
                    scale=cfg.softmax_scale, stage=kl_stage, lse_BTH=kl_lse, **picked)
        return (o, idx, valid, kl, has_set) + ((allowed,) if masked else ())

    out_axes = (_AXES["q"], _AXES["idx"], _AXES["valid"], _BT, _BT) + ((_AXES["allowed"],) if masked else ())
    o, idx, valid, kl, has_set, *allowed = logical_shard_map(per_shard, tuple(_AXES[x] for x in names), out_axes)(
        *(args[x] for x in names))
    return o, (idx, valid, *allowed), (None if kl_stage == "none" else (kl, has_set))
