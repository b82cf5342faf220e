"""Optimizers: AdamW or Muon ("Muon Split"), warmup + cosine, clipping, and the DSA stage's frozen parameters.

Muon orthogonalises each weight matrix's update. Our MLA up-projections keep heads on their own axis
([in, H, d_head]), so declaring the head axis a *batch* axis orthogonalises every head's slice
separately: GLM-5's "Muon Split". Stacked layers and experts are batch axes too. Embedding, head,
router, norms and biases use AdamW, as Muon practice does.
"""
from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers, muon

# leaf name -> (reduction axes, output axes) of the unstacked weight
_MATRIX_AXES = {
    "q_a_proj": ((0,), (1,)), "q_b_proj": ((0,), (2,)), "kv_a_proj": ((0,), (1,)), "kv_b_proj": ((0,), (2,)),
    "o_proj": ((0, 1), (2,)), "wq_b": ((0,), (2,)), "wk": ((0,), (1,)), "weights_proj": ((0,), (1,)),
    "eh_proj": ((0,), (1,)),
}
_FFN = ("gate_proj", "up_proj", "down_proj")


def _names(path):
    return [getattr(k, "key", str(k)) for k in path]


def muon_dimension_numbers(params):
    """MuonDimensionNumbers per matrix leaf (None -> AdamW)."""

    def dims(path, leaf):
        names = _names(path)
        name, stacked = names[-1], int(names[0] == "decoder")
        if name in _MATRIX_AXES:
            reduction, output = _MATRIX_AXES[name]
        elif name in _FFN:
            routed = len(names) >= 2 and names[-2] == "moe"            # [E, in, out]: experts are a batch axis
            reduction, output = ((1,), (2,)) if routed else ((0,), (1,))
        else:
            return None
        return MuonDimensionNumbers(tuple(a + stacked for a in reduction), tuple(a + stacked for a in output))

    return jax.tree_util.tree_map_with_path(dims, params)


def learning_rate_schedule(train_cfg):
    """Linear warm-up to the peak over `warmup_steps` (the first step already moves), then cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train_cfg.learning_rate, warmup_steps=max(train_cfg.warmup_steps, 1),
        decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
        end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio)
    return lambda step: schedule(step + 1)


def _decay_mask(params):
    """Weight decay on matrices only (not norms, biases, routing or embeddings' scale vectors)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def clipped(base: optax.GradientTransformation, clip_norm: float) -> optax.GradientTransformation:
    """`base` applied to the gradients scaled down to global norm at most `clip_norm` (the training run's
    and the RL learner's optimizers both clip first)."""
    return optax.chain(optax.clip_by_global_norm(clip_norm), base)


def make_optimizer(train_cfg, stage) -> optax.GradientTransformation:
    """The optimizer of `train_cfg`; parameters `stage` (`glm5_jax.train.stage.StageSpec`) freezes get no update."""
    schedule = learning_rate_schedule(train_cfg)
    if train_cfg.optimizer == "adamw":
        base = optax.adamw(schedule, b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                           mu_dtype=train_cfg.mu_dtype, weight_decay=train_cfg.weight_decay, mask=_decay_mask)
    else:
        base = muon(schedule, weight_decay=train_cfg.weight_decay, weight_decay_mask=_decay_mask,
                    adam_b1=train_cfg.b1, adam_b2=train_cfg.b2, adam_weight_decay=train_cfg.weight_decay,
                    adam_eps_root=0.0, eps=train_cfg.eps, mu_dtype=train_cfg.mu_dtype,
                    muon_weight_dimension_numbers=muon_dimension_numbers)
    train = clipped(base, train_cfg.clip_norm)
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()},
                                 stage.trainable_labels)
