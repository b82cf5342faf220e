"""Decoder layers and the scanned stack (spec §3).

The stack is a sequence of `layer_plan.Segment`s; each segment is one `nn.scan` (under `nn.remat`)
over a group of layers, with parameters stacked on a leading "layers" axis. The scan carry is the
residual stream plus the last full layer's top-k selection, which "shared" layers reuse (§4.6).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.attention import MLAttention
from glm5_jax.layer_plan import LayerKind, plan_segments
from glm5_jax.layers import ACT_BTD, RMSNorm, SwiGLU, constrain
from glm5_jax.moe import BIAS_COLLECTION, MoE

REMAT_POLICIES = {
    "full": None,   # save nothing, recompute the layer in the backward pass
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep weight-stationary matmul outputs, but in host memory (TPU/GPU: pinned_host) instead of HBM
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


class DecoderLayer(nn.Module):
    """Pre-norm block: h += Attn(RMSNorm(h)); h += FFN(RMSNorm(h)); FFN dense or MoE."""
    cfg: object
    kind: LayerKind

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection):
        cfg, pdt = self.cfg, self.cfg.jnp_param_dtype
        a = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="input_norm")(h_BTD)
        attn_out, selection, indexer_kl = MLAttention(cfg, self.kind.indexer, name="attention")(
            a, positions_BT, segment_ids_BT, selection)
        h_BTD = constrain(h_BTD + attn_out, ACT_BTD)
        m = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="post_attention_norm")(h_BTD)
        aux = {} if indexer_kl is None else {"indexer_kl": indexer_kl}
        if self.kind.mlp == "dense":
            ffn_out = SwiGLU(cfg, cfg.intermediate_size, name="mlp")(m)
        else:
            ffn_out, aux["moe"] = MoE(cfg, name="moe")(m, segment_ids_BT > 0)
        return constrain(h_BTD + ffn_out, ACT_BTD), selection, aux


class LayerGroup(nn.Module):
    """The repeating unit of a segment: consecutive layers of the given kinds (scan body).

    Per-layer aux (router statistics, indexer KL) comes back as {"layer_i": aux} for the layers that have
    any, mirroring the parameter tree so it can be matched against it (e.g. the routing-bias update).
    """
    cfg: object
    unit: tuple

    @nn.compact
    def __call__(self, carry, positions_BT, segment_ids_BT):
        h, selection = carry
        group_aux = {}
        for i, kind in enumerate(self.unit):
            h, selection, aux = DecoderLayer(self.cfg, kind, name=f"layer_{i}")(h, positions_BT, segment_ids_BT,
                                                                                selection)
            if aux:
                group_aux[f"layer_{i}"] = aux
        return (h, selection), group_aux


class DecoderStack(nn.Module):
    """All main layers: returns the final residual stream and {segment: {layer_i: aux [repeats, ...]}}."""
    cfg: object

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection):
        cfg = self.cfg
        group_cls = LayerGroup
        if cfg.remat_policy != "none":
            group_cls = nn.remat(LayerGroup, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
        carry, stack_aux = (h_BTD, selection), {}
        for seg in plan_segments(cfg):
            scanned = nn.scan(group_cls, variable_axes={"params": 0, BIAS_COLLECTION: 0},
                              split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast),
                              length=seg.repeats, metadata_params={nn.PARTITION_NAME: "layers"})
            carry, aux = scanned(cfg, seg.unit, name=seg.name)(carry, positions_BT, segment_ids_BT)
            if aux:
                stack_aux[seg.name] = aux
        return carry[0], stack_aux


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
