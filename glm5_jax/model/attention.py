"""MLA attention with DeepSeek Sparse Attention (DeepSeek-V3.2 report, section 2; GLM-5 report).

`Indexer` is the DSA lightning indexer; `MLAttention` is one layer's attention, read top to bottom:

    project   queries (q_nope, q_rot) and the compressed latent row [c; k_rot] of every token
    select    the indexer's top-k keys per query (full layers), the previous full layer's (shared), none
    attend    the attention core over the selected keys (`pallas_kernels.sparse_mla.ops`, by
              ``cfg.attention_impl``), or over every visible key in the dense stage
    project   out through W_UV and o_proj

The core runs in the absorbed form: W_UK is folded into the query and W_UV applied after attention, so
every head attends to the one shared latent row [c; k_rot] (576 wide for GLM-5). ``cfg.mla_form="mha"``
is the naive form instead (keys/values expanded per head, the selection as a mask over all keys): the
same function, kept as a readable cross-check.

When the mesh splits the sequence (context parallelism), select + attend + indexer KL run per sequence
shard over the gathered latent rows and indexer keys instead (glm5_jax/model/context_attention.py).

On TPU (Pallas impls) the dense and warm-up stages attend with the flash kernel in the MHA form
(glm5_jax/model/mha_form.py), and so does the sparse stage while a sequence is short next to the top-k
(`masked_flash_core`): at 4K keys and k = 2048 the selection holds half or more of every query's visible
keys, so attending densely over it as a [T, S] mask costs fewer FLOPs than the absorbed form's per-slot
products (1024 against 2176 per pair and head forward for GLM-5, over ~S/2 causal keys against k slots)
and reads contiguous blocks instead of gathering rows. The selection then carries that mask as a third
member, (idx, valid, allowed), and the sparse-stage indexer KL runs the warm-up KL kernels over the
allowed keys (the same distributions, renormalised over the selected set). GLM-5.3-Flash's pooled indexer
makes its mask from the selected pools' scores the same way (glm5_jax/model/pooled_indexer.py).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model import context_attention, mha_form, pooled_indexer, routing_replay
from glm5_jax.model.config import ModelConfig
from glm5_jax.model import decode_context, decode_rows
from glm5_jax.model.kv_cache import cache_slots, write_rows
from glm5_jax.model.layers import LayerNorm, RMSNorm, constrain, einsum, logical_param, normal_init
from glm5_jax.model.rope import apply_pair_swap_rope, apply_rope, pair_swap_tables, rope_cos_sin
from glm5_jax.model.stacked_weights import KV_B_UK, KV_B_UV, STACKED_WEIGHTS
from glm5_jax.parallel import context as context_parallel
from glm5_jax.parallel.axes import (ACT_HEADS, BATCH, CACHE_SEQ, EMBED, HEADS, INDEX_DIM, INDEX_HEADS, KV, KV_LORA, O_KV,
                                    Q_LORA, SEQ)
from glm5_jax.parallel.shard_map import logical_axis_shards, logical_pmean, logical_shard_map
from pallas_kernels.flash_attention import ops as flash_ops
from pallas_kernels.impls import PALLAS_IMPLS
from pallas_kernels.indexer_kl import ops as indexer_kl_ops, sparse_pallas as indexer_kl_sparse
from pallas_kernels.lightning_indexer import ops as indexer_ops
from pallas_kernels.masking import selection_mask, visible_mask
from pallas_kernels.row_gather import ops as row_gather_ops
from pallas_kernels.sparse_mla import ops as sparse_mla_ops
from pallas_kernels.sparse_mla_decode import kernel as sparse_mla_decode_kernel, ops as sparse_mla_decode_ops

SELECTION_NAME = context_attention.SELECTION_NAME   # the top-k selection, for remat policies
# the attention core's output and indexer KL target, and the residuals its impls name: a remat policy
# keeping these never reruns the attention core in the backward pass
ATTENTION_SAVED_NAMES = (("attention_core_out", context_attention.KL_TARGET_NAME) + sparse_mla_ops.SAVED_NAMES
                         + flash_ops.SAVED_NAMES + indexer_kl_sparse.SAVED_NAMES)
# the query's low-rank latent before its norm ([B, T, q_lora_rank]), for remat policies: kept with the MHA query
# (mha_form.QUERY_NAME), the backward reruns no query projection
Q_LATENT_NAME = "attention_q_latent"
# the warm-up KL kernel's gradients for the indexer (computed with its loss in one forward kernel)
INDEXER_KL_GRAD_NAMES = indexer_kl_ops.SAVED_NAMES


def masked_flash_core(cfg: ModelConfig, num_keys: int, decoding: bool) -> bool:
    """Whether the sparse stage's attention core is the flash kernel over the selection as a mask (and the
    selection carries that mask): Pallas impls, training, the absorbed form, a DSA model, and at most
    ``masked_flash_factor`` x index_topk keys."""
    rt = cfg.runtime
    return (rt.attention_impl in PALLAS_IMPLS and rt.mla_form == "absorbed" and not decoding
            and rt.attention_mode == "sparse" and cfg.use_indexer
            and num_keys <= rt.masked_flash_factor * cfg.index_topk)


def _rope_args(cfg: ModelConfig):
    return cfg.rope_theta, cfg.rope_scaling_dict, cfg.max_position_embeddings


def rope_tables(cfg: ModelConfig, positions_BT) -> dict:
    """{(rotated dim, width): (cos, sin)}: the `pair_swap_tables` of every pair-swap rotation an MLA layer makes (its
    query and key rope channels; its indexer's heads and key, rope slice first), which depend on the positions
    alone; {} when no rotation is pair-swap. Decoding with ``decode_rope_tables`` computes them once per step
    before the layer scan and hands them to every layer (`_rope`'s ``tables``)."""
    if cfg.runtime.rope_impl != "pair_swap":
        return {}
    dr = cfg.qk_rope_head_dim
    shapes = {(dr, dr)} if cfg.rope_interleave and dr else set()
    if cfg.use_indexer and cfg.indexer_rope_interleave and dr:
        shapes.add((dr, cfg.index_head_dim))
    return {s: pair_swap_tables(positions_BT, *s, *_rope_args(cfg)) for s in sorted(shapes)}


def _rope(cfg: ModelConfig, x, positions_BT, *, interleaved, head_axis: bool, dim=None, tables=None):
    """The first ``dim`` channels of x rotated (default all), the rest as they are; ``tables``: `rope_tables`
    computed ahead (else made here)."""
    dim = x.shape[-1] if dim is None else dim
    if dim == 0:    # NoPE (GLM-5.3-Flash: qk_rope_head_dim = 0)
        return x
    rope_args = _rope_args(cfg)
    if interleaved and cfg.runtime.rope_impl == "pair_swap":      # full width, the rest passed through
        shape = (dim, x.shape[-1])
        cos, sin = tables[shape] if tables and shape in tables else pair_swap_tables(positions_BT, *shape, *rope_args)
        rotate = apply_pair_swap_rope
    elif dim < x.shape[-1]:
        return jnp.concatenate([_rope(cfg, x[..., :dim], positions_BT, interleaved=interleaved,
                                      head_axis=head_axis), x[..., dim:]], -1)
    else:
        cos, sin = rope_cos_sin(positions_BT, dim, *rope_args)
        rotate = functools.partial(apply_rope, interleaved=interleaved)
    if head_axis:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return rotate(x, cos, sin)


class AttentionOutput(NamedTuple):
    out: jax.Array              # [B, T, D] the layer's output projection
    selection: tuple            # (idx [B, T, k], valid [B, T, k][, allowed [B, T, S]]): this layer's top-k,
                                # or the one it reused (allowed: the mask of `masked_flash_core`)
    indexer_kl: jax.Array | None   # the indexer KL term when the stage trains the indexer, else None
    cache: Any                  # the updated decode cache (None when not decoding)


class Indexer(nn.Module):
    """Lightning-indexer projections: (q [B,T,H_I,d_I], k [B,T,d_I], w [B,T,H_I]) in fp32; the pooled indexer
    (``cfg.index_kpool``, glm5_jax/model/pooled_indexer.py) also returns the pool gate scores [B,T,d_I] and
    the per-slot offsets [P, d_I].

    Background: docs/architecture.md#lightning-indexer.
    """
    cfg: ModelConfig

    @nn.compact
    def __call__(self, a_BTD, qr_BTQ, positions_BT, rope=None):
        """``rope``: the step's `rope_tables` (decoding), else made here."""
        cfg = self.cfg
        init, pdt = normal_init(cfg), cfg.jnp_param_dtype
        h_i, d_i, d_r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        wq_b = logical_param(self, "wq_b", (cfg.q_lora_rank, h_i, d_i), (Q_LORA, INDEX_HEADS, INDEX_DIM),
                             init, pdt)
        wk = logical_param(self, "wk", (cfg.hidden_size, d_i), (EMBED, INDEX_DIM), init, pdt)
        weights_proj = logical_param(self, "weights_proj", (cfg.hidden_size, h_i), (EMBED, INDEX_HEADS),
                                     init, pdt)
        f32 = jnp.float32
        q = einsum("btq,qhd->bthd", qr_BTQ, wq_b, cfg.jnp_dtype, f32, impl=cfg.runtime.projection_impl,
                   grad_dtype=cfg.runtime.grad_reduce_dtype)
        k = einsum("btd,de->bte", a_BTD, wk, cfg.jnp_dtype, f32, impl=cfg.runtime.projection_impl,
                   grad_dtype=cfg.runtime.grad_reduce_dtype)
        k = LayerNorm(cfg.indexer_norm_eps, INDEX_DIM, pdt, cfg.runtime.decode_spread_norms, name="k_norm")(k)
        # The rope slice comes FIRST in indexer heads and keys (docs/architecture.md#indexer-rope-rope-slice-first).
        rot = dict(interleaved=cfg.indexer_rope_interleave, tables=rope)
        q = _rope(cfg, q, positions_BT, head_axis=True, dim=d_r, **rot)
        k = _rope(cfg, k, positions_BT, head_axis=False, dim=d_r, **rot)
        # weights_proj runs in fp32 like HF; both positive scales folded into w (ReLU(cx) = cReLU(x)).
        w = jnp.einsum("btd,dh->bth", a_BTD.astype(f32), weights_proj.astype(f32),
                       precision=jax.lax.Precision.HIGHEST) * (h_i ** -0.5 * d_i ** -0.5)
        if cfg.index_kpool is None:
            return q, k, w
        gate_w = logical_param(self, "kpool_gate", (cfg.hidden_size, d_i), (EMBED, INDEX_DIM), nn.initializers.ones,
                               pdt)
        ape = logical_param(self, "kpool_ape", (cfg.index_kpool, d_i), (None, INDEX_DIM), nn.initializers.zeros, pdt)
        gate = einsum("btd,de->bte", a_BTD, gate_w, cfg.jnp_dtype, f32, impl=cfg.runtime.projection_impl,
                      grad_dtype=cfg.runtime.grad_reduce_dtype)
        return q, k, w, gate, ape


class MLAttention(nn.Module):
    """One layer's MLA attention + DSA. `indexer_kind` is "full", "shared" or "none".

    Returns (output, selection, indexer_kl, cache); indexer_kl is None unless this is a full layer and
    ``cfg.indexer_loss`` asks for the warm-up or sparse-stage KL.

    With a decode ``cache`` ({"latent": [B, S, C], "index_key": [B, S, d_I] on full layers}, see
    `glm5_jax.model.kv_cache`) the new tokens' rows are written at slots = their positions, and the queries
    attend over the whole cache instead of over themselves: slot s is visible from position p iff s <= p
    (every such slot has been written by then). The updated cache is returned; without one, None.
    """
    cfg: ModelConfig
    indexer_kind: str

    @nn.compact
    def __call__(self, a_BTD, positions_BT, segment_ids_BT, prev_selection, cache=None, layer_index=None,
                 replay_BTk=None, rope=None):
        """``replay_BTk``: a full layer's recorded top-k to attend by (glm5_jax/model/routing_replay.py); ``rope``:
        the step's `rope_tables` (decoding with ``decode_rope_tables``), else made here."""
        cfg = self.cfg
        init, pdt, dt, proj = normal_init(cfg), cfg.jnp_param_dtype, cfg.jnp_dtype, cfg.runtime.projection_impl
        gdt = cfg.runtime.grad_reduce_dtype
        H, dn, dr, dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        d = cfg.hidden_size
        w_qa = logical_param(self, "q_a_proj", (d, cfg.q_lora_rank), (EMBED, Q_LORA), init, pdt)
        w_qb = logical_param(self, "q_b_proj", (cfg.q_lora_rank, H, dn + dr), (Q_LORA, HEADS, KV), init, pdt)
        w_kva = logical_param(self, "kv_a_proj", (d, R + dr), (EMBED, KV_LORA), init, pdt)
        if layer_index is not None and cfg.runtime.decode_stacked_kv_b and cfg.runtime.decode_kv_b_heads_major:
            w_kvb = None                # heads-major halves [H, R, dn], [H, dv, R], each read in place at the index
            w_uk, w_uv = (jax.lax.dynamic_index_in_dim(self.get_variable(STACKED_WEIGHTS, name), layer_index,
                                                       keepdims=False, allow_negative_indices=False)
                          for name in (KV_B_UK, KV_B_UV))
        elif layer_index is not None and cfg.runtime.decode_stacked_kv_b:     # glm5_jax/model/stacked_weights.py
            stacked, w_kvb = self.get_variable(STACKED_WEIGHTS, "kv_b_proj"), None      # decode rows only
            w_uk, w_uv = (jax.lax.dynamic_slice(stacked, (layer_index, 0, 0, start), (1, R, H, n),
                                                allow_negative_indices=False)[0]     # each half read in place
                          for start, n in ((0, dn), (dn, dv)))
        else:
            w_kvb = logical_param(self, "kv_b_proj", (R, H, dn + dv), (KV_LORA, HEADS, KV), init, pdt)
            w_uk, w_uv = w_kvb[..., :dn], w_kvb[..., dn:]            # [R, H, dn], [R, H, dv]
        w_o = logical_param(self, "o_proj", (H, dv, d), (HEADS, O_KV, EMBED), init, pdt)

        # ---- project: queries and the latent row [c; k_rot] (what a decode cache keeps)
        spread = cfg.runtime.decode_spread_norms
        qr = RMSNorm(cfg.latent_norm_eps, Q_LORA, pdt, spread, name="q_a_norm")(
            checkpoint_name(einsum("btd,dq->btq", a_BTD, w_qa, dt, impl=proj, grad_dtype=gdt), Q_LATENT_NAME))
        q = constrain(einsum("btq,qhk->bthk", qr, w_qb, dt, impl=proj, grad_dtype=gdt),
                      (BATCH, SEQ, ACT_HEADS, None))
        q_nope = q[..., :dn]
        q_rot = _rope(cfg, q[..., dn:], positions_BT, interleaved=cfg.rope_interleave, head_axis=True, tables=rope)
        ckv = einsum("btd,dc->btc", a_BTD, w_kva, dt, impl=proj, grad_dtype=gdt)
        c = RMSNorm(cfg.latent_norm_eps, KV_LORA, pdt, spread, name="kv_a_norm")(ckv[..., :R])  # k_rot is not normed
        k_rot = _rope(cfg, ckv[..., R:], positions_BT, interleaved=cfg.rope_interleave, head_axis=False,
                      tables=rope)
        latent_BSC = jnp.concatenate([c, k_rot], axis=-1)
        if cache is not None and cfg.runtime.decode_cache_write == "rows":     # glm5_jax/model/decode_rows.py
            return self._decode_rows(a_BTD, qr, q_nope, q_rot, positions_BT, prev_selection, latent_BSC, cache,
                                     (w_uk, w_uv, w_o), layer_index, rope)
        kv_positions_BS, kv_segments_BS = positions_BT, segment_ids_BT
        if cache is not None:
            cache = dict(cache, latent=write_rows(cache["latent"], latent_BSC, positions_BT))
            latent_BSC = cache["latent"]
            kv_positions_BS, kv_segments_BS = cache_slots(latent_BSC)
        latent_BSC = latent_BSC.astype(dt)
        sparse = cfg.runtime.attention_mode == "sparse" and self.indexer_kind != "none"
        masked = sparse and masked_flash_core(cfg, latent_BSC.shape[1], decoding=cache is not None)
        # dense attention on TPU, and short sparse sequences: the flash kernel in the MHA form
        flash = (cfg.runtime.attention_impl in PALLAS_IMPLS and cfg.runtime.mla_form == "absorbed"
                 and cache is None and (masked or not sparse))
        q_abs = None if flash else jnp.concatenate([einsum("bthn,rhn->bthr", q_nope, w_uk, dt, grad_dtype=gdt),
                                                    q_rot.astype(dt)], axis=-1)

        n_shards = context_parallel.layout_shards(a_BTD.shape[1]) if cfg.runtime.mla_form == "absorbed" else 1
        if cache is None and n_shards > 1:     # the sequence is split over shards (context parallelism)
            if replay_BTk is not None:
                raise NotImplementedError("routing replay of the indexer's top-k does not run context-parallel")
            if cfg.index_kpool is not None:
                raise NotImplementedError("the pooled indexer (index_kpool) does not run context-parallel yet")
            mha = (mha_form.mha_query(q_nope, q_rot, dt), w_kvb) if flash else None
            o, selection, indexer_kl = self._context_parallel(a_BTD, qr, positions_BT, segment_ids_BT,
                                                              prev_selection, q_abs, latent_BSC, n_shards, mha,
                                                              masked)
            o = checkpoint_name(o, ATTENTION_SAVED_NAMES[0])
            if not flash:
                o = einsum("bthr,rhv->bthv", o, w_uv, dt, grad_dtype=gdt)
            o = constrain(o, (BATCH, SEQ, ACT_HEADS, None))
            return AttentionOutput(einsum("bthv,hvd->btd", o, w_o, dt, impl=proj, grad_dtype=gdt), selection,
                                   indexer_kl, cache)

        # ---- select
        selection, indexer_kl_fn, cache = self._select(a_BTD, qr, positions_BT, segment_ids_BT, prev_selection,
                                                       q_abs, latent_BSC, cache, masked, replay_BTk)
        visible = None if flash else visible_mask(positions_BT, kv_positions_BS, segment_ids_BT, kv_segments_BS)

        # ---- attend (named scopes: the compile report files the HLO by them)
        target, kl_args = None, {}
        if flash:
            q_m = mha_form.mha_query(q_nope, q_rot, dt)
            k_m, v_m = mha_form.mha_keys_values(cfg, latent_BSC[..., :R], latent_BSC[..., R:], w_kvb)
        with jax.named_scope("attention_core"):
            if flash:
                o, lse = self._flash_core(q_m, k_m, v_m, positions_BT, segment_ids_BT,
                                          selection[2] if masked else None)
                kl_args = dict(mha=(q_m, k_m, lse))
            elif cfg.runtime.mla_form == "mha" and cache is None:
                allowed = visible & selection_mask(*selection[:2], visible.shape[-1]) if sparse else visible
                o = naive_attention(cfg, q_nope, q_rot, c, k_rot, w_kvb, allowed)
            else:
                with_target = indexer_kl_fn is not None and cfg.runtime.indexer_loss == "sparse"
                if sparse:
                    o_lat, target = self._sparse_core(q_abs, latent_BSC, *selection[:2], decoding=cache is not None,
                                                      with_target=with_target)
                else:
                    o_lat, _ = sparse_mla_ops.dense_mla(q_abs, latent_BSC, visible, scale=cfg.softmax_scale,
                                                        v_dim=R, q_chunk=cfg.runtime.attention_q_chunk)
        if not flash and (cfg.runtime.mla_form != "mha" or cache is not None):
            o = einsum("bthr,rhv->bthv", checkpoint_name(o_lat, ATTENTION_SAVED_NAMES[0]), w_uv, dt,
                       grad_dtype=gdt)
        if target is not None:
            target = checkpoint_name(target, ATTENTION_SAVED_NAMES[1])
        with jax.named_scope("indexer_kl"):
            indexer_kl = indexer_kl_fn(target, **kl_args) if indexer_kl_fn is not None else None

        # ---- project out
        o = constrain(o, (BATCH, SEQ, ACT_HEADS, None))
        return AttentionOutput(einsum("bthv,hvd->btd", o, w_o, dt, impl=proj, grad_dtype=gdt), selection, indexer_kl,
                               cache)

    def _decode_rows(self, a_BTD, qr, q_nope, q_rot, positions_BT, prev_selection, new_latent_BTC, cache, weights,
                     layer_index=None, rope=None):
        """Decode against the cache as it was before this step (glm5_jax/model/decode_rows.py) -> AttentionOutput
        whose cache is only this step's new rows ({"latent": [B, T, C][, "index_key": [B, T, d_I]]}). With
        ``layer_index`` (``decode_cache_read`` other than "slice") ``cache`` is the segment's stacked [layers, B,
        S, X] cache: the indexer keys of the layer are read at its index, the selected latent rows gathered
        from the stacked cache in place (`_gather_cached_rows`)."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        w_uk, w_uv, w_o = weights
        if cfg.runtime.attention_mode != "sparse" or self.indexer_kind == "none":
            raise ValueError("decode_cache_write='rows' decodes DSA layers (sparse stage, an indexer)")
        new = {"latent": new_latent_BTC.astype(cache["latent"].dtype)}
        selection = prev_selection
        # slots split over `context`, the stacked cache read in place: each shard works on its own slots
        # (glm5_jax/model/decode_context.py), no per-layer all-gather of the cache
        slot_split = layer_index is not None and logical_axis_shards(CACHE_SEQ) > 1
        if self.indexer_kind == "full":
            q_i, k_i, w_i = Indexer(cfg, name="indexer")(a_BTD, qr, positions_BT, rope)
            new["index_key"] = k_i.astype(cache["index_key"].dtype)
            with jax.named_scope("lightning_indexer"):
                if slot_split:
                    selection = decode_context.topk(q_i, cache["index_key"], layer_index, new["index_key"], w_i,
                                                    positions_BT, cfg.index_topk)
                else:
                    keys = cache["index_key"] if layer_index is None else \
                        jax.lax.dynamic_index_in_dim(cache["index_key"], layer_index, axis=0, keepdims=False,
                                                     allow_negative_indices=False)      # a scan index: no wrap ops
                    selection = decode_rows.topk_with_new_rows(q_i, keys, new["index_key"], w_i, positions_BT,
                                                               cfg.index_topk)
        heads_major = layer_index is not None and cfg.runtime.decode_stacked_kv_b and cfg.runtime.decode_kv_b_heads_major
        uk_spec, uv_spec = ("bthn,hrn->bthr", "bthr,hvr->bthv") if heads_major else ("bthn,rhn->bthr", "bthr,rhv->bthv")
        q_abs = jnp.concatenate([einsum(uk_spec, q_nope, w_uk, dt), q_rot.astype(dt)], axis=-1)
        with jax.named_scope("attention_core"):
            if slot_split:
                o_lat = decode_context.attend(q_abs, cache["latent"], layer_index, new["latent"], *selection[:2],
                                              positions_BT, scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank,
                                              gather_impl=cfg.runtime.decode_cache_read)
            elif self._fused_decode_attention(cache["latent"], layer_index, positions_BT):
                o_lat = self._sparse_mla_decode(cache["latent"], layer_index, *selection[:2], q_abs, new["latent"],
                                                positions_BT)
            else:
                cached = decode_rows.take_rows(cache["latent"], selection[0]) if layer_index is None else \
                    self._gather_cached_rows(cache["latent"], layer_index, selection[0])
                o_lat = decode_rows.attend_with_new_rows(q_abs, cached, new["latent"], *selection[:2], positions_BT,
                                                         scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank)
        o = constrain(einsum(uv_spec, o_lat, w_uv, dt), (BATCH, SEQ, ACT_HEADS, None))
        return AttentionOutput(einsum("bthv,hvd->btd", o, w_o, dt, impl=cfg.runtime.projection_impl), selection,
                               None, new)

    def _fused_decode_attention(self, latent_LBSC, layer_index, positions_BT) -> bool:
        """Whether the attention core runs as pallas_kernels/sparse_mla_decode (``decode_attention``): the stacked
        cache read in place, one token per batch row, each batch row's layer slice within VMEM, slots whole."""
        cfg = self.cfg
        return (cfg.runtime.decode_attention in PALLAS_IMPLS and layer_index is not None
                and positions_BT.shape[1] == 1 and logical_axis_shards(CACHE_SEQ) == 1
                and sparse_mla_decode_kernel.fits(latent_LBSC.shape[2], latent_LBSC.shape[3],
                                                  latent_LBSC.dtype.itemsize))

    def _sparse_mla_decode(self, latent_LBSC, layer_index, idx_BTK, valid_BTK, q_BTHC, new_BTC, positions_BT):
        """[B, 1, H, kv_lora]: the fused gather + absorbed attention of the token over its selected rows of layer
        ``layer_index`` of the stacked latent cache, per (batch, heads) shard."""
        cfg = self.cfg

        def attend(latent, layer, idx, valid, q, new, pos):
            return sparse_mla_decode_ops.sparse_mla_decode(latent, layer, idx, valid, q, new, pos,
                                                           scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank,
                                                           impl=cfg.runtime.decode_attention)

        rows, heads = (BATCH, None), (BATCH, ACT_HEADS, None)
        attend = logical_shard_map(attend, in_axes=((None, BATCH, None, None), (), rows, rows, heads, rows, (BATCH,)),
                                   out_axes=heads)
        o = attend(latent_LBSC, layer_index, idx_BTK[:, 0], valid_BTK[:, 0], q_BTHC[:, 0], new_BTC[:, 0],
                   positions_BT[:, 0])
        return o[:, None]

    def _gather_cached_rows(self, latent_LBSC, layer_index, idx_BTK):
        """[B, T, k, C]: the rows idx of layer ``layer_index`` of the stacked latent cache, by the
        ``decode_cache_read`` impl of pallas_kernels/row_gather (a Pallas impl per batch shard, the slots whole)."""
        B, T, K = idx_BTK.shape
        impl = self.cfg.runtime.decode_cache_read

        def gather(latent, layer, idx):
            return row_gather_ops.stacked_row_gather(latent, layer, idx.reshape(idx.shape[0], T * K), impl=impl)

        if impl in PALLAS_IMPLS:
            if logical_axis_shards(CACHE_SEQ) > 1:
                # the kernel reads whole rows of its batch shard's slots: a slot-split cache would be gathered
                # to every chip per layer and step
                raise ValueError(f"decode_cache_read={impl!r} reads each batch shard's cache slots whole, but the "
                                 f"rules split '{CACHE_SEQ}' over {logical_axis_shards(CACHE_SEQ)} shards; use "
                                 "decode_cache_read='slice' for a slot-split (context) cache")
            gather = logical_shard_map(gather, in_axes=((None, BATCH, None, None), (), (BATCH, None, None)),
                                       out_axes=(BATCH, None, None))
        return gather(latent_LBSC, layer_index, idx_BTK).reshape(B, T, K, -1)

    def _flash_core(self, q, k, v, positions_BT, segment_ids_BT, allowed_BTS=None):
        """Causal attention in the MHA form over every visible key, or only the ``allowed`` ones (the
        selection mask) -> (o [B,T,H,d_v], lse [B,T,H]); per (batch, head) shard."""
        cfg = self.cfg

        def core(q, k, v, pos, seg, *allowed):
            return mha_form.flash_core(cfg, q, k, v, pos, pos, seg, seg, allowed_BTS=allowed[0] if allowed else None)

        heads, bt = (BATCH, None, ACT_HEADS, None), (BATCH, None)
        extra = () if allowed_BTS is None else (allowed_BTS,)
        return logical_shard_map(core, in_axes=(heads, heads, heads, bt, bt) + ((BATCH, None, None),) * len(extra),
                                 out_axes=(heads, (BATCH, None, ACT_HEADS)))(q, k, v, positions_BT, segment_ids_BT,
                                                                             *extra)

    def _context_parallel(self, a_BTD, qr, positions_BT, segment_ids_BT, prev_selection, q_abs, latent_BSC,
                          n_shards, mha=None, masked=False):
        """Select + attend + indexer KL with the sequence split over ``n_shards`` (glm5_jax/model/context_attention.py)
        -> (o_lat, selection, indexer KL or None); with ``mha`` = (MHA query, kv_b_proj) the core runs the
        flash kernel (over the selection mask when ``masked``) and o is the per-head output [B,T,H,d_v]
        instead of o_lat."""
        cfg = self.cfg
        full = self.indexer_kind == "full"
        indexer_qkw = None
        if full:   # detached inputs: the indexer learns only from its KL (see _select)
            indexer_qkw = Indexer(cfg, name="indexer")(jax.lax.stop_gradient(a_BTD), jax.lax.stop_gradient(qr),
                                                       positions_BT)
            if cfg.runtime.attention_mode != "sparse" and cfg.runtime.indexer_loss == "none":
                indexer_qkw = None                     # dense stage: the indexer's outputs are unused
        with jax.named_scope("attention_core"):
            o_lat, selection, kl_parts = context_attention.context_parallel_attention(
                cfg, n_shards, q_abs, latent_BSC, positions_BT, segment_ids_BT, prev_selection, indexer_qkw,
                select=full and cfg.runtime.attention_mode == "sparse",
                sparse=cfg.runtime.attention_mode == "sparse" and self.indexer_kind != "none",
                kl_stage=cfg.runtime.indexer_loss if indexer_qkw is not None else "none", mha=mha, masked=masked)
        if full and cfg.runtime.attention_mode == "sparse":
            selection = tuple(checkpoint_name(x, SELECTION_NAME) for x in selection)
        else:   # nothing selected here: pass the carried selection on whole (its mask included)
            selection = prev_selection
        with jax.named_scope("indexer_kl"):
            indexer_kl = None if kl_parts is None else indexer_kl_ops.mean_over_tokens(*kl_parts)
        return o_lat, selection, indexer_kl

    def _select(self, a_BTD, qr, positions_BT, segment_ids_BT, prev_selection, q_abs, latent_BSC, cache,
                masked=False, replay_BTk=None):
        """(selection, indexer KL or None, cache): this layer's top-k (full), the previous full layer's
        (shared), or pass-through (none / dense attention); ``masked``: the top-k also as a mask. The KL comes
        as a function of an optional precomputed sparse-stage target (see indexer_kl reference) or of the
        flash core's (query, keys, lse), called once attention has run."""
        cfg = self.cfg
        if self.indexer_kind != "full":
            return prev_selection, None, cache
        if cfg.index_kpool is not None:
            return self._pooled_select(a_BTD, qr, positions_BT, segment_ids_BT, prev_selection, cache, masked,
                                       replay_BTk)
        # The indexer is trained only by its KL loss: its inputs are detached (DeepSeek-V3.2 report,
        # section 2.1); top-k indices carry no gradient, so the LM loss never reaches the indexer.
        q_i, k_i, w_i = Indexer(cfg, name="indexer")(jax.lax.stop_gradient(a_BTD), jax.lax.stop_gradient(qr),
                                                     positions_BT)
        kv_positions_BS, kv_segments_BS = positions_BT, segment_ids_BT
        if cache is not None:
            cache = dict(cache, index_key=write_rows(cache["index_key"], k_i, positions_BT))
            k_i = cache["index_key"].astype(jnp.float32)
            kv_positions_BS, kv_segments_BS = cache_slots(k_i)
        selection, index_lse = prev_selection, None
        with_lse = context_attention.indexer_lse_from_topk(cfg, masked)   # masked: training, no cache
        if cfg.runtime.attention_mode == "sparse":
            selection = self._indexer_topk(q_i, k_i, w_i, positions_BT, kv_positions_BS, segment_ids_BT,
                                           kv_segments_BS, with_mask=masked, with_lse=with_lse)
            if replay_BTk is not None:
                selection = routing_replay.replay_selection(selection, replay_BTk, k_i.shape[1])
            if cache is None:
                selection = tuple(checkpoint_name(x, SELECTION_NAME) for x in selection)
            if with_lse:
                selection, index_lse = selection[:3], selection[3]
        if cfg.runtime.indexer_loss == "none" or cache is not None:
            return selection, None, cache
        idx, valid = selection[:2] if cfg.runtime.indexer_loss == "sparse" else (None, None)
        allowed = selection[2] if masked else None

        def kl(target_BTK=None, mha=None):
            if target_BTK is not None and cfg.runtime.attention_impl in PALLAS_IMPLS:
                return indexer_kl_ops.mean_over_tokens(*self._sparse_kl_kernel(q_i, k_i, w_i, idx, valid, target_BTK))
            # mha: (MHA query, per-head keys, lse) of the flash core: the target from its lse, over every
            # visible key (warm-up) or the selected ones (sparse stage on the masked flash core)
            if mha is not None and cfg.runtime.attention_impl in PALLAS_IMPLS and (
                    cfg.runtime.indexer_loss == "warmup" or allowed is not None):
                return indexer_kl_ops.mean_of_sums(*self._warmup_kl_kernel(mha, q_i, k_i, w_i, positions_BT,
                                                                           segment_ids_BT, allowed, index_lse))
            q_att, kv_att, lse = (q_abs, latent_BSC, None) if mha is None else mha
            return indexer_kl_ops.indexer_kl_loss(
                jax.lax.stop_gradient(q_att), jax.lax.stop_gradient(kv_att), q_i, k_i, w_i,
                positions_BT, positions_BT, segment_ids_BT, segment_ids_BT, scale=cfg.softmax_scale,
                stage=cfg.runtime.indexer_loss, idx_BTK=idx, valid_BTK=valid, target_BTK=target_BTK, lse_BTH=lse)
        return selection, kl, cache

    def _pooled_select(self, a_BTD, qr, positions_BT, segment_ids_BT, prev_selection, cache, masked=False,
                       replay_BTk=None):
        """(selection, None, cache) of the pooled indexer (``masked``: with the selection as a mask too); a decode
        cache's "index_key" holds [key; gate]."""
        cfg = self.cfg
        q_i, k_i, w_i, gate_i, ape = Indexer(cfg, name="indexer")(jax.lax.stop_gradient(a_BTD),
                                                                  jax.lax.stop_gradient(qr), positions_BT)
        kv_positions_BS, kv_segments_BS = positions_BT, segment_ids_BT
        q_slot_BT = jnp.broadcast_to(jnp.arange(positions_BT.shape[1], dtype=jnp.int32), positions_BT.shape)
        if cache is not None:
            packed = jnp.concatenate([k_i, gate_i], axis=-1)
            cache = dict(cache, index_key=write_rows(cache["index_key"], packed, positions_BT))
            k_i, gate_i = jnp.split(cache["index_key"].astype(jnp.float32), 2, axis=-1)
            kv_positions_BS, kv_segments_BS = cache_slots(k_i)
            q_slot_BT = positions_BT
        if cfg.runtime.attention_mode != "sparse":
            return prev_selection, None, cache
        selection = pooled_indexer.pooled_topk(cfg, q_i, w_i, k_i, gate_i, ape, positions_BT, kv_positions_BS,
                                               segment_ids_BT, kv_segments_BS, q_slot_BT, with_mask=masked)
        if replay_BTk is not None:
            selection = routing_replay.replay_selection(selection, replay_BTk, k_i.shape[1])
        if cache is None:
            selection = tuple(checkpoint_name(x, SELECTION_NAME) for x in selection)
        return selection, None, cache

    def _warmup_kl_kernel(self, mha, q_i, k_i, w_i, positions_BT, segment_ids_BT, allowed_BTS=None,
                          index_lse_BT=None):
        """The warm-up KL kernel per batch shard (every head of a query is needed for its target), over the
        visible keys or only the ``allowed`` ones (the sparse stage's selection mask, with the top-k's
        ``index_lse_BT`` when given) -> (sum of KL_t per batch row [B], tokens with a non-empty key set per row
        [B])."""
        cfg = self.cfg

        def sums(q, k, lse, iq, ik, iw, pos, seg, *extra):
            allowed, index_lse = (extra + (None, None))[:2]
            return indexer_kl_ops.warmup_kl_sums(q, k, lse, iq, ik, iw, pos, pos, seg, seg, scale=cfg.softmax_scale,
                                                 impl=cfg.runtime.attention_impl, allowed_BTS=allowed,
                                                 index_lse_BT=index_lse)

        b4, b3, bt = (BATCH, None, None, None), (BATCH, None, None), (BATCH, None)
        q_m, k_m, lse = (jax.lax.stop_gradient(x) for x in mha)   # the main model gets no KL gradient
        extra = () if allowed_BTS is None else (allowed_BTS,) + (() if index_lse_BT is None else (index_lse_BT,))
        return logical_shard_map(sums, in_axes=(b4, b4, b3, b4, b3, b3, bt, bt) + (b3, bt)[:len(extra)],
                                 out_axes=((BATCH,), (BATCH,)))(
            q_m, k_m, lse, q_i, k_i, w_i, positions_BT, segment_ids_BT, *extra)

    def _sparse_kl_kernel(self, q_i, k_i, w_i, idx, valid, target_BTK):
        """The sparse stage's indexer KL per token on the Pallas kernels -> (kl [B,T], has_set [B,T]); per
        batch shard."""
        impl = self.cfg.runtime.attention_impl

        def per_token(q, k, w, i, v, p):
            return indexer_kl_ops.sparse_kl_per_token(q, k, w, i, v, p, impl=impl)

        bt, btx = (BATCH, None), (BATCH, None, None)
        return logical_shard_map(per_token, in_axes=((BATCH, None, None, None), btx, btx, btx, btx, btx),
                                 out_axes=(bt, bt))(q_i, k_i, w_i, idx, valid, target_BTK)

    def _indexer_topk(self, q_i, k_i, w_i, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, with_mask=False,
                      with_lse=False):
        """Top-k selection (lightning_indexer.ops), with ``with_mask`` also as a mask [B, T, S] (and with
        ``with_lse`` the log-sum-exp of the selected scores [B, T]); a Pallas impl runs per batch shard."""
        cfg = self.cfg

        def topk(q, k, w, q_pos, kv_pos, q_seg, kv_seg):
            return indexer_ops.indexer_topk(q, k, w, q_pos, kv_pos, q_seg, kv_seg, topk=cfg.index_topk,
                                            impl=cfg.runtime.attention_impl, with_mask=with_mask, with_lse=with_lse)

        args = (q_i, k_i, w_i, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS)
        if cfg.runtime.attention_impl not in PALLAS_IMPLS:
            return topk(*args)
        bt, btx = (BATCH, None), (BATCH, None, None)
        return logical_shard_map(topk, in_axes=((BATCH, None, None, None), btx, btx, bt, bt, bt, bt),
                                 out_axes=(btx,) * (3 if with_mask else 2) + ((bt,) if with_lse else ()))(*args)

    def _sparse_core(self, q_abs, latent_BSC, idx, valid, *, decoding, with_target):
        """Absorbed sparse attention -> (o_lat [B,T,H,R], indexer KL target or None); a Pallas impl runs
        per (batch, head) shard."""
        cfg = self.cfg

        def core(q, kv, i, v):   # the XLA impls compute the target on request
            return sparse_mla_ops.sparse_mla(q, kv, i, v, scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank,
                                             impl=cfg.runtime.attention_impl, training_rows=not decoding,
                                             with_target=with_target)

        if cfg.runtime.attention_impl not in PALLAS_IMPLS:
            out, _, target = core(q_abs, latent_BSC, idx, valid)
            return out, target
        heads, btx = (BATCH, None, ACT_HEADS, None), (BATCH, None, None)
        if not with_target:
            out = logical_shard_map(lambda *a: core(*a).out, in_axes=(heads, btx, btx, btx), out_axes=heads)(
                q_abs, latent_BSC, idx, valid)
            return out, None

        def core_with_target(*args):
            # each head shard's target is the mean over its own heads; every shard holds as many heads,
            # so the mean of those means over the head shards is the mean over all heads
            out, _, target = core(*args)
            return out, logical_pmean(target, ACT_HEADS)

        return logical_shard_map(core_with_target, in_axes=(heads, btx, btx, btx), out_axes=(heads, btx))(
            q_abs, latent_BSC, idx, valid)


def naive_attention(cfg: ModelConfig, q_nope, q_rot, c_BSR, k_rot_BSr, w_kvb, allowed_BTS):
    """The naive MLA form: per-head keys [k_nope; k_rot] and values v up-projected from the latent,
    masked softmax in fp32 -> o [B,T,H,d_v]."""
    dt, dn = cfg.jnp_dtype, cfg.qk_nope_head_dim
    kv = einsum("bsr,rhk->bshk", c_BSR, w_kvb, dt)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    logits = (jnp.einsum("bthn,bshn->bhts", q_nope.astype(dt), k_nope, preferred_element_type=jnp.float32)
              + jnp.einsum("bthr,bsr->bhts", q_rot.astype(dt), k_rot_BSr.astype(dt),
                           preferred_element_type=jnp.float32)) * cfg.softmax_scale
    logits = jnp.where(allowed_BTS[:, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jnp.einsum("bhts,bshv->bthv", probs.astype(dt), v, preferred_element_type=jnp.float32).astype(dt)
