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
}


class DecoderLayer(nn.Module):
    """Pre-norm block: h += Attn(RMSNorm(h)); h += FFN(RMSNorm(h)); FFN dense or MoE."""
    cfg: object
    kind: LayerKind

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection):
        cfg, pdt = self.cfg, self.cfg.jnp_param_dtype
        a = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="input_norm")(h_BTD)
        attn_out, selection = MLAttention(cfg, self.kind.indexer, name="attention")(
            a, positions_BT, segment_ids_BT, selection)
        h_BTD = constrain(h_BTD + attn_out, ACT_BTD)
        m = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="post_attention_norm")(h_BTD)
        if self.kind.mlp == "dense":
            ffn_out, aux = SwiGLU(cfg, cfg.intermediate_size, name="mlp")(m), {}
        else:
            ffn_out, aux = MoE(cfg, name="moe")(m, segment_ids_BT > 0)
        return constrain(h_BTD + ffn_out, ACT_BTD), selection, aux


class LayerGroup(nn.Module):
    """The repeating unit of a segment: consecutive layers of the given kinds (scan body)."""
    cfg: object
    unit: tuple

    @nn.compact
    def __call__(self, carry, positions_BT, segment_ids_BT):
        h, selection = carry
        moe_aux = []
        for i, kind in enumerate(self.unit):
            h, selection, aux = DecoderLayer(self.cfg, kind, name=f"layer_{i}")(h, positions_BT, segment_ids_BT,
                                                                                selection)
            if aux:
                moe_aux.append(aux)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *moe_aux) if moe_aux else {}
        return (h, selection), stacked


class DecoderStack(nn.Module):
    """All main layers: returns the final residual stream and per-MoE-layer aux stacked in layer order."""
    cfg: object

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT, selection):
        cfg = self.cfg
        group_cls = LayerGroup
        if cfg.remat_policy != "none":
            group_cls = nn.remat(LayerGroup, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
        carry, moe_aux = (h_BTD, selection), []
        for seg in plan_segments(cfg):
            scanned = nn.scan(group_cls, variable_axes={"params": 0, BIAS_COLLECTION: 0},
                              split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast),
                              length=seg.repeats, metadata_params={nn.PARTITION_NAME: "layers"})
            carry, aux = scanned(cfg, seg.unit, name=seg.name)(carry, positions_BT, segment_ids_BT)
            if aux:  # [repeats, moe layers per group, ...] -> [moe layers of the segment, ...]
                moe_aux.append(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), aux))
        moe_aux = jax.tree.map(lambda *xs: jnp.concatenate(xs), *moe_aux) if moe_aux else {}
        return carry[0], moe_aux
