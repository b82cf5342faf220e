"""Sampling with in-flight weight updates: a batch decoded one token per step, the weights swapped to a newer
policy version between two steps (PipelineRL, Piché et al. 2025; AReaL's interruptible generation, Fu et al.
2025; docs/rl.md#in-flight-weight-updates).

The rows of the latent cache written so far stay as they are (they were computed by the older version);
only the tokens sampled after the swap use the new weights. Each token records the version that sampled it
and its log-prob under that step's sampling distribution (the behaviour policy of that token), so the
learner's importance ratio is per token and its staleness bound too (`learner.mask_stale_tokens`).

Without a swap the tokens and log-probs are those of `glm5_jax.generate.decoding.generate`: the same prefill,
the same positions and the same key per step (fold_in(rng, step)). Shapes: B rows, T prompt width, N =
max_new_tokens.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.generate.decoding import PREFILL_CHUNK, Sampler, sampling_step, start_sampling
from glm5_jax.generate.settings import cache_slot_multiple, sampler_configs, step_variables
from glm5_jax.generate.on_mesh import place_prompts
from glm5_jax.model import routing_replay
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.mesh import mesh_and_rules

# newer(current version) -> (newer version, its variables) or None: asked between every two decode steps
NewerVersion = Callable[[int], "tuple[int, object] | None"]


class InflightResult(NamedTuple):
    tokens: np.ndarray           # int32 [B, N], 0 after each row's end
    lengths: np.ndarray          # int32 [B] tokens generated, EOS included
    logprobs: np.ndarray         # float32 [B, N] behaviour log-prob of each token (0 after the end)
    token_versions: np.ndarray   # int32 [B, N] the version that sampled each token (-1 after the end)
    # with cfg.runtime.capture_routing: the cache's recorded routing ({segment: {layer_i: {name: [repeats, B, S,
    # X]}}}, glm5_jax/model/routing_replay.py), else None
    routing: dict | None = None


@functools.lru_cache(maxsize=8)
def _programs(cfg, N: int, sampler: Sampler, chunk: int):
    """(prefill, step) jitted: `decoding.start_sampling` (the prompt rows and token 0) and
    `decoding.sampling_step` (step s: token s), the two halves of `generate`'s loop, one call per step; each
    with its model of `sampler_configs` (the step's takes the variables as `step_variables` gives them)."""
    prefill_cfg, step_cfg = sampler_configs(cfg)
    prefill = functools.partial(start_sampling, Transformer(prefill_cfg), sampler, N, chunk)
    step = functools.partial(sampling_step, Transformer(step_cfg), sampler)
    return jax.jit(prefill), jax.jit(step, donate_argnums=(1,))


def sample_inflight(cfg, mesh, rules, variables, version: int, prompt_tokens, prompt_lengths, *,
                    max_new_tokens: int, sampler: Sampler, rng, eos_ids=(), newer: NewerVersion = lambda v: None,
                    prefill_chunk: int = PREFILL_CHUNK) -> InflightResult:
    """Sample up to `max_new_tokens` per row starting with (`version`, `variables`); before each decode step
    `newer(current version)` may hand over a newer version, which samples every later token on the cache
    the older ones wrote. The prompts are padded and placed like `generate_on_mesh`'s."""
    if rng is None:
        if not sampler.greedy:
            raise ValueError("sampling with temperature > 0 needs an explicit rng key")
        rng = jax.random.key(0)
    eos = np.asarray(eos_ids, np.int32)
    N = int(max_new_tokens)
    tokens_BT, lengths_B, rows = place_prompts(prompt_tokens, prompt_lengths, mesh, rules, N, cache_slot_multiple(cfg))
    T = tokens_BT.shape[1]
    prefill, step = _programs(cfg, N, sampler, T if prefill_chunk == 0 else min(prefill_chunk, T))
    step_cfg = sampler_configs(cfg)[1]
    B = len(lengths_B)
    out_tokens, out_logprobs = np.zeros((B, N), np.int32), np.zeros((B, N), np.float32)
    out_versions = np.full((B, N), -1, np.int32)
    with mesh_and_rules(mesh, rules):
        cache, token, logprob = prefill(variables, tokens_BT, lengths_B, rng)
        decoding = step_variables(step_cfg, variables)     # what the step reads, once per weights version
        token_np = np.asarray(token)
        out_tokens[:, 0], out_logprobs[:, 0], out_versions[:, 0] = token_np, np.asarray(logprob), version
        done = np.isin(token_np, eos)
        count = np.ones(B, np.int32)
        for s in range(1, N):
            if done.all():
                break
            if (update := newer(version)) is not None:
                version, variables = update
                decoding = step_variables(step_cfg, variables)
            cache, token, logprob = step(decoding, cache, token, lengths_B, jnp.int32(s), rng)
            token_np, live = np.asarray(token), ~done
            out_tokens[:, s] = np.where(live, token_np, 0)
            out_logprobs[:, s] = np.where(live, np.asarray(logprob), 0.0)
            out_versions[:, s] = np.where(live, version, -1)
            count += live
            done |= np.isin(token_np, eos)
    routing = routing_replay.recorded(cache)
    if routing is not None:
        routing = jax.tree.map(lambda x: np.asarray(x)[:, :rows], routing)
    return InflightResult(out_tokens[:rows], count[:rows], out_logprobs[:rows], out_versions[:rows], routing)
