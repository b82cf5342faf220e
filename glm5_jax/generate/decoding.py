"""Batched generation over the latent decode cache, with exact sampling logprobs and MTP speculation.

    result = generate(cfg, variables, prompt_tokens_BT, prompt_lengths_B, max_new_tokens=64,
                      temperature=1.0, top_p=1.0, top_k=0, rng=jax.random.key(0), eos_ids=(1,))
    result.tokens [B, N], result.lengths [B], result.logprobs [B, N]

Prompts are right-padded; row b's prompt is ``prompt_tokens[b, :prompt_lengths[b]]``. One jitted
program runs the prefill and a ``lax.while_loop`` of decode steps over a static-size cache
(`glm5_jax.model.kv_cache`), stopping when every row has emitted an EOS id or ``max_new_tokens``.

The prefill runs ``prefill_chunk`` prompt tokens at a time (0: the whole prompt in one): each chunk
writes its rows into the cache and its queries attend to every slot written so far plus their own
chunk, with the DSA indexer scoring all of them, so activation memory is bounded by the chunk, not the
prompt. Logits are computed only at each row's last prompt token. The cache's slot axis is the logical
axis ``cache_seq`` (docs/long_context.md).

``logprobs`` are the log-probabilities of the sampled tokens under the distribution actually sampled
from: ``log_softmax(logits / temperature)`` restricted and renormalised to the top-k / top-p set. This is
what the RL learner's importance ratio needs (token-in, token-out). Greedy decoding (``temperature=0``)
samples from a point mass; there ``logprobs`` are those of the untempered model distribution instead.

``speculative=True`` (greedy only) drafts ``cfg.mtp_depth`` tokens with the MTP module, verifies them in
one forward of the main model and keeps the longest agreeing prefix plus the model's own next token, so
the output equals plain greedy decoding; ``result.acceptance_rate`` is accepted / drafted tokens.

CLI (an orbax checkpoint from train.py or the converter, and a tokenizer):

    python -m glm5_jax.generate --checkpoint=DIR --tokenizer=PATH --prompt="def main(" [--max_new_tokens=64]
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.generate.cache_layout import pin_cache_layout
from glm5_jax.generate.settings import (cache_slot_multiple, decode_config,  # noqa: F401 (decode_config: API)
                                        has_recurrent_layers, kernels_context, sampler_configs, step_variables)
from glm5_jax.model import routing_replay
from glm5_jax.model.kv_cache import constrain_cache, init_cache
from glm5_jax.model.transformer import Transformer

PREFILL_CHUNK = 4096   # default prompt tokens per prefill step


class GenerationResult(NamedTuple):
    tokens: jax.Array      # [B, max_new_tokens] int32, 0 after each row's end
    lengths: jax.Array     # [B] int32: new tokens per row, including a final EOS
    logprobs: jax.Array    # [B, max_new_tokens] fp32 sampling log-probs of `tokens`, 0 after the end
    drafted: jax.Array     # scalar int32: MTP draft tokens proposed to active rows (speculative only)
    accepted: jax.Array    # scalar int32: of those, accepted by the verifier
    # with RuntimeConfig.capture_routing: the recorded routing per slot, {segment: {layer_i: {name: [repeats, B,
    # S, X]}}} (slot = position; glm5_jax/model/routing_replay.py `extract` reads it per layer), else None
    routing: Any = None

    @property
    def acceptance_rate(self) -> float:
        drafted = int(self.drafted)
        return float(self.accepted) / drafted if drafted else float("nan")


def sampling_log_probs(logits, temperature, top_p, top_k):
    """Log-probabilities over the last axis of the distribution sampled from (-inf outside its support), fp32:
    ``log_softmax(logits / temperature)`` restricted and renormalised to the top-k, then the top-p set;
    for ``temperature == 0`` (greedy) the untempered ``log_softmax(logits)``.

    The settings are Python numbers (`Sampler`: static under jit, a step they switch off is not traced) or
    arrays of the logits' leading shape, one value per row (the server's slots: every step is traced and
    applied where the row's settings ask for it)."""
    logits = logits.astype(jnp.float32)
    static = all(isinstance(s, (int, float)) for s in (temperature, top_p, top_k))
    if static and temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    if not static:                       # one value per row, against the vocabulary axis
        temperature, top_p, top_k = (jnp.asarray(s)[..., None] for s in (temperature, top_p, top_k))
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    if not static or top_k:
        if static:
            kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        else:
            kth = jnp.take_along_axis(-jnp.sort(-scaled, axis=-1), jnp.clip(top_k - 1, 0, scaled.shape[-1] - 1),
                                      axis=-1)
        scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    if not static or top_p < 1:
        # keep the smallest set of most likely tokens whose mass reaches top_p (nucleus): a token stays
        # if the mass strictly before it (in descending order) is below top_p
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where((top_p < 1) & (scaled < cutoff), -jnp.inf, scaled)
    log_p = jax.nn.log_softmax(scaled, axis=-1)
    return log_p if static else jnp.where(greedy, jax.nn.log_softmax(logits, axis=-1), log_p)


