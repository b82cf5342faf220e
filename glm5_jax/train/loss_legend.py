"""The one line `train.py` prints before its first step saying what the logged `loss` adds up
(`glm5_jax.train.losses.lm_losses` computes it; docs/training.md#losses-and-weights)."""
from __future__ import annotations


def loss_legend(train_cfg, model_cfg, stage: str) -> str:
    """E.g. "loss = lm + 0.3*mtp + 0.0001*balance + 1*indexer_kl (summed over layers; ...)" for the terms
    this run's `lm_losses` adds: a term is there when its weight is non-zero and the model computes it."""
    terms = []
    if stage != "warmup":                                  # the warm-up stage trains the indexer alone
        terms.append("lm")
        if model_cfg.mtp_depth and train_cfg.mtp_loss_weight:
            terms.append(f"{train_cfg.mtp_loss_weight:g}*mtp")
        if train_cfg.balance_loss_weight and (model_cfg.num_moe_layers or model_cfg.mtp_depth):
            terms.append(f"{train_cfg.balance_loss_weight:g}*balance")
    if model_cfg.runtime.indexer_loss != "none":
        terms.append(f"{train_cfg.indexer_loss_weight:g}*indexer_kl")
    kl = " (summed over layers; indexer_loss in metrics.jsonl is their mean)" if "indexer_kl" in terms[-1] else ""
    return f"loss = {' + '.join(terms)}{kl}; see docs/training.md#losses-and-weights"
