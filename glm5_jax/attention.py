"""MLA attention with DeepSeek Sparse Attention (spec §4).

`Indexer` is the DSA lightning indexer (§4.3); `MLAttention` holds the MLA projections (§4.1) and runs
the attention core in one of two forms that compute the same thing:

* ``absorbed`` (default, §4.5): W_UK is folded into the query and W_UV applied after attention, so
  every head attends to the one shared latent row [c; k_rot] (576 wide for GLM-5). Sparse attention
  gathers the selected rows once per query (`pallas_kernels.sparse_mla`).
* ``mha`` (§4.1): keys/values are expanded per head and the DSA selection becomes a mask over all keys.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.kernel_sharding import logical_shard_map
from glm5_jax.layers import LayerNorm, RMSNorm, constrain, einsum, logical_param, normal_init
from glm5_jax.rope import apply_rope, rope_cos_sin
from pallas_kernels.indexer_kl import ops as indexer_kl_ops
from pallas_kernels.lightning_indexer import ops as indexer_ops
from pallas_kernels.masking import selection_mask, visible_mask
from pallas_kernels.sparse_mla import gather_saved, masked_dense
from pallas_kernels.sparse_mla import ops as sparse_mla_ops
from pallas_kernels.sparse_mla import reference as mla_reference


# Decoding over a cache of at most this many times index_topk slots attends through the selection mask
# (one matmul over all slots) instead of gathering the selected latent rows: same result, and on XLA a
# gather of k rows per query costs more than k * DENSE_DECODE_FACTOR dense slots.
DENSE_DECODE_FACTOR = 4
# name of the top-k selection for remat policies (decoder.REMAT_POLICIES keep it rather than redo top-k)
SELECTION_NAME = "dsa_selection"
# the absorbed attention core output and the indexer KL target it computes (remat policy "dots_attention_saveable")
ATTENTION_CORE_NAMES = ("attention_core_out", "indexer_kl_target")


def _rope(cfg, x, positions_BT, *, interleaved, head_axis: bool):
    cos, sin = rope_cos_sin(positions_BT, x.shape[-1], cfg.rope_theta, cfg.rope_scaling_dict,
                            cfg.max_position_embeddings)
    if head_axis:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return apply_rope(x, cos, sin, interleaved=interleaved)


class Indexer(nn.Module):
    """Lightning-indexer projections: (q [B,T,H_I,d_I], k [B,T,d_I], w [B,T,H_I]) in fp32 (§4.3)."""
    cfg: object

    @nn.compact
    def __call__(self, a_BTD, qr_BTQ, positions_BT):
        cfg = self.cfg
        init, pdt = normal_init(cfg), cfg.jnp_param_dtype
        h_i, d_i, d_r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        wq_b = logical_param(self, "wq_b", (cfg.q_lora_rank, h_i, d_i), ("q_lora", "index_heads", "index_dim"),
                             init, pdt)
        wk = logical_param(self, "wk", (cfg.hidden_size, d_i), ("embed", "index_dim"), init, pdt)
        weights_proj = logical_param(self, "weights_proj", (cfg.hidden_size, h_i), ("embed", "index_heads"),
                                     init, pdt)
        f32 = jnp.float32
        q = einsum("btq,qhd->bthd", qr_BTQ, wq_b, cfg.jnp_dtype, f32)
        k = einsum("btd,de->bte", a_BTD, wk, cfg.jnp_dtype, f32)
        k = LayerNorm(cfg.indexer_norm_eps, "index_dim", pdt, name="k_norm")(k)
        # The rope slice comes FIRST in indexer heads and keys (P2).
        rot = dict(interleaved=cfg.indexer_rope_interleave)
        q = jnp.concatenate([_rope(cfg, q[..., :d_r], positions_BT, head_axis=True, **rot), q[..., d_r:]], -1)
        k = jnp.concatenate([_rope(cfg, k[..., :d_r], positions_BT, head_axis=False, **rot), k[..., d_r:]], -1)
        # weights_proj runs in fp32 like HF; both positive scales folded into w (ReLU(cx) = cReLU(x)).
        w = jnp.einsum("btd,dh->bth", a_BTD.astype(f32), weights_proj.astype(f32),
                       precision=jax.lax.Precision.HIGHEST) * (h_i ** -0.5 * d_i ** -0.5)
        return q, k, w


class MLAttention(nn.Module):
    """One layer's MLA attention + DSA. `indexer_kind` is "full", "shared" or "none".

    Returns (output, selection, indexer_kl, cache); indexer_kl is None unless this is a full layer and
    ``cfg.indexer_loss`` asks for the warm-up or sparse-stage KL (spec §7.1).

    With a decode ``cache`` ({"latent": [B, S, C], "index_key": [B, S, d_I] on full layers}, see
    `glm5_jax.kv_cache`) the new tokens' rows are written at slots = their positions, and the queries
    attend over the whole cache instead of over themselves: slot s is visible from position p iff s <= p
    (every such slot has been written by then). The updated cache is returned; without one, None.
    """
    cfg: object
    indexer_kind: str

    @nn.compact
    def __call__(self, a_BTD, positions_BT, segment_ids_BT, prev_selection, cache=None):
        cfg = self.cfg
        init, pdt, dt = normal_init(cfg), cfg.jnp_param_dtype, cfg.jnp_dtype
        H, dn, dr, dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        d = cfg.hidden_size
        w_qa = logical_param(self, "q_a_proj", (d, cfg.q_lora_rank), ("embed", "q_lora"), init, pdt)
        w_qb = logical_param(self, "q_b_proj", (cfg.q_lora_rank, H, dn + dr), ("q_lora", "heads", "kv"), init, pdt)
        w_kva = logical_param(self, "kv_a_proj", (d, R + dr), ("embed", "kv_lora"), init, pdt)
        w_kvb = logical_param(self, "kv_b_proj", (R, H, dn + dv), ("kv_lora", "heads", "kv"), init, pdt)
        w_o = logical_param(self, "o_proj", (H, dv, d), ("heads", "kv", "embed"), init, pdt)

        qr = RMSNorm(cfg.latent_norm_eps, "q_lora", pdt, name="q_a_norm")(
            einsum("btd,dq->btq", a_BTD, w_qa, dt))
        q = constrain(einsum("btq,qhk->bthk", qr, w_qb, dt), ("batch", "seq", "act_heads", None))
        q_nope = q[..., :dn]
        q_rot = _rope(cfg, q[..., dn:], positions_BT, interleaved=cfg.rope_interleave, head_axis=True)
        ckv = einsum("btd,dc->btc", a_BTD, w_kva, dt)
        c = RMSNorm(cfg.latent_norm_eps, "kv_lora", pdt, name="kv_a_norm")(ckv[..., :R])  # k_rot is not normed
        k_rot = _rope(cfg, ckv[..., R:], positions_BT, interleaved=cfg.rope_interleave, head_axis=False)
        latent_BSC = jnp.concatenate([c, k_rot], axis=-1)          # what a decode cache keeps (§4.1)
        kv_positions_BS, kv_segments_BS = positions_BT, segment_ids_BT
        if cache is not None:
            cache = dict(cache, latent=write_rows(cache["latent"], latent_BSC, positions_BT))
            latent_BSC = cache["latent"]
            kv_positions_BS, kv_segments_BS = cache_slots(latent_BSC)

        w_uk, w_uv = w_kvb[..., :dn], w_kvb[..., dn:]                # [R, H, dn], [R, H, dv]
        q_abs = jnp.concatenate([einsum("bthn,rhn->bthr", q_nope, w_uk, dt), q_rot.astype(dt)], axis=-1)
        selection, indexer_kl_fn, cache = self._select(a_BTD, qr, positions_BT, segment_ids_BT, prev_selection,
                                                       q_abs, latent_BSC, cache)
        sparse = cfg.attention_mode == "sparse" and self.indexer_kind != "none"
        indexer_target = None
        visible = visible_mask(positions_BT, kv_positions_BS, segment_ids_BT, kv_segments_BS)

        if cfg.mla_form == "absorbed" or cache is not None:
            S, k = latent_BSC.shape[1], selection[0].shape[-1]
            impl = self._sparse_impl(cache is not None) if sparse else None
            training_xla = sparse and impl == "xla" and cache is None
            if sparse and cache is not None and S <= DENSE_DECODE_FACTOR * k:
                # a short cache: the selected set as a mask over all slots beats gathering rows (XLA)
                o_lat, _ = mla_reference.dense_mla(q_abs, latent_BSC.astype(dt), visible & selection_mask(*selection, S),
                                                   scale=cfg.softmax_scale, v_dim=R, q_chunk=cfg.attention_q_chunk)
            elif training_xla:   # the KL target comes from these attention probabilities (same detached values)
                o, indexer_target = self._training_sparse_xla(q_nope, q_rot, q_abs, latent_BSC, w_kvb,
                                                              selection, with_target=indexer_kl_fn is not None
                                                              and cfg.indexer_loss == "sparse")
            elif sparse:   # decoding (gather on XLA) or a Pallas impl (its KL target comes separately)
                o_lat = self._sparse_core(q_abs, latent_BSC.astype(dt), *selection, impl=impl)
            else:
                o_lat, _ = mla_reference.dense_mla(q_abs, latent_BSC.astype(dt), visible, scale=cfg.softmax_scale,
                                                   v_dim=R, q_chunk=cfg.attention_q_chunk)
            if not training_xla:   # (that path projects its own outputs)
                o = einsum("bthr,rhv->bthv", checkpoint_name(o_lat, ATTENTION_CORE_NAMES[0]), w_uv, dt)
            if indexer_target is not None:
                indexer_target = checkpoint_name(indexer_target, ATTENTION_CORE_NAMES[1])
        else:
            allowed = visible & selection_mask(*selection, visible.shape[-1]) if sparse else visible
            o = self._mha(q_nope, q_rot, c, k_rot, w_kvb, allowed)
        o = constrain(o, ("batch", "seq", "act_heads", None))
        indexer_kl = indexer_kl_fn(indexer_target) if indexer_kl_fn is not None else None
        return einsum("bthv,hvd->btd", o, w_o, dt), selection, indexer_kl, cache

    def _select(self, a_BTD, qr, positions_BT, segment_ids_BT, prev_selection, q_abs, latent_BSC, cache):
        """(selection, indexer KL or None, cache): this layer's top-k (full), the previous full layer's
        (shared), or pass-through (none / dense attention). The KL comes as a function of an optional
        precomputed sparse-stage target (see indexer_kl reference), called once attention has run."""
        cfg = self.cfg
        if self.indexer_kind != "full":
            return prev_selection, None, cache
        # The indexer is trained only by its KL loss: its inputs are detached (spec §7.1, P13); top-k
        # indices carry no gradient, so the LM loss never reaches the indexer.
        q_i, k_i, w_i = Indexer(cfg, name="indexer")(jax.lax.stop_gradient(a_BTD), jax.lax.stop_gradient(qr),
                                                     positions_BT)
        if cache is not None:
            cache = dict(cache, index_key=write_rows(cache["index_key"], k_i, positions_BT))
            k_i = cache["index_key"].astype(jnp.float32)
            kv_positions_BS, kv_segments_BS = cache_slots(k_i)
            selection = prev_selection
            if cfg.attention_mode == "sparse":
                selection = indexer_ops.indexer_topk(q_i, k_i, w_i, positions_BT, kv_positions_BS, segment_ids_BT,
                                                     kv_segments_BS, topk=cfg.index_topk, impl="xla")
            return selection, None, cache
        selection = prev_selection
        if cfg.attention_mode == "sparse":
            selection = tuple(checkpoint_name(x, SELECTION_NAME)
                              for x in self._indexer_topk(q_i, k_i, w_i, positions_BT, segment_ids_BT))
        if cfg.indexer_loss == "none":
            return selection, None, cache
        idx, valid = selection if cfg.indexer_loss == "sparse" else (None, None)

        def kl(target_BTK=None):
            return indexer_kl_ops.indexer_kl_loss(
                jax.lax.stop_gradient(q_abs), jax.lax.stop_gradient(latent_BSC.astype(q_abs.dtype)), q_i, k_i, w_i,
                positions_BT, positions_BT, segment_ids_BT, segment_ids_BT, scale=cfg.softmax_scale,
                stage=cfg.indexer_loss, idx_BTK=idx, valid_BTK=valid, target_BTK=target_BTK)
        return selection, kl, cache

    def _indexer_topk(self, q_i, k_i, w_i, positions_BT, segment_ids_BT):
        """Top-k selection; a Pallas impl runs per batch shard (scores sum over indexer heads)."""
        cfg = self.cfg

        def topk(q, k, w, pos, seg):
            return indexer_ops.indexer_topk(q, k, w, pos, pos, seg, seg, topk=cfg.index_topk, impl=cfg.attention_impl)

        if cfg.attention_impl == "xla":
            return topk(q_i, k_i, w_i, positions_BT, segment_ids_BT)
        bt = ("batch", None)
        return logical_shard_map(topk, in_axes=(("batch", None, None, None), ("batch", None, None), ("batch", None, None),
                                                bt, bt),
                                 out_axes=(("batch", None, None), ("batch", None, None)))(
            q_i, k_i, w_i, positions_BT, segment_ids_BT)

    def _sparse_impl(self, decoding):
        """sparse_mla impl: "xla" when decoding whatever the training impl, else cfg.attention_impl (on
        "xla", training splits queries between the masked-dense and gather forms, _training_sparse_xla)."""
        return "xla" if decoding else self.cfg.attention_impl

    def _dense_queries(self, T, k):
        """How many leading training queries attend through the selection mask (cfg.sparse_xla_form)."""
        form = self.cfg.sparse_xla_form
        if form == "auto":
            return masked_dense.dense_prefix(T, k, masked_dense.Q_CHUNK, masked_dense.DENSE_BLOCK_FACTOR)
        return T if form == "masked_dense" else 0

    def _training_sparse_xla(self, q_nope, q_rot, q_abs, latent_BSC, w_kvb, selection, with_target):
        """Training-row sparse attention on XLA -> (o [B,T,H,d_v], indexer KL target or None): the first
        queries through the selection mask in per-head form (masked_dense.sparse_mha: their causal blocks
        score few keys), the rest over their k gathered latent rows (absorbed, spec §4.5; gather_saved keeps
        the probabilities for its backward instead of rerunning the forward)."""
        cfg, dt, R = self.cfg, self.cfg.jnp_dtype, self.cfg.kv_lora_rank
        T = q_nope.shape[1]
        idx, valid = selection
        n = self._dense_queries(T, idx.shape[-1])
        outs, targets = [], []
        if n:       # queries < n select keys < n only (top-k picks visible keys), so keys [0, n) suffice
            o, target = self._masked_dense(q_nope[:, :n], q_rot[:, :n], latent_BSC[:, :n], w_kvb,
                                           (idx[:, :n], valid[:, :n]), with_target)
            outs.append(o)
            targets.append(target)
        if n < T:
            # the hand-written VJP reuses the forward's probabilities while they fit its budget
            B, H = q_abs.shape[0], q_abs.shape[2]
            gather = gather_saved if gather_saved.fits(B, T - n, idx.shape[-1], H) else mla_reference
            rows = gather.sparse_mla(q_abs[:, n:], latent_BSC.astype(dt), idx[:, n:], valid[:, n:],
                                     scale=cfg.softmax_scale, v_dim=R, with_target=with_target)
            w_uv = w_kvb[..., cfg.qk_nope_head_dim:]
            outs.append(einsum("bthr,rhv->bthv", checkpoint_name(rows[0], ATTENTION_CORE_NAMES[0]), w_uv, dt))
            targets.append(rows[2] if with_target else None)
        target = jnp.concatenate(targets, axis=1) if with_target else None
        return jnp.concatenate(outs, axis=1), target

    def _masked_dense(self, q_nope, q_rot, latent_BSC, w_kvb, selection, with_target):
        """Training-row sparse attention as per-head products over the selection mask (XLA): the naive
        form's keys [c W_uk; k_rot] and values c W_uv (§4.1), which score a key with fewer FLOPs than the
        absorbed latent (masked_dense.sparse_mha) -> (o [B,T,H,d_v], indexer KL target or None)."""
        cfg, dt, dn = self.cfg, self.cfg.jnp_dtype, self.cfg.qk_nope_head_dim
        k = einsum("bsc,chk->bshk", latent_BSC, _per_head_key_weight(w_kvb[..., :dn], latent_BSC.shape[-1]), dt)
        v = einsum("bsr,rhv->bshv", latent_BSC[..., :cfg.kv_lora_rank], w_kvb[..., dn:], dt)
        q = jnp.concatenate([q_nope.astype(dt), q_rot.astype(dt)], axis=-1)
        results = masked_dense.sparse_mha(q, k, v, *selection, scale=cfg.softmax_scale,
                                          q_chunk=masked_dense.Q_CHUNK, with_target=with_target)
        return results[0], results[2] if with_target else None

    def _sparse_core(self, q_abs, latent_BSC, idx, valid, impl):
        """Absorbed sparse attention -> o_lat [B,T,H,R]; a Pallas impl runs per (batch, head) shard."""
        cfg = self.cfg

        def core(q, kv, i, v):
            return sparse_mla_ops.sparse_mla(q, kv, i, v, scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank,
                                             impl=impl)[0]

        if impl == "xla":
            return core(q_abs, latent_BSC, idx, valid)
        heads = ("batch", None, "act_heads", None)
        return logical_shard_map(core, in_axes=(heads, ("batch", None, None), ("batch", None, None),
                                                ("batch", None, None)), out_axes=heads)(q_abs, latent_BSC, idx, valid)

    def _mha(self, q_nope, q_rot, c_BSR, k_rot_BSr, w_kvb, allowed_BTS):
        """Naive form (§4.1): per-head keys [k_nope; k_rot], values v, masked softmax in fp32."""
        cfg, dt, dn = self.cfg, self.cfg.jnp_dtype, self.cfg.qk_nope_head_dim
        kv = einsum("bsr,rhk->bshk", c_BSR, w_kvb, dt)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        logits = (jnp.einsum("bthn,bshn->bhts", q_nope.astype(dt), k_nope, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthr,bsr->bhts", q_rot.astype(dt), k_rot_BSr.astype(dt),
                               preferred_element_type=jnp.float32)) * cfg.softmax_scale
        logits = jnp.where(allowed_BTS[:, None], logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        probs = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jnp.einsum("bhts,bshv->bthv", probs.astype(dt), v, preferred_element_type=jnp.float32).astype(dt)


def _per_head_key_weight(w_uk_RHN, latent_width):
    """W [C, H, d_nope + d_rot] with latent @ W = the per-head keys [c W_uk; k_rot] (§4.1): W_uk over the
    c columns and an identity passing k_rot through, so one product builds the keys without a per-head
    copy of k_rot concatenated on (k_rot is shared by the heads)."""
    R, H, dn = w_uk_RHN.shape
    dr = latent_width - R
    rot = jnp.broadcast_to(jnp.eye(dr, dtype=w_uk_RHN.dtype)[:, None, :], (dr, H, dr))
    return jnp.concatenate([jnp.concatenate([w_uk_RHN, jnp.zeros((R, H, dr), w_uk_RHN.dtype)], -1),
                            jnp.concatenate([jnp.zeros((dr, H, dn), w_uk_RHN.dtype), rot], -1)], 0)


def write_rows(cache_BSX, rows_BTX, positions_BT):
    """Write each row's T new entries at slots positions[b, 0] .. positions[b, 0] + T - 1 (contiguous)."""
    def one(c, r, start):
        return jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), start, axis=0)
    return jax.vmap(one)(cache_BSX, rows_BTX, positions_BT[:, 0])


def cache_slots(cache_BSX):
    """(positions, segment ids) of a decode cache's slots: slot s holds position s, all in segment 1."""
    B, S = cache_BSX.shape[:2]
    return (jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)), jnp.ones((B, S), jnp.int32))
