"""Decoder layers and the scanned stack (spec §3).

The stack is a sequence of `layer_plan.Segment`s; each segment is one `nn.scan` (under `nn.remat`)
over a group of layers, with parameters stacked on a leading "layers" axis. The scan carry is the
residual stream plus the last full layer's top-k selection, which "shared" layers reuse (§4.6).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.attention import ATTENTION_SAVED_NAMES, SELECTION_NAME, MLAttention
from glm5_jax.layer_plan import LayerKind, plan_segments
from glm5_jax.layers import ACT_BTD, RMSNorm, SwiGLU, constrain
from glm5_jax.moe import BIAS_COLLECTION, BLOCKED_MOE_NAMES, MoE

_cp = jax.checkpoint_policies
# The partial policies also keep the DSA top-k selection (attention.SELECTION_NAME: int32 indices and a
# mask, [B, T, k] per full layer): recomputing it costs the indexer scores and a top-k in the backward;
# and the blocked MoE's matmul results (moe.BLOCKED_MOE_NAMES, the dots of its block loop).
_keep_selection = _cp.save_only_these_names(SELECTION_NAME, *BLOCKED_MOE_NAMES)
REMAT_POLICIES = {
    "full": None,   # save nothing, recompute the layer in the backward pass
    "dots_saveable": _cp.save_from_both_policies(_cp.dots_saveable, _keep_selection),
    "dots_with_no_batch_dims_saveable": _cp.save_from_both_policies(_cp.dots_with_no_batch_dims_saveable,
                                                                    _keep_selection),
    # also keep each layer's attention-core output, indexer KL target and the residuals the attention
    # impls name (attention.ATTENTION_SAVED_NAMES: the kernels' out and lse, the gather form's
    # probabilities): the backward pass then does not rerun the attention core's forward; costs
    # B*T*H*d_c (+ B*T*k, + B*T*H, + B*T*k*H for the gather form) values per layer
    "dots_attention_saveable": _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable,
        _cp.save_only_these_names(SELECTION_NAME, *BLOCKED_MOE_NAMES, *ATTENTION_SAVED_NAMES)),
    # keep weight-stationary matmul outputs, but in host memory (TPU/GPU: pinned_host) instead of HBM
    "offload_dots": _cp.save_from_both_policies(_cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
                                                _keep_selection),
}


class DecoderLayer(nn.Module):
    """Pre-norm block: h += Attn(RMSNorm(h)); h += FFN(RMSNorm(h)); FFN dense or MoE.

    Returns (h, selection, aux, cache); ``cache`` is this layer's decode cache (None when not decoding).
    """
    cfg: object
    kind: LayerKind

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection, cache=None):
        cfg, pdt = self.cfg, self.cfg.jnp_param_dtype
        a = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="input_norm")(h_BTD)
        attn_out, selection, indexer_kl, cache = MLAttention(cfg, self.kind.indexer, name="attention")(
            a, positions_BT, segment_ids_BT, selection, cache)
        h_BTD = constrain(h_BTD + attn_out, ACT_BTD)
        m = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="post_attention_norm")(h_BTD)
        aux = {} if indexer_kl is None else {"indexer_kl": indexer_kl}
        if self.kind.mlp == "dense":
            ffn_out = SwiGLU(cfg, cfg.intermediate_size, name="mlp")(m)
        else:
            ffn_out, aux["moe"] = MoE(cfg, name="moe")(m, segment_ids_BT > 0)
        return constrain(h_BTD + ffn_out, ACT_BTD), selection, aux, cache


class LayerGroup(nn.Module):
    """The repeating unit of a segment: consecutive layers of the given kinds (scan body).

    Per-layer aux (router statistics, indexer KL) comes back as {"layer_i": aux} for the layers that have
    any, mirroring the parameter tree so it can be matched against it (e.g. the routing-bias update).
    A decode cache is scanned alongside the parameters: {"layer_i": cache} in, the updated one out.
    """
    cfg: object
    unit: tuple

    @nn.compact
    def __call__(self, carry, positions_BT, segment_ids_BT, cache=None):
        h, selection = carry
        # Positions and segment ids are the same for every layer. Left loop-invariant, JAX's scan
        # linearisation hoists all work that depends on them alone out of the layer loop and stores it
        # (e.g. the indexer's visibility masks for every query chunk and key-window branch: GBs at
        # T = 4096); tied to the carry here, that work stays in the layer where it is fused and cheap.
        h, positions_BT, segment_ids_BT = jax.lax.optimization_barrier((h, positions_BT, segment_ids_BT))
        group_aux, new_cache = {}, {}
        for i, kind in enumerate(self.unit):
            layer_cache = None if cache is None else cache[f"layer_{i}"]
            h, selection, aux, layer_cache = DecoderLayer(self.cfg, kind, name=f"layer_{i}")(
                h, positions_BT, segment_ids_BT, selection, layer_cache)
            if aux:
                group_aux[f"layer_{i}"] = aux
            if layer_cache is not None:
                new_cache[f"layer_{i}"] = layer_cache
        return (h, selection), (group_aux, new_cache)


class DecoderStack(nn.Module):
    """All main layers: returns the final residual stream, {segment: {layer_i: aux [repeats, ...]}} and
    the updated decode cache ({segment: {layer_i: {...} [repeats, ...]}}, or None when not decoding)."""
    cfg: object

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection, cache=None):
        cfg = self.cfg
        group_cls = LayerGroup
        if cfg.remat_policy != "none":
            group_cls = nn.remat(LayerGroup, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
        carry, stack_aux, new_cache = (h_BTD, selection), {}, {}
        for seg in plan_segments(cfg):
            scanned = nn.scan(group_cls, variable_axes={"params": 0, BIAS_COLLECTION: 0},
                              split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast, 0),
                              length=seg.repeats, metadata_params={nn.PARTITION_NAME: "layers"})
            seg_cache = None if cache is None else cache[seg.name]
            carry, (aux, seg_cache) = scanned(cfg, seg.unit, name=seg.name)(carry, positions_BT, segment_ids_BT,
                                                                            seg_cache)
            if aux:
                stack_aux[seg.name] = aux
            new_cache[seg.name] = seg_cache
        return carry[0], stack_aux, (None if cache is None else new_cache)


def flatten_in_layer_order(cfg, stack_aux, key_path):
    """Concatenate one aux quantity over layers in model order: [n layers that have it, ...]."""
    pieces = []
    for seg in plan_segments(cfg):
        seg_aux = stack_aux.get(seg.name, {})
        per_position = []
        for u in range(len(seg.unit)):
            node = seg_aux.get(f"layer_{u}", {})
            for k in key_path:
                node = node.get(k, {}) if isinstance(node, dict) else {}
            if not isinstance(node, dict):
                per_position.append(node)                    # [repeats, ...]
        if per_position:                                     # -> [repeats * positions, ...] in layer order
            stacked = jnp.stack(per_position, axis=1)
            pieces.append(stacked.reshape((-1,) + stacked.shape[2:]))
    return jnp.concatenate(pieces) if pieces else None
