"""TEMPORARY fallback sampler behind the exact signature of `glm5_jax.generate.generate` (DELETE when
glm5_jax/generate.py lands on main: then `sample` calls it instead).

It recomputes a full forward pass per new token (no KV cache): correct, slow for long outputs, fine
for the 7-token sort answers. Log-probs are those of the distribution actually sampled from:
log_softmax(logits / temperature) renormalised over the top-k / top-p set.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.model import Transformer
from glm5_jax.rl.policy import sequence_layout

_project_generate = None
# the real KV-cache sampler, once it is on this branch (checked by file: the editable install's finder
# would otherwise import another checkout's glm5_jax/generate.py)
if os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "generate.py")):
    from glm5_jax.generate import generate as _project_generate


class Generation(NamedTuple):
    tokens: jax.Array     # int32 [B, max_new_tokens], 0 after each row's end
    lengths: jax.Array    # int32 [B] new tokens incl. EOS
    logprobs: jax.Array   # float32 [B, max_new_tokens], 0 after each row's end


def filter_logits(logits_BV, top_k: int, top_p: float):
    """Logits with everything outside the top-k and the top-p nucleus set to -inf."""
    if top_k:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    if top_p < 1.0:
        sorted_desc = -jnp.sort(-logits_BV, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs            # mass strictly before each sorted token
        cutoff = jnp.min(jnp.where(before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff, -jnp.inf, logits_BV)
    return logits_BV


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature", "top_p", "top_k", "eos_ids"))
def _full_forward_generate(cfg, variables, prompt_tokens, prompt_lengths, rng, *, max_new_tokens, temperature,
                           top_p, top_k, eos_ids):
    model = Transformer(cfg)
    B = prompt_tokens.shape[0]
    C = max_new_tokens
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def step(i, carry):
        tokens_BC, logp_BC, lengths_B, done_B = carry
        seq, seg, predict_at = sequence_layout(prompt_tokens, prompt_lengths, tokens_BC, lengths_B)
        logits = model.apply(variables, seq, segment_ids=seg)
        logits_BV = jnp.take_along_axis(logits, predict_at[:, i, None, None], axis=1)[:, 0].astype(jnp.float32)
        logits_BV = filter_logits(logits_BV / temperature, top_k, top_p)
        token_B = jax.random.categorical(jax.random.fold_in(rng, i), logits_BV).astype(jnp.int32)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), token_B[:, None], 1)[:, 0]
        live = ~done_B
        tokens_BC = tokens_BC.at[:, i].set(jnp.where(live, token_B, 0))
        logp_BC = logp_BC.at[:, i].set(jnp.where(live, logp_B, 0.0))
        lengths_B = lengths_B + live.astype(jnp.int32)
        done_B = done_B | (live & jnp.isin(token_B, eos))
        return tokens_BC, logp_BC, lengths_B, done_B

    init = (jnp.zeros((B, C), jnp.int32), jnp.zeros((B, C), jnp.float32), jnp.zeros((B,), jnp.int32),
            jnp.zeros((B,), bool))
    tokens, logp, lengths, _ = jax.lax.fori_loop(0, C, step, init)
    return Generation(tokens, lengths, logp)


def generate(cfg, variables, prompt_tokens, prompt_lengths, *, max_new_tokens: int, temperature=1.0, top_p=1.0,
             top_k=0, rng, eos_ids=(), speculative=False):
    """Same contract as glm5_jax.generate.generate (see module docstring)."""
    if _project_generate is not None:
        return _project_generate(cfg, variables, prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, top_k=top_k, rng=rng, eos_ids=eos_ids,
                                 speculative=speculative)
    if speculative:
        raise NotImplementedError("the fallback sampler has no speculative decoding")
    return _full_forward_generate(cfg, variables, jnp.asarray(prompt_tokens, jnp.int32),
                                  jnp.asarray(prompt_lengths, jnp.int32), rng, max_new_tokens=max_new_tokens,
                                  temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                                  eos_ids=tuple(int(e) for e in eos_ids))
