"""The MoE router's choice from its scores in plain XLA (GLM-5 / DeepSeek-V3 without expert groups): the oracle
for kernel.py, the computation of glm5_jax/model/moe/layer.route at ``n_group`` 1.

Shapes: scores [N, E] (sigmoid of the router logits, fp32), bias [E] (the selection-only correction) -> (idx
[N, K] int32: the K largest scores + bias, largest first, ties to the lower expert; gates [N, K] fp32: the
unbiased scores there, normalised to sum 1 when ``normalize``, times ``scale``).
"""
import jax
import jax.numpy as jnp


def route_topk(scores_NE, bias_E, *, top_k: int, normalize: bool, scale: float):
    _, idx = jax.lax.top_k(scores_NE + bias_E, top_k)
    gates = jnp.take_along_axis(scores_NE, idx, axis=-1)
    if normalize:
        gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), gates * scale
