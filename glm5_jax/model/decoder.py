"""Decoder layers and the scanned stack.

The stack is a sequence of `layer_plan.Segment`s; each segment is one `nn.scan` (under `nn.remat`)
over a group of layers, with parameters stacked on a leading "layers" axis. The scan carry is the
residual stream plus the last full layer's top-k selection, which "shared" layers reuse (GLM-5's
indexer_types: a "shared" layer attends to the previous "full" layer's top-k).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model import hyper_connections, routing_replay
from glm5_jax.model.attention import (ATTENTION_SAVED_NAMES, INDEXER_KL_GRAD_NAMES, Q_LATENT_NAME, SELECTION_NAME,
                                      AttentionOutput, MLAttention, rope_tables)
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.hyper_connections import ACT_BTND, HyperConnection
from glm5_jax.model.kda_layer import KDAttention
from glm5_jax.model.kv_cache import record_routing, write_stacked_rows
from glm5_jax.model.layer_plan import LayerKind, plan_segments
from glm5_jax.model.layer_stats import LayerStats, concatenate, stack
from glm5_jax.model.layers import ACT_BTD, SWIGLU_SAVED_NAMES, RMSNorm, SwiGLU, constrain
from glm5_jax.model.mha_form import QUERY_NAME
from glm5_jax.model.moe.experts import EXPERT_OUT_NAME, EXPERT_ROWS_NAME, EXPERT_SAVED_NAMES
from glm5_jax.model.moe.int4_weights import STACKED_EXPERTS
from glm5_jax.model.moe.layer import BIAS_COLLECTION, BLOCKED_MOE_NAMES, MoE
from glm5_jax.model.stacked_weights import STACKED_WEIGHTS
from glm5_jax.parallel.axes import EMBED, LAYERS

_cp = jax.checkpoint_policies
# each layer's attention block output (after the output projection, before the residual add), for remat
# policies: keeping it, the backward does not rerun the output projection's forward
ATTENTION_OUT_NAME = "attention_block_out"
# The partial policies also keep the DSA top-k selection (attention.SELECTION_NAME: int32 indices and a
# mask, [B, T, k] per full layer): recomputing it costs the indexer scores and a top-k in the backward;
# the blocked MoE's matmul results (moe.BLOCKED_MOE_NAMES, the dots of its block loop); and the warm-up
# KL kernel's indexer gradients (attention.INDEXER_KL_GRAD_NAMES, the size of the indexer's q, k, w per
# layer): the kernel computes them with the loss, and recomputing them reruns it in the backward.
_ALWAYS_KEPT = (SELECTION_NAME, *BLOCKED_MOE_NAMES, *INDEXER_KL_GRAD_NAMES)
# name groups the policies below combine: the attention core's results the attention impls name (ATTENTION_SAVED_NAMES
# but the layer-level "attention_core_out", which is the kernel's out passed through); what the routed experts
# need in the backward without rerunning a product or the transport; the projections' results whose recompute
# a backward can skip (the attention block's output, the query's latent, the dense / shared SwiGLU's products)
_ATTENTION_CORE_KEPT = ATTENTION_SAVED_NAMES[1:]
_MOE_KEPT = (*EXPERT_SAVED_NAMES, EXPERT_ROWS_NAME, EXPERT_OUT_NAME)
_PROJECTIONS_KEPT = (ATTENTION_OUT_NAME, Q_LATENT_NAME, *SWIGLU_SAVED_NAMES)
_keep_selection = _cp.save_only_these_names(*_ALWAYS_KEPT)
_offload_dots = _cp.offload_dot_with_no_batch_dims("device", "pinned_host")


def _offload_dots_keeping_selection(prim, *avals, **params):
    """Keep the selection (and blocked-MoE results) on the device, offload weight-stationary matmul outputs
    to host memory (TPU/GPU: pinned_host). save_from_both_policies cannot join them: an offload policy
    answers with offload decisions, not booleans."""
    if _keep_selection(prim, *avals, **params):
        return True
    return _offload_dots(prim, *avals, **params)


REMAT_POLICIES = {
    "full": None,   # save nothing, recompute the layer in the backward pass
    # "full" except the DSA selection (int32 indices + mask, [B, T, k] per full layer): the backward does
    # not rerun the lightning indexer's scores and top-k, everything else is recomputed
    "selection_saveable": _keep_selection,
    # "selection_saveable" + the attention core's results the attention impls name (attention.
    # ATTENTION_SAVED_NAMES but the layer-level "attention_core_out", which is the kernel's out passed through:
    # the kernels' out and lse, the indexer KL target): the backward does not rerun the attention core's
    # forward either (the long-context step: B*T*H*d_c + B*T*k values per layer)
    "attention_saveable": _cp.save_only_these_names(*_ALWAYS_KEPT, *_ATTENTION_CORE_KEPT),
    # "attention_saveable" + the routed experts' outputs per (token, choice) (moe.experts.EXPERT_OUT_NAME,
    # [N, K, D] in the compute dtype per MoE layer) and the attention block's output (ATTENTION_OUT_NAME,
    # [B, T, D]): the backward reruns the dispatch and the gate / up products (their gradients need the rows)
    # but not the down product and the combine (its all-to-all back), nor the output projection
    "attention_expert_out_saveable": _cp.save_only_these_names(*_ALWAYS_KEPT, *_ATTENTION_CORE_KEPT,
                                                               EXPERT_OUT_NAME, ATTENTION_OUT_NAME),
    # "attention_expert_out_saveable" + the query's low-rank latent (attention.Q_LATENT_NAME) and the dense /
    # shared SwiGLU's gate and up products (layers.SWIGLU_SAVED_NAMES, [B, T, width] fp32 each): the backward
    # does not rerun the query's down-projection or the shared expert's products either
    "attention_expert_out_mlp_saveable": _cp.save_only_these_names(*_ALWAYS_KEPT, *_ATTENTION_CORE_KEPT,
                                                                   EXPERT_OUT_NAME, *_PROJECTIONS_KEPT),
    "dots_saveable": _cp.save_from_both_policies(_cp.dots_saveable, _keep_selection),
    "dots_with_no_batch_dims_saveable": _cp.save_from_both_policies(_cp.dots_with_no_batch_dims_saveable,
                                                                    _keep_selection),
    # also keep each layer's attention-core output, indexer KL target and the residuals the attention
    # impls name (attention.ATTENTION_SAVED_NAMES: the kernels' out and lse, the gather form's
    # probabilities): the backward pass then does not rerun the attention core's forward; costs
    # B*T*H*d_c (+ B*T*k, + B*T*H, + B*T*k*H for the gather form) values per layer
    "dots_attention_saveable": _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable,
        _cp.save_only_these_names(*_ALWAYS_KEPT, *ATTENTION_SAVED_NAMES)),
    # "full" except the selection and the routed experts' gate / up products (moe.experts.EXPERT_SAVED_NAMES,
    # 2 x [rows, F] in the compute dtype per MoE layer): the backward reruns only the experts' down product, so
    # the routed experts cost 10/3 of a forward instead of 4 (a2a, routing and everything else are still
    # recomputed)
    "experts_saveable": _cp.save_only_these_names(*_ALWAYS_KEPT, *EXPERT_SAVED_NAMES),
    # "experts_saveable" + the rows the experts multiply and their outputs per (token, choice)
    # (moe.experts.EXPERT_ROWS_NAME, EXPERT_OUT_NAME; [rows, D] and [N, K, D] in the compute dtype per MoE layer):
    # the backward reruns no expert product and no transport (gathers, all-to-alls, the expert weights'
    # all-gather for the forward), only the routing; attention and the rest are recomputed
    "moe_saveable": _cp.save_only_these_names(*_ALWAYS_KEPT, *_MOE_KEPT),
    # "moe_saveable" + the attention core's residuals (as "attention_saveable": the kernels' out and lse, the
    # KL target), the attention block's output ([B, T, D] in the compute dtype, ATTENTION_OUT_NAME) and, in
    # the MHA form, the query and its latent (mha_form.QUERY_NAME [B, T, H, d_qk], attention.Q_LATENT_NAME),
    # and the dense / shared SwiGLU's gate and up products (layers.SWIGLU_SAVED_NAMES): the backward reruns
    # only the key / value up-projection the attention backward reads, neither the attention core's forward,
    # nor the query, output or shared-expert projections
    "moe_attention_saveable": _cp.save_only_these_names(*_ALWAYS_KEPT, *_MOE_KEPT, *_ATTENTION_CORE_KEPT,
                                                        *_PROJECTIONS_KEPT, QUERY_NAME),
    # keep weight-stationary matmul outputs, but in host memory (TPU/GPU: pinned_host) instead of HBM
    "offload_dots": _offload_dots_keeping_selection,
}


class LayerOutput(NamedTuple):
    h: jax.Array               # [B, T, D] the residual stream after the layer
    selection: tuple           # the top-k selection a following "shared" layer reuses
    stats: LayerStats          # this layer's statistics
    cache: Any                 # its updated decode cache (None when not decoding)


class StackOutput(NamedTuple):
    h: jax.Array               # [B, T, D] the final residual stream (before the final norm)
    stats: LayerStats          # [num_hidden_layers, ...] in layer order
    cache: Any                 # {segment: {layer_i: {...} [repeats, ...]}}, or None when not decoding


class DecoderLayer(nn.Module):
    """Pre-norm block: h += Attn(RMSNorm(h)); h += FFN(RMSNorm(h)); FFN dense or MoE -> `LayerOutput`.

    Attention is MLA + DSA, or KDA (``kind.attention == "kda"``: a KDA layer passes the selection on). With
    ``cfg.hc_mult`` streams the residual stream is [B, T, N, D] and each block reads and writes it through
    its hyper-connection mixers (glm5_jax/model/hyper_connections.py) instead of adding to it.
    """
    cfg: ModelConfig
    kind: LayerKind

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection, cache=None, layer_index=None, replay=None,
                 rope=None):
        """``layer_index``: this layer's index in its scan, given with ``decode_stacked_experts`` (the MoE then
        reads the stacked experts, glm5_jax/model/moe/int4_weights.py) or a ``decode_cache_read`` other than
        "slice" (``cache`` is then the segment's stacked cache, read at that index). ``replay``: this layer's
        recorded routing ({"routed_experts": [B, T, K], "selected_slots": [B, T, k]}, either optional) to
        route and select by; a cache with recording leaves gets this step's routing written
        (glm5_jax/model/routing_replay.py). ``rope``: the step's RoPE tables (attention.rope_tables) when decoding
        with ``decode_rope_tables``."""
        replay = replay or {}
        cfg, pdt = self.cfg, self.cfg.jnp_param_dtype
        around_attention, around_ffn = self._residual("attn_hc"), self._residual("ffn_hc")
        x, add = around_attention(h_BTD)
        spread = cfg.runtime.decode_spread_norms
        a = RMSNorm(cfg.rms_norm_eps, EMBED, pdt, spread, name="input_norm")(x)
        if self.kind.attention == "kda":
            out, new_cache = KDAttention(cfg, name="attention")(a, segment_ids_BT, positions_BT, cache)
            attn = AttentionOutput(out, selection, None, new_cache)
        else:
            cache_index = layer_index if cfg.runtime.decode_cache_read != "slice" else None
            attn = MLAttention(cfg, self.kind.indexer, name="attention")(a, positions_BT, segment_ids_BT, selection,
                                                                        cache, cache_index,
                                                                        replay.get(routing_replay.SELECTED), rope)
        h_BTD = add(checkpoint_name(attn.out, ATTENTION_OUT_NAME))
        x, add = around_ffn(h_BTD)
        m = RMSNorm(cfg.rms_norm_eps, EMBED, pdt, spread, name="post_attention_norm")(x)
        moe_aux = None
        if self.kind.mlp == "dense":
            ffn_out = SwiGLU(cfg, cfg.intermediate_size, name="mlp")(m)
        else:
            experts_index = layer_index if cfg.runtime.decode_stacked_experts else None
            ffn_out, moe_aux = MoE(cfg, name="moe")(m, segment_ids_BT > 0, experts_index,
                                                    replay.get(routing_replay.EXPERTS))
            moe_aux = dict(moe_aux)
        expert_idx = None if moe_aux is None else moe_aux.pop("expert_idx")
        stats = LayerStats.of_layer(cfg.n_routed_experts, moe_aux, attn.indexer_kl)
        new_cache = attn.cache
        if cache is not None:
            new_cache = record_routing(cache, new_cache, positions_BT, expert_idx,
                                       attn.selection if self.kind.indexer == "full" else None)
        return LayerOutput(add(ffn_out), attn.selection, stats, new_cache)

    def _residual(self, hc_name):
        """h -> (the block's input, out -> the next h): a plain residual add, or hyper-connections."""
        if not self.cfg.hc_mult:
            return lambda h: (h, lambda out: constrain(h + out, ACT_BTD))
        mixers = HyperConnection(self.cfg, name=hc_name)

        def merged(post, comb, out, h_BTND):
            with jax.named_scope(hc_name):       # filed with the mixers (glm5_jax/cost/categories.py)
                return constrain(hyper_connections.merge(post, comb, out, h_BTND), ACT_BTND)

        def around(h_BTND):
            post, comb, block_in = mixers(h_BTND)
            return block_in, lambda out: merged(post, comb, out, h_BTND)
        return around


class LayerGroup(nn.Module):
    """The repeating unit of a segment: consecutive layers of the given kinds (scan body).

    Returns the new carry and (`LayerStats` stacked over the unit's layers [len(unit), ...], decode
    cache). A decode cache is scanned alongside the parameters: {"layer_i": cache} in, the updated one out;
    so is the repeat's index ``repeat`` with ``decode_stacked_experts`` or a stacked cache read (None
    otherwise). With a ``decode_cache_read`` other than "slice" the segment's whole stacked cache comes in the
    carry instead (h, selection, cache), passed on unchanged: every repeat reads it at its index and returns
    its new rows, which the stack writes into the loop's output cache after the scan.
    """
    cfg: ModelConfig
    unit: tuple

    @nn.compact
    def __call__(self, carry, positions_BT, segment_ids_BT, cache=None, repeat=None, replay=None, rope=None):
        h, selection, *stacked_cache = carry        # (h, selection[, the segment's stacked cache, passed on])
        if stacked_cache:
            cache = stacked_cache[0]
        # Positions and segment ids are the same for every layer. Left loop-invariant, JAX's scan
        # linearisation hoists all work that depends on them alone out of the layer loop and stores it
        # (e.g. the indexer's visibility masks for every query chunk and key-window branch: GBs at
        # T = 4096); tied to the carry here, that work stays in the layer where it is fused and cheap.
        h, positions_BT, segment_ids_BT = jax.lax.optimization_barrier((h, positions_BT, segment_ids_BT))
        unit_stats, new_cache = [], {}
        for i, kind in enumerate(self.unit):
            layer_cache = None if cache is None else cache[f"layer_{i}"]
            layer_replay = None if replay is None else replay.get(f"layer_{i}")
            out = DecoderLayer(self.cfg, kind, name=f"layer_{i}")(h, positions_BT, segment_ids_BT, selection,
                                                                  layer_cache, repeat, layer_replay, rope)
            h, selection = out.h, out.selection
            unit_stats.append(out.stats)
            if out.cache is not None:
                new_cache[f"layer_{i}"] = out.cache
        return (h, selection, *stacked_cache), (stack(unit_stats), new_cache)


class DecoderStack(nn.Module):
    """All main layers -> `StackOutput`."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection, cache=None, replay=None):
        """``replay``: recorded routing {segment: {layer_i: {name: [repeats, B, T, X]}}} to replay
        (glm5_jax/model/routing_replay.py; segments and layers without an entry compute their own)."""
        cfg = self.cfg
        group_cls = LayerGroup
        if cfg.runtime.remat_policy != "none":
            group_cls = nn.remat(LayerGroup, policy=REMAT_POLICIES[cfg.runtime.remat_policy], prevent_cse=False)
        carry, segment_stats, new_cache = (h_BTD, selection), [], {}
        # decode_stacked_experts: the stacked packed experts go to every layer whole, with the repeat's index;
        # decode_cache_read other than "slice": so does the segment's stacked cache (read in place by the layer)
        decoding = cache is not None and not self.is_initializing()
        stacked = cfg.runtime.decode_stacked_experts and decoding
        stacked_cache = cfg.runtime.decode_cache_read != "slice" and decoding
        stacked_kv_b = cfg.runtime.decode_stacked_kv_b and stacked_cache        # glm5_jax/model/stacked_weights.py
        # decode_rope_tables: the RoPE tables of the step's positions, made once for every layer
        rope = rope_tables(cfg, positions_BT) if decoding and cfg.runtime.decode_rope_tables else None
        for seg in plan_segments(cfg):
            scanned = nn.scan(group_cls, variable_axes={"params": 0, BIAS_COLLECTION: 0},
                              variable_broadcast=[c for c, on in ((STACKED_EXPERTS, stacked),
                                                                  (STACKED_WEIGHTS, stacked_kv_b)) if on] or False,
                              split_rngs={"params": True},
                              in_axes=(nn.broadcast, nn.broadcast, 0, 0, 0, nn.broadcast),
                              length=seg.repeats, metadata_params={nn.PARTITION_NAME: LAYERS})
            seg_cache = None if cache is None else cache[seg.name]
            repeat = jnp.arange(seg.repeats, dtype=jnp.int32) if stacked or stacked_cache else None
            if stacked_cache:       # in the carry (LayerGroup)
                carry, seg_cache = carry + (seg_cache,), None
            seg_replay = None if replay is None else replay.get(seg.name)
            carry, (stats, rows) = scanned(cfg, seg.unit, name=seg.name)(carry, positions_BT, segment_ids_BT,
                                                                         seg_cache, repeat, seg_replay, rope)
            if stacked_cache:
                carry, seg_cache = carry[:2], carry[2]
            # [repeats, len(unit), ...] -> [repeats * len(unit), ...]: layer seg.layer_index(r, u) is row r*P + u
            segment_stats.append(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), stats))
            if cache is not None and cfg.runtime.decode_cache_write == "rows":    # the layers returned their new rows
                seg_cache = write_stacked_rows(seg_cache if stacked_cache else cache[seg.name], rows, positions_BT)
            else:
                seg_cache = rows
            new_cache[seg.name] = seg_cache
        return StackOutput(carry[0], concatenate(segment_stats), None if cache is None else new_cache)


# where a DecoderLayer keeps its routing bias in the BIAS_COLLECTION tree (MoE(name="moe")'s variable)
ROUTING_BIAS_PATH = ("moe", "e_score_correction_bias")


def routing_bias_rows(cfg: ModelConfig):
    """[(path of a stacked routing-bias leaf under the stack's BIAS_COLLECTION tree, layer index of each
    entry of its leading "layers" axis)], one per MoE position of each segment's unit."""
    return [((seg.name, f"layer_{u}") + ROUTING_BIAS_PATH,
             np.array([seg.layer_index(r, u) for r in range(seg.repeats)]))
            for seg in plan_segments(cfg) for u, kind in enumerate(seg.unit) if kind.mlp == "moe"]