@dataclasses.dataclass(frozen=True)
class Sampler:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self, vocab_size: int):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k={self.top_k}: must be in [0, vocab_size={vocab_size}] (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def log_probs(self, logits_BV):
        """Log-probabilities of the sampling distribution (-inf outside its support), fp32."""
        return sampling_log_probs(logits_BV, self.temperature, self.top_p, self.top_k)

    def sample(self, logits_BV, rng):
        """(tokens [B], their log-probs [B]) under the sampling distribution."""
        logp = self.log_probs(logits_BV)
        if self.greedy:
            tokens = jnp.argmax(logp, axis=-1)
        else:
            tokens = jax.random.categorical(rng, logp, axis=-1)
        return tokens.astype(jnp.int32), jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def generate(cfg, variables, prompt_tokens, prompt_lengths, *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, rng=None, eos_ids=(), speculative: bool = False,
             cache_dtype=None, prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per row (see the module docstring)."""
    fn, args = prepare_generate(cfg, variables, prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_p=top_p, top_k=top_k, rng=rng, eos_ids=eos_ids,
                                speculative=speculative, cache_dtype=cache_dtype, prefill_chunk=prefill_chunk)
    with kernels_context(cfg):
        return fn(*args)


def prepare_generate(cfg, variables, prompt_tokens, prompt_lengths, *, max_new_tokens: int, temperature=1.0,
                     top_p=1.0, top_k=0, rng=None, eos_ids=(), speculative=False, cache_dtype=None,
                     prefill_chunk=PREFILL_CHUNK):
    """Validate the request; return (jitted program, its arguments) so callers can compile it ahead. With
    ``sampler_kernels`` the program traces under a mesh: the caller's, or `settings.kernels_context(cfg)`'s."""
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens: expected [batch, time], got shape {prompt_tokens.shape}")
    B, T = prompt_tokens.shape
    if prompt_lengths.shape != (B,):
        raise ValueError(f"prompt_lengths: expected shape ({B},), got {prompt_lengths.shape}")
    lengths_np = np.asarray(prompt_lengths)
    if lengths_np.min() < 1 or lengths_np.max() > T:
        raise ValueError(f"prompt_lengths must be in [1, {T}], got {lengths_np.tolist()}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk={prefill_chunk}: must be >= 0 (0 = the whole prompt at once)")
    sampler = Sampler(float(temperature), float(top_p), int(top_k))
    sampler.validate(cfg.vocab_size)
    if speculative:
        if not (cfg.num_nextn_predict_layers and cfg.mtp_depth >= 1):
            raise ValueError("speculative=True needs a model with an MTP module (num_nextn_predict_layers=1, "
                             "mtp_depth >= 1)")
        if not sampler.greedy:
            raise ValueError("speculative=True is implemented for greedy decoding (temperature=0) only")
        if cfg.runtime.capture_routing:
            raise ValueError("capture_routing records the main stack's routing per sampled token: not with "
                             "speculative=True (drafts are verified in windows)")
    sampler_configs(cfg)         # raises on settings the decode kernels do not run
    if rng is None:
        if not sampler.greedy:
            raise ValueError("sampling with temperature > 0 needs an explicit rng key")
        rng = jax.random.key(0)
    # positions run to the longest prompt's end + the new tokens (a layout-padded width is not a position)
    longest = int(lengths_np.max())
    max_position = longest + max_new_tokens + (cfg.mtp_depth if speculative else 0)
    if max_position > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    chunk = T if prefill_chunk == 0 else min(int(prefill_chunk), T)
    fn = _compiled(decode_config(cfg), int(max_new_tokens), sampler, tuple(int(e) for e in eos_ids),
                   bool(speculative), None if cache_dtype is None else jnp.dtype(cache_dtype).name, chunk)
    return fn, (variables, prompt_tokens, prompt_lengths, rng)


@functools.lru_cache(maxsize=32)
def _compiled(cfg, max_new_tokens, sampler, eos_ids, speculative, cache_dtype, chunk):
    loop = _speculative_loop if speculative else _sampling_loop
    return jax.jit(functools.partial(loop, cfg, max_new_tokens, sampler, eos_ids, cache_dtype, chunk))


def _is_eos(tokens, eos_ids):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _chunk_start(c, T, C):
    """First position of prefill chunk c of ceil(T / C): c * C, except that the last chunk ends at T
    (it may overlap its predecessor, whose rows it then rewrites with the same values)."""
    return jnp.minimum(c * C, T - C).astype(jnp.int32)


def prefill_slots(cfg, T, C) -> int:
    """Cache slots the prefill of a T-token prompt in chunks of C writes."""
    return -(-T // C) * C if has_recurrent_layers(cfg) else T


def _prefill(model, variables, prompt_BT, lengths_B, cache, C, mtp_cache=None):
    """Write every prompt row into ``cache`` in chunks of C tokens.

    Returns (logits [B, V] at each row's last prompt token, cache, mtp). Without ``mtp_cache`` mtp is
    None; with it, every chunk also runs the K MTP depths over itself (depth d at position j takes the
    prompt token at j + d) and mtp = (mtp_cache, h_tail [B, K, D]): the main model's hidden state at
    positions max(L - K, 0) .. + K - 1 (L = the row's length). Depth d's slots from L - d on need tokens
    past the prompt, which only the first sampled token and the drafts give; `_mtp_window` rewrites them.
    """
    if has_recurrent_layers(model.cfg):
        prompt_BT = jnp.pad(prompt_BT, ((0, 0), (0, prefill_slots(model.cfg, prompt_BT.shape[1], C)
                                                  - prompt_BT.shape[1])))
    B, T = prompt_BT.shape
    last_B = lengths_B - 1
    with_mtp = mtp_cache is not None
    K = len(mtp_cache) if with_mtp else 0
    prompt_pad = jnp.pad(prompt_BT, ((0, 0), (0, K)))
    tail_start_B = jnp.maximum(lengths_B - K, 0)
    window = jnp.arange(C, dtype=jnp.int32)

    def chunk(c, carry):
        cache, last_logits, mtp = carry
        start = _chunk_start(c, T, C)     # T: a multiple of C for a recurrent model, so c * C
        tokens = jax.lax.dynamic_slice_in_dim(prompt_BT, start, C, axis=1)
        positions = jnp.broadcast_to(start + window, (B, C))
        segments = (positions < lengths_B[:, None]).astype(jnp.int32)
        logits_at = jnp.clip(last_B - start, 0, C - 1)[:, None]
        logits, h, cache = model.apply(variables, tokens, positions, segments, cache, logits_at=logits_at,
                                       method=Transformer.decode)
        here = (last_B >= start) & (last_B < start + C)
        last_logits = jnp.where(here[:, None], logits[:, 0], last_logits)
        if with_mtp:
            mtp_cache, h_tail = mtp
            tail_index = tail_start_B[:, None] + jnp.arange(K) - start                     # [B, K]
            in_chunk = (tail_index >= 0) & (tail_index < C)
            h_tail = jnp.where(in_chunk[..., None],
                               jnp.take_along_axis(h, jnp.clip(tail_index, 0, C - 1)[..., None], axis=1),
                               h_tail).astype(h_tail.dtype)
            new_mtp, h_d = [], h
            for d in range(1, K + 1):
                next_tokens = jax.lax.dynamic_slice_in_dim(prompt_pad, start + d, C, axis=1)
                h_d, _, cache_d = model.apply(variables, h_d, next_tokens, positions, segments, mtp_cache[d - 1],
                                              logits_at=jnp.zeros((B, 1), jnp.int32), method=Transformer.mtp_decode)
                new_mtp.append(constrain_cache(cache_d))
            mtp = (tuple(new_mtp), h_tail)
        return constrain_cache(cache), last_logits, mtp

    D = model.cfg.hidden_size
    mtp = (constrain_cache(mtp_cache), jnp.zeros((B, K, D), model.cfg.jnp_dtype)) if with_mtp else None
    last_logits = jnp.zeros((B, model.cfg.vocab_size), jnp.float32)
    cache, last_logits, mtp = jax.lax.fori_loop(0, -(-T // C), chunk, (constrain_cache(cache), last_logits, mtp))
    return last_logits, cache, mtp


def cache_slots(cfg, T, N, chunk) -> int:
    """Cache slots of a sampler over T-token prompts and N new tokens, prefilled in chunks of ``chunk``: what the
    prefill writes and the decode steps read (`settings.cache_slot_multiple`)."""
    multiple = cache_slot_multiple(cfg)
    return -(-max(T + N, prefill_slots(cfg, T, chunk)) // multiple) * multiple


def start_sampling(model, sampler, N, chunk, variables, prompt_BT, lengths_B, rng, cache_dtype=None):
    """A cache for the prompts and N new tokens, the prompts prefilled in chunks of ``chunk``, and token 0
    sampled with key fold_in(rng, 0) -> (cache, token [B], log-prob [B])."""
    B, T = prompt_BT.shape
    cache = init_cache(model.cfg, B, cache_slots(model.cfg, T, N, chunk), cache_dtype)["decoder"]
    last_logits, cache, _ = _prefill(model, variables, prompt_BT, lengths_B, cache, chunk)
    return (cache, *sampler.sample(last_logits, jax.random.fold_in(rng, 0)))


def sampling_step(model, sampler, variables, cache, token_B, lengths_B, step, rng):
    """Decode step s: feed token s - 1 at position length + s - 1, sample token s with key fold_in(rng, s)
    -> (cache, token [B], log-prob [B]). ``model``: the sampler's step model (`sampler_configs`), ``variables``
    as it reads them (`step_variables`)."""
    positions = (lengths_B + step - 1)[:, None]
    logits, _, cache = model.apply(variables, token_B[:, None], positions, jnp.ones_like(positions),
                                   pin_cache_layout(model.cfg, cache), method=Transformer.decode)
    return (pin_cache_layout(model.cfg, constrain_cache(cache)),
            *sampler.sample(logits[:, 0], jax.random.fold_in(rng, step)))


def _sampling_loop(cfg, N, sampler, eos_ids, cache_dtype, chunk, variables, prompt_BT, lengths_B, rng):
    """Prefill, then one token per step (`sampling_step`) until every row has ended or N tokens."""
    prefill_cfg, step_cfg = sampler_configs(cfg)
    model, step_model = Transformer(prefill_cfg), Transformer(step_cfg)
    B = prompt_BT.shape[0]
    cache, token, logprob = start_sampling(model, sampler, N, chunk, variables, prompt_BT, lengths_B, rng,
                                           cache_dtype)
    variables = step_variables(step_cfg, variables)      # once per program
    out_tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(token)
    out_logprobs = jnp.zeros((B, N), jnp.float32).at[:, 0].set(logprob)
    done = _is_eos(token, eos_ids)
    count = jnp.ones((B,), jnp.int32)

    def cond(state):
        step, _, _, _, _, _, done = state
        return (step < N) & ~jnp.all(done)

    def body(state):
        step, token, cache, out_tokens, out_logprobs, count, done = state
        cache, token, logprob = sampling_step(step_model, sampler, variables, cache, token, lengths_B, step, rng)
        live = ~done
        out_tokens = out_tokens.at[:, step].set(jnp.where(live, token, 0))
        out_logprobs = out_logprobs.at[:, step].set(jnp.where(live, logprob, 0.0))
        count = count + live
        done = done | _is_eos(token, eos_ids)
        return step + 1, token, cache, out_tokens, out_logprobs, count, done

    state = (jnp.int32(1), token, cache, out_tokens, out_logprobs, count, done)
    _, _, cache, out_tokens, out_logprobs, count, _ = jax.lax.while_loop(cond, body, state)
    zero = jnp.int32(0)
    return GenerationResult(out_tokens, count, out_logprobs, zero, zero, routing_replay.recorded(cache))


def _mtp_drafts(model, variables, K, h_BWD, known_BW, anchor_B, positions_BW, segments_BW, mtp_cache):
    """K greedy draft tokens following each row's anchor position, one MTP depth at a time.

    Depth d at window index j combines depth d-1's hidden state there with the embedding of the token at
    position j + d (docs/architecture.md#mtp): a known token when that position is at most anchor + 1, else an earlier
    depth's draft. ``known_BW[:, j]`` is the token at window index j + 1 (valid up to the anchor).
    Running every depth over the whole window also writes each depth's cache for these positions.
    """
    W = known_BW.shape[1]
    drafts, new_cache, h = [], [], h_BWD
    anchor = anchor_B[:, None]
    for d in range(1, K + 1):
        i = jnp.arange(W)[None, :] + d - 1                       # index into [known..., drafts...]
        next_tokens = jnp.take_along_axis(known_BW, jnp.broadcast_to(jnp.minimum(i, W - 1), known_BW.shape), 1)
        if drafts:
            draft_BD = jnp.stack(drafts, axis=1)
            from_drafts = jnp.take_along_axis(draft_BD, jnp.clip(i - anchor - 1, 0, d - 2), axis=1)
            next_tokens = jnp.where(i <= anchor, next_tokens, from_drafts)
        h, logits, cache_d = model.apply(variables, h, next_tokens, positions_BW, segments_BW, mtp_cache[d - 1],
                                         method=Transformer.mtp_decode)
        new_cache.append(constrain_cache(cache_d))
        drafts.append(jnp.argmax(jnp.take_along_axis(logits, anchor[:, :, None], axis=1)[:, 0], -1)
                      .astype(jnp.int32))
    return jnp.stack(drafts, axis=1), tuple(new_cache)


def _mtp_window(model, variables, prompt_BT, lengths_B, token_B, h_tail_BKD, mtp_cache):
    """The first drafts after the prompt: `_mtp_drafts` over the K positions ending at each row's last
    prompt token, which (re)writes every MTP slot whose input is past the prompt (see `_prefill`)."""
    K = h_tail_BKD.shape[1]
    start_B = jnp.maximum(lengths_B - K, 0)
    positions_BW = start_B[:, None] + jnp.arange(K, dtype=jnp.int32)
    segments_BW = (positions_BW < lengths_B[:, None]).astype(jnp.int32)
    # the token after window index j (position j + 1): the prompt's, then the first generated token
    prompt_next = jnp.take_along_axis(jnp.pad(prompt_BT, ((0, 0), (0, K + 1))), positions_BW + 1, axis=1)
    known_BW = jnp.where(positions_BW + 1 == lengths_B[:, None], token_B[:, None], prompt_next)
    return _mtp_drafts(model, variables, K, h_tail_BKD, known_BW, lengths_B - 1 - start_B, positions_BW,
                       segments_BW, mtp_cache)


def _speculative_loop(cfg, N, sampler, eos_ids, cache_dtype, chunk, variables, prompt_BT, lengths_B, rng):
    """Greedy MTP speculation: verify [pending, d_1..d_K] in one forward, keep the agreeing prefix. The verify
    windows run the sampler's step model (`sampler_configs`); the prompt and the MTP drafts the prefill's."""
    del rng
    prefill_cfg, step_cfg = sampler_configs(cfg)
    model, step_model = Transformer(prefill_cfg), Transformer(step_cfg)
    K = cfg.mtp_depth
    B, T = prompt_BT.shape
    caches = init_cache(prefill_cfg, B, cache_slots(prefill_cfg, T, N + K, chunk), cache_dtype, mtp=True)
    last_logits, cache, (mtp_cache, h_tail) = _prefill(model, variables, prompt_BT, lengths_B, caches["decoder"],
                                                       chunk, caches["mtp"])
    token, logprob = sampler.sample(last_logits, None)
    drafts, mtp_cache = _mtp_window(model, variables, prompt_BT, lengths_B, token, h_tail, mtp_cache)
    step_vars = step_variables(step_cfg, variables)      # once per program
    width = N + K + 1                                             # room for a full window past N
    out_tokens = jnp.zeros((B, width), jnp.int32).at[:, 0].set(token)
    out_logprobs = jnp.zeros((B, width), jnp.float32).at[:, 0].set(logprob)
    done = _is_eos(token, eos_ids) | (N == 1)
    count = jnp.ones((B,), jnp.int32)
    window = jnp.arange(K + 1, dtype=jnp.int32)
    ones = jnp.ones((B, K + 1), jnp.int32)

    def cond(state):
        return ~jnp.all(state[-3])

    def body(state):
        pending, pos, drafts, cache, mtp_cache, out_tokens, out_logprobs, count, done, drafted, accepted = state
        tokens_W = jnp.concatenate([pending[:, None], drafts], axis=1)         # [B, K+1] at pos .. pos + K
        positions_W = pos[:, None] + window
        logits, h, cache = step_model.apply(step_vars, tokens_W, positions_W, ones, pin_cache_layout(step_cfg, cache),
                                            method=Transformer.decode)
        cache = pin_cache_layout(step_cfg, constrain_cache(cache))
        logp = sampler.log_probs(logits)
        target = jnp.argmax(logp, axis=-1).astype(jnp.int32)                  # model's token after each slot
        target_logp = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        n_accept = jnp.sum(jnp.cumprod(drafts == target[:, :K], axis=1), axis=1).astype(jnp.int32)
        # emit target[:, :n_accept + 1], cut after the first EOS and at N tokens; finished rows emit nothing
        emit = n_accept + 1
        eos_hit = _is_eos(target, eos_ids) & (window[None] < emit[:, None])
        emit = jnp.where(jnp.any(eos_hit, 1), jnp.argmax(eos_hit, 1) + 1, emit)
        emit = jnp.where(done, 0, jnp.minimum(emit, N - count))
        keep = window[None] < emit[:, None]

        def write(buf, new, start, keep):
            old = jax.lax.dynamic_slice_in_dim(buf, start, K + 1)
            return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, new, old), start, 0)

        out_tokens = jax.vmap(write)(out_tokens, target, count, keep)
        out_logprobs = jax.vmap(write)(out_logprobs, target_logp, count, keep)
        live = ~done
        drafted = drafted + jnp.sum(jnp.where(live, K, 0))
        accepted = accepted + jnp.sum(jnp.where(live, n_accept, 0))
        count = count + emit
        done = done | jnp.any(eos_hit & keep, 1) | (count >= N)
        new_pending = jnp.take_along_axis(target, n_accept[:, None], 1)[:, 0]
        new_drafts, mtp_cache = _mtp_drafts(model, variables, K, h, target, n_accept, positions_W, ones, mtp_cache)
        pending = jnp.where(live, new_pending, pending)
        drafts = jnp.where(live[:, None], new_drafts, drafts)
        pos = jnp.where(live, pos + n_accept + 1, pos)
        return pending, pos, drafts, cache, mtp_cache, out_tokens, out_logprobs, count, done, drafted, accepted

    zero = jnp.int32(0)
    state = (token, lengths_B, drafts, cache, mtp_cache, out_tokens, out_logprobs, count, done, zero, zero)
    state = jax.lax.while_loop(cond, body, state)
    out_tokens, out_logprobs, count, drafted, accepted = state[5], state[6], state[7], state[9], state[10]
    keep = jnp.arange(N)[None] < count[:, None]
    return GenerationResult(jnp.where(keep, out_tokens[:, :N], 0), count,
                            jnp.where(keep, out_logprobs[:, :N], 0.0), drafted, accepted)
