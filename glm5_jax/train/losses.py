"""Training losses: next-token and MTP cross-entropy over packed segments, the sequence-wise balance
term and the auxiliary-loss-free routing-bias update (DeepSeek-V3 report, arXiv:2412.19437, sections 2.1.2 and
2.2), and the DSA indexer KL (DeepSeek-V3.2-Exp report: the indexer's output trained towards the
attention distribution)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import traverse_util

from glm5_jax.model.lm_head import token_nll


def cross_entropy(logits_BTV, targets_BT, valid_BT):
    """(sum of token NLL over valid positions, number of valid positions); logits in fp32."""
    return masked_nll(token_nll(logits_BTV, targets_BT), valid_BT)


def masked_nll(nll_BT, valid_BT):
    """(sum of the per-position NLL over valid positions, number of valid positions)."""
    mask = valid_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * mask), jnp.sum(mask)


def head_nll(logits_BTV, nll_BT, targets_BT, valid_BT):
    """`cross_entropy` of a head's logits, or `masked_nll` of the NLL the model computed instead
    (``nll_only``: no logits, glm5_jax/model/lm_head.py)."""
    return cross_entropy(logits_BTV, targets_BT, valid_BT) if nll_BT is None else masked_nll(nll_BT, valid_BT)


def weighted_terms(train_cfg, model_cfg, stage) -> list[tuple[str, float]]:
    """The (term, weight) pairs the logged `loss` adds up, in order, for the model as `stage` (a
    `glm5_jax.train.stage.StageSpec`) runs it (`model_cfg`): "lm", "mtp", "balance" (summed over MoE layers),
    "indexer_kl" (summed over the layers that compute it). A term is there when its weight is non-zero
    and the model computes it."""
    terms = []
    if stage.lm_loss:
        terms.append(("lm", 1.0))
        if model_cfg.mtp_depth and train_cfg.mtp_loss_weight:
            terms.append(("mtp", train_cfg.mtp_loss_weight))
        if train_cfg.balance_loss_weight and (model_cfg.num_moe_layers or model_cfg.mtp_depth):
            terms.append(("balance", train_cfg.balance_loss_weight))
    if model_cfg.runtime.indexer_loss != "none":
        terms.append(("indexer_kl", train_cfg.indexer_loss_weight))
    return terms


def loss_legend(train_cfg, model_cfg, stage) -> str:
    """The line `train.py` prints before its first step, e.g. "loss = lm + 0.3*mtp + 0.0001*balance +
    1*indexer_kl (summed over layers; ...)": exactly the terms `lm_losses` adds."""
    terms = weighted_terms(train_cfg, model_cfg, stage)
    text = " + ".join(name if name == "lm" else f"{weight:g}*{name}" for name, weight in terms)
    kl = " (summed over layers; indexer_loss in metrics.jsonl is their mean)" if terms[-1][0] == "indexer_kl" else ""
    return f"loss = {text}{kl}; see docs/training.md#losses-and-weights"


def lm_losses(out, inputs, train_cfg, model_cfg, stage):
    """Total loss and its parts from a `model.ModelOutput` of the model as `stage` (a
    `glm5_jax.train.stage.StageSpec`) runs it (`model_cfg`) on `inputs` (a
    `glm5_jax.parallel.context.LaidOutBatch`: its shifted tokens are the targets, in the logits' order).
    LM and MTP terms are means over valid tokens of this (micro) batch; the balance term is summed over MoE
    layers, the indexer KL summed over the layers that compute it (logged as their mean). The LM loss is
    logged in every stage; the total adds `weighted_terms`."""
    parts = {}
    nll, count = head_nll(out.logits, out.nll, inputs.ahead_tokens[0], inputs.ahead_valid[0])     # 1 step ahead
    parts["lm_loss"] = nll / jnp.maximum(count, 1.0)
    parts["tokens"] = count
    total = jnp.zeros((), jnp.float32)
    for name, weight in weighted_terms(train_cfg, model_cfg, stage):
        if name == "lm":
            total = total + parts["lm_loss"]
        elif name == "mtp" and (out.mtp_logits is not None or out.mtp_nll is not None):
            depth_losses = []
            per_depth = out.mtp_logits if out.mtp_logits is not None else out.mtp_nll
            for d in range(per_depth.shape[0]):    # depth d+1 predicts token t + d + 2
                k = d + 2
                logits_d = None if out.mtp_logits is None else out.mtp_logits[d]
                nll_d = None if out.mtp_nll is None else out.mtp_nll[d]
                nll_d, count_d = head_nll(logits_d, nll_d, inputs.ahead_tokens[k - 1], inputs.ahead_valid[k - 1])
                depth_losses.append(nll_d / jnp.maximum(count_d, 1.0))
            parts["mtp_loss"] = jnp.mean(jnp.stack(depth_losses))          # (1/D) Σ_k L^k
            total = total + weight * parts["mtp_loss"]
        elif name == "balance":
            parts["balance_loss"] = out.stats.balance_loss_sum
            total = total + weight * parts["balance_loss"]
        elif name == "indexer_kl":
            parts["indexer_loss"] = out.stats.indexer_kl_mean
            total = total + weight * out.stats.indexer_kl_sum
    parts["loss"] = total
    return total, parts


def update_routing_bias(moe_bias, stats, bias_rows, rate: float):
    """b_i += γ · sign(mean load − load_i) per MoE layer, from the step's global expert loads.

    ``stats``: `LayerStats` [L, ...]; ``bias_rows``: [(path of a routing-bias leaf in ``moe_bias``, the
    stats rows its entries take)] (`model.routing_bias_rows_of_model`). Layers that did not run their
    MoE (``has_moe`` False, e.g. MTP with mtp_depth=0) keep their bias.
    """
    flat = traverse_util.flatten_dict(moe_bias)
    for path, rows in bias_rows:
        load = stats.expert_load[rows]                                       # [..., E], like the leaf
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load).astype(jnp.float32)
        flat[path] = flat[path] + jnp.where(stats.has_moe[rows][..., None], step, 0.0)
    return traverse_util.unflatten_dict(flat)


def load_spread(expert_load_LE, has_moe_L):
    """Per-layer max/mean expert load (1.0 = perfectly balanced; 0 on layers without MoE), for logging."""
    mean = jnp.maximum(jnp.mean(expert_load_LE, axis=-1), 1e-9)
    return jnp.where(has_moe_L, jnp.max(expert_load_LE, axis=-1) / mean, 0.0)
