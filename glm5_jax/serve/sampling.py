"""Per-row sampling for a batch whose rows belong to different requests.

`glm5_jax.generate.decoding.Sampler` fixes temperature / top-p / top-k for the whole batch (they are static
under jit); here they are arrays [B], one value per slot, with the same semantics: the log-probabilities
of ``log_softmax(logits / temperature)`` restricted and renormalised to the top-k, then top-p set, and for
``temperature == 0`` (greedy) those of the untempered model distribution. Each row draws with its own
key, folded with its token index, so a seeded request samples the same tokens whatever else is running.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_log_probs(logits_V, temperature, top_p, top_k):
    """Sampling log-probs of one row (-inf outside the support), fp32."""
    logits = logits_V.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    kth = jnp.sort(scaled)[::-1][jnp.clip(top_k - 1, 0, V - 1)]
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    # nucleus: keep a token if the mass strictly before it (descending order) is below top_p
    sorted_desc = jnp.sort(scaled)[::-1]
    probs = jax.nn.softmax(sorted_desc)
    mass_before = jnp.cumsum(probs) - probs
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf))
    scaled = jnp.where((top_p < 1) & (scaled < cutoff), -jnp.inf, scaled)
    return jnp.where(greedy, jax.nn.log_softmax(logits), jax.nn.log_softmax(scaled))


def sample_rows(logits_BV, temperature_B, top_p_B, top_k_B, key_data_BK, index_B, num_top: int):
    """(tokens [B], their log-probs [B], top ids [B, num_top], top log-probs [B, num_top]).

    ``key_data_BK`` are raw PRNG keys (``jax.random.key_data``); row b draws with ``fold_in(key_b, index_b)``.
    """
    def one(logits, temperature, top_p, top_k, key_data, index):
        logp = row_log_probs(logits, temperature, top_p, top_k)
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), index)
        token = jnp.where(temperature == 0, jnp.argmax(logp), jax.random.categorical(key, logp)).astype(jnp.int32)
        top_logp, top_ids = jax.lax.top_k(logp, num_top)
        return token, logp[token], top_ids.astype(jnp.int32), top_logp
    return jax.vmap(one)(logits_BV, temperature_B, top_p_B, top_k_B, key_data_BK, index_B)
