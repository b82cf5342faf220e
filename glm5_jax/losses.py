"""Training losses: next-token and MTP cross-entropy over packed segments (spec §6.2), the balance
term (§5.3), the DSA indexer KL (§7.1), and the auxiliary-loss-free routing-bias update (§5.3)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shifted_targets(tokens_BT, segment_ids_BT, k: int):
    """Targets k steps ahead and where they are valid: same non-padding segment at t and t + k."""
    T = tokens_BT.shape[1]
    targets = jnp.pad(tokens_BT[:, k:], ((0, 0), (0, min(k, T))))
    later_segment = jnp.pad(segment_ids_BT[:, k:], ((0, 0), (0, min(k, T))))
    valid = (segment_ids_BT > 0) & (later_segment == segment_ids_BT)
    return targets, valid


def cross_entropy(logits_BTV, targets_BT, valid_BT):
    """(sum of token NLL over valid positions, number of valid positions); logits in fp32."""
    logits = logits_BTV.astype(jnp.float32)
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets_BT[..., None], -1)[..., 0]
    mask = valid_BT.astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def lm_losses(logits, aux, tokens, segment_ids, train_cfg, model_cfg, stage: str):
    """Total loss and its parts. LM and MTP terms are means over valid tokens of this (micro) batch."""
    parts = {}
    nll, count = cross_entropy(logits, *shifted_targets(tokens, segment_ids, 1))
    parts["lm_loss"] = nll / jnp.maximum(count, 1.0)
    parts["tokens"] = count
    total = jnp.zeros((), jnp.float32)
    if stage != "warmup":
        total = total + parts["lm_loss"]
        if "mtp_logits" in aux and train_cfg.mtp_loss_weight:
            depth_losses = []
            for d in range(aux["mtp_logits"].shape[0]):    # depth d+1 predicts token t + d + 2
                nll_d, count_d = cross_entropy(aux["mtp_logits"][d], *shifted_targets(tokens, segment_ids, d + 2))
                depth_losses.append(nll_d / jnp.maximum(count_d, 1.0))
            parts["mtp_loss"] = jnp.mean(jnp.stack(depth_losses))          # (1/D) Σ_k L^k
            total = total + train_cfg.mtp_loss_weight * parts["mtp_loss"]
        if "balance_loss" in aux and train_cfg.balance_loss_weight:
            parts["balance_loss"] = jnp.sum(aux["balance_loss"])
            total = total + train_cfg.balance_loss_weight * parts["balance_loss"]
    if "indexer_kl" in aux:
        parts["indexer_loss"] = jnp.mean(aux["indexer_kl"])                # logged as the mean over layers
        total = total + train_cfg.indexer_loss_weight * jnp.sum(aux["indexer_kl"])
    parts["loss"] = total
    return total, parts


def update_routing_bias(moe_bias, layers_aux, rate: float):
    """b_i += γ · sign(mean load − load_i) per MoE layer, from the step's global expert loads (§5.3)."""

    def walk(bias_node, aux_node):
        if aux_node is None:                # a block that did not run (e.g. MTP with mtp_depth=0)
            return bias_node
        if "e_score_correction_bias" in bias_node:
            load = aux_node["expert_load"]
            mean = jnp.mean(load, axis=-1, keepdims=True)
            return {"e_score_correction_bias":
                    bias_node["e_score_correction_bias"] + rate * jnp.sign(mean - load).astype(jnp.float32)}
        return {k: walk(v, aux_node.get(k)) for k, v in bias_node.items()}

    return walk(moe_bias, layers_aux)


def load_spread(expert_load_LE):
    """Per-layer max/mean expert load (1.0 = perfectly balanced), for logging."""
    mean = jnp.maximum(jnp.mean(expert_load_LE, axis=-1), 1e-9)
    return jnp.max(expert_load_LE, axis=-1) / mean
