"""Per-row sampling for a batch whose rows belong to different requests, and the server's decode step over every
slot of its cache (`decode_slots`: glm5_jax/serve/engine.py runs it; the decode compile report costs it), both
through `decode_logits`.

`glm5_jax.generate.decoding.Sampler` fixes temperature / top-p / top-k for the whole batch (they are static
under jit); here they are arrays [B], one value per slot, under the same rule
(`glm5_jax.generate.decoding.sampling_log_probs`): the log-probabilities of ``log_softmax(logits /
temperature)`` restricted and renormalised to the top-k, then top-p set, and for ``temperature == 0``
(greedy) those of the untempered model distribution. Each row draws with its own
key, folded with its token index, so a seeded request samples the same tokens whatever else is running.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.generate.cache_layout import pin_cache_layout
from glm5_jax.generate.decoding import sampling_log_probs
from glm5_jax.model.transformer import Transformer

NUM_TOP_LOGPROBS = 20          # alternatives computed per token (OpenAI allows up to 20)


def sample_rows(logits_BV, temperature_B, top_p_B, top_k_B, key_data_BK, index_B, num_top: int):
    """(tokens [B], their log-probs [B], top ids [B, num_top], top log-probs [B, num_top]).

    ``key_data_BK`` are raw PRNG keys (``jax.random.key_data``); row b draws with ``fold_in(key_b, index_b)``.
    """
    def one(logits, temperature, top_p, top_k, key_data, index):
        logp = sampling_log_probs(logits, temperature, top_p, top_k)
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), index)
        token = jnp.where(temperature == 0, jnp.argmax(logp), jax.random.categorical(key, logp)).astype(jnp.int32)
        top_logp, top_ids = jax.lax.top_k(logp, num_top)
        return token, logp[token], top_ids.astype(jnp.int32), top_logp
    return jax.vmap(one)(logits_BV, temperature_B, top_p_B, top_k_B, key_data_BK, index_B)


def decode_logits(model: Transformer, variables, tokens_BT, positions_BT, segment_ids_BT, cache, logits_at=None):
    """(logits [B, T, V] fp32, updated decoder cache) for tokens at the given positions; with ``logits_at`` [B, X]
    the logits at those token indices only ([B, X, V]). The one place the server calls the model (its prefill and
    `decode_slots`), so a change to `Transformer.decode`'s signature or return type is adapted here only."""
    logits, _, cache = model.apply(variables, tokens_BT, positions_BT, segment_ids_BT, cache,
                                   logits_at=logits_at, method=Transformer.decode)
    return logits, cache


def decode_slots(model, num_top, variables, cache, tokens_B, positions_B, temperature_B, top_p_B, top_k_B,
                 key_data_BK, index_B):
    """One token for every slot at its own position -> (cache, `sample_rows` of the logits). ``model``: the sampler's
    step model (glm5_jax/generate/settings.py `sampler_configs`), ``variables`` as `step_variables` gives them; the
    server sits inactive slots at a spare position no query sees."""
    ones = jnp.ones_like(tokens_B)[:, None]
    logits, cache = decode_logits(model, variables, tokens_B[:, None], positions_B[:, None], ones,
                                  pin_cache_layout(model.cfg, cache))
    return pin_cache_layout(model.cfg, cache), sample_rows(logits[:, 0], temperature_B, top_p_B, top_k_B,
                                                           key_data_BK, index_B, num_top)
