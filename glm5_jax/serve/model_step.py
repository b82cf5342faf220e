"""The one place the serving engine calls the model: a forward over the decode cache.

Everything in `glm5_jax.serve` goes through `decode_logits`, so a change to `Transformer.decode`'s
signature or return type is adapted here only.
"""
from __future__ import annotations

from glm5_jax.model.transformer import Transformer


def decode_logits(model: Transformer, variables, tokens_BT, positions_BT, segment_ids_BT, cache, logits_at=None):
    """(logits [B, T, V] fp32, updated decoder cache) for tokens at the given positions; with
    ``logits_at`` [B, X] the logits at those token indices only ([B, X, V])."""
    logits, _, cache = model.apply(variables, tokens_BT, positions_BT, segment_ids_BT, cache,
                                   logits_at=logits_at, method=Transformer.decode)
    return logits, cache
