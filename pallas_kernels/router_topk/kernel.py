"""Pallas TPU kernel: the MoE router's top-k choice and gates from its scores in one call (the computation:
reference.py).

At decode batch 1 XLA runs the router's choice as ~8 top-level ops a layer (the top-k, the gather of the chosen
scores, their sum, the normalisation and the scale, each a fixed cost far above its bytes). Here one grid step
holds the [N, E] scores (N a few tokens, E lanes): K rounds of a lane max, the lowest lane holding it (XLA's
top-k order: ties to the lower index), that lane's unbiased score, and the lane masked out; then the gates'
normalisation. The selection compares the same fp32 values as XLA's top-k (scores + bias, one add), so it
picks the same experts; the gates' sum may round differently in the last place.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NAME = "router_topk"
MAX_TOKENS = 64


def _kernel(scores_ref, bias_ref, idx_ref, gates_ref, *, top_k, normalize, scale):
    scores = scores_ref[...]                                                    # [N, E] fp32
    N, E = scores.shape
    lane = jax.lax.broadcasted_iota(jnp.int32, (N, E), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (N, top_k), 1)
    biased = scores + bias_ref[...]
    idx = jnp.zeros((N, top_k), jnp.int32)
    gates = jnp.zeros((N, top_k), jnp.float32)
    for k in range(top_k):
        best = jnp.max(biased, axis=1, keepdims=True)
        at = jnp.min(jnp.where(biased == best, lane, E), axis=1, keepdims=True)      # [N, 1]
        chosen = lane == at
        score = jnp.sum(jnp.where(chosen, scores, 0.0), axis=1, keepdims=True)
        idx = jnp.where(slot == k, at, idx)
        gates = jnp.where(slot == k, score, gates)
        biased = jnp.where(chosen, -jnp.inf, biased)
    if normalize:
        gates = gates / (jnp.sum(gates, axis=1, keepdims=True) + 1e-20)
    idx_ref[...] = idx
    gates_ref[...] = gates * scale


def route_topk(scores_NE, bias_E, *, top_k: int, normalize: bool, scale: float, interpret=False):
    """(idx [N, K] int32, gates [N, K] fp32) (reference.py); N <= `MAX_TOKENS` tokens in one grid step."""
    N, E = scores_NE.shape
    if bias_E.shape != (E,) or not 0 < top_k <= E or N > MAX_TOKENS:
        raise ValueError(f"router_topk: want scores [N <= {MAX_TOKENS}, E], bias [E], 0 < top_k <= E; got scores "
                         f"{scores_NE.shape}, bias {bias_E.shape}, top_k {top_k}")
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))                 # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, normalize=normalize, scale=float(scale)),
        grid=(1,),
        in_specs=[whole((N, E)), whole((1, E))],
        out_specs=[whole((N, top_k)), whole((N, top_k))],
        out_shape=[jax.ShapeDtypeStruct((N, top_k), jnp.int32), jax.ShapeDtypeStruct((N, top_k), jnp.float32)],
        interpret=interpret,
        name=NAME,
        # K rounds over the scores (max, lowest lane, the chosen score, the mask): ~6 vector ops an element
        cost_estimate=pl.CostEstimate(flops=6 * top_k * N * E, transcendentals=0,
                                      bytes_accessed=4 * (N * E + E + 2 * N * top_k)),
    )(scores_NE.astype(jnp.float32), bias_E.astype(jnp.float32).reshape(1, E))
