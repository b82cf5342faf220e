"""GRPO group advantages and the policy losses of docs/training.md#policy-losses (all token-level normalised).

Shapes: N samples (= prompts x G, groups contiguous), C generated positions. `logp` is the learner's
log π_θ of the recorded tokens, `logp_rollout` the sampler's (TITO), `mask` 1 on tokens in the loss.

* ``dis`` — GLM-5 direct double-sided importance sampling (docs/architecture.md#mla-attention, eqs. 3–5):
  r = exp(log π_θ − log π_rollout); tokens with r outside the open interval (1−ε_l, 1+ε_h) are masked
  entirely; loss = −Σ sg(r·keep) · Â · log π_θ / Σ mask. No π_old forward pass.
* ``icepop`` — GLM-5 reasoning RL (docs/architecture.md#forward-pass): PPO-clip on u = π_θ / π_old (π_old = the
learner's policy
  before this update, u = 1 in value), times the hard mask pop(π_old / π_rollout; 1/β, β).
* ``ppo_clip`` — PPO-clip with the rollout policy as π_old: −min(r Â, clip(r, 1−ε_l, 1+ε_h) Â).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards_N, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """Â_i = (R_i − mean_group R) [/ (std_group R + eps)]; samples of a group are contiguous."""
    r_gG = rewards_N.reshape(-1, group_size)
    centred = r_gG - r_gG.mean(axis=1, keepdims=True)
    if std_norm:
        centred = centred / (r_gG.std(axis=1, keepdims=True) + eps)
    return centred.reshape(-1)


def policy_loss(logp_NC, logp_rollout_NC, adv_N, mask_NC, kind: str = "dis", eps_low: float = 0.2,
                eps_high: float = 0.2, icepop_beta: float = 2.0):
    """(scalar loss, stats): token-level mean over Σ mask. stats: keep_fraction (tokens with gradient),
    ratio_dev (mean |r − 1| of π_θ / π_rollout), ratio_max_dev (its max), logp_abs_diff (mean |log π_θ −
    log π_rollout|: the train / inference mismatch on policy), tokens."""
    mask = mask_NC.astype(jnp.float32)
    adv = adv_N[:, None].astype(jnp.float32)
    ratio = jnp.exp(logp_NC - logp_rollout_NC)                       # π_θ / π_rollout
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    if kind == "dis":
        keep = (ratio > lo) & (ratio < hi)
        weight = jax.lax.stop_gradient(jnp.where(keep, ratio, 0.0))
        per_token = -weight * adv * logp_NC
    elif kind == "icepop":
        old = jax.lax.stop_gradient(logp_NC)
        mismatch = jnp.exp(old - logp_rollout_NC)                    # π_old^train / π^infer
        keep = (mismatch >= 1.0 / icepop_beta) & (mismatch <= icepop_beta)
        u = jnp.exp(logp_NC - old)
        per_token = -jnp.where(keep, jnp.minimum(u * adv, jnp.clip(u, lo, hi) * adv), 0.0)
    elif kind == "ppo_clip":
        unclipped, clipped = ratio * adv, jnp.clip(ratio, lo, hi) * adv
        # the gradient flows where the unclipped term is the minimum
        keep = unclipped <= clipped
        per_token = -jnp.minimum(unclipped, clipped)
    else:
        raise ValueError(f"unknown policy loss {kind!r}; use dis, icepop or ppo_clip")
    tokens = jnp.sum(mask)
    denom = jnp.maximum(tokens, 1.0)
    loss = jnp.sum(per_token * mask) / denom
    stats = {"keep_fraction": jnp.sum(keep * mask) / denom,
             "ratio_dev": jnp.sum(jnp.abs(ratio - 1.0) * mask) / denom,
             "ratio_max_dev": jnp.max(jnp.where(mask > 0, jnp.abs(ratio - 1.0), 0.0)),
             "logp_abs_diff": jnp.sum(jnp.abs(logp_NC - logp_rollout_NC) * mask) / denom, "tokens": tokens}
    return loss, stats
