"""Chunked prefill and a sequence-sharded decode cache compute what a full forward computes.

A prompt of several chunks, far longer than index_topk = 8, so each chunk's DSA top-k is a real selection
over the slots earlier chunks wrote; two rows of different lengths in one batch.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax import Transformer
from glm5_jax.generate import decoding as gen
from glm5_jax.model.kv_cache import cache_shardings, constrain_cache, init_cache
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from tests.generate.tiny_models import TINY, full_logits, init_variables

TOL = 1e-5
CHUNK = 16
LENGTHS = np.array([37, 50])      # 3 and 4 chunks of 16 (the last one overlaps its predecessor)
STEPS = 4                         # decode steps after the prompt
SLOTS = 64                        # cache slots: >= 50 + STEPS, and a multiple of the 4 sequence shards below


def sequences(cfg, seed=0):
    return np.random.default_rng(seed).integers(2, cfg.vocab_size, (2, LENGTHS.max() + STEPS)).astype(np.int32)


def prefill_then_decode(cfg, chunk, lengths=LENGTHS, steps=STEPS, slots=SLOTS, mesh_rules=None):
    """Logits [B, 1 + steps, V]: at each row's last prompt token (chunked prefill), then after each decode
    step feeding the sequence's next token; and the final cache. ``mesh_rules``: (mesh, rules) to lay the
    cache out by (the weights are replicated)."""
    cfg = gen.decode_config(cfg)
    variables = init_variables(TINY)
    seq = sequences(cfg)
    B, T = 2, int(lengths.max())
    prompt = np.where(np.arange(T)[None] < lengths[:, None], seq[:, :T], 0)
    model = Transformer(cfg)
    cache = init_cache(cfg, B, slots)["decoder"]
    if mesh_rules is not None:
        mesh, rules = mesh_rules
        variables = jax.device_put(variables, NamedSharding(mesh, P()))
        cache = jax.device_put(cache, cache_shardings(cache, mesh, rules))
    prefill = jax.jit(lambda v, p, n, c: gen._prefill(model, v, p, n, c, chunk)[:2])
    step = jax.jit(lambda v, t, p, c: (lambda out: (out[0], constrain_cache(out[2])))(
        model.apply(v, t, p, jnp.ones_like(t), c, method=Transformer.decode)))
    last, cache = prefill(variables, prompt, jnp.asarray(lengths, jnp.int32), cache)
    out = [np.asarray(last)]
    for s in range(steps):
        pos = (lengths + s).astype(np.int32)
        logits, cache = step(variables, seq[np.arange(B), pos][:, None], pos[:, None], cache)
        out.append(np.asarray(logits)[:, 0])
    return np.stack(out, 1), cache


def want_logits(lengths=LENGTHS, steps=STEPS):
    full = np.asarray(full_logits(TINY, init_variables(TINY), sequences(TINY)))
    return np.stack([full[b, lengths[b] - 1:lengths[b] + steps] for b in range(2)])


@functools.lru_cache(maxsize=1)
def chunked_xla():
    return prefill_then_decode(TINY, CHUNK)


def test_chunked_prefill_and_decode_match_full_forward():
    got, _ = chunked_xla()
    np.testing.assert_allclose(got, want_logits(), atol=TOL, rtol=0)


def test_chunked_prefill_with_pallas_kernels_matches_full_forward():
    """The Pallas indexer and sparse-attention kernels (interpreter) take multi-token chunks over the cache."""
    lengths, steps = np.array([13, 22]), 2
    got, _ = prefill_then_decode(TINY.replace(attention_impl="pallas_interpret"), 8, lengths, steps, slots=24)
    np.testing.assert_allclose(got, want_logits(lengths, steps), atol=TOL, rtol=0)


def test_decode_over_a_sequence_sharded_cache_equals_unsharded():
    """cache_seq on the fsdp mesh axis (4 shards of 16 slots), batch on data: same logits, and the cache
    stays laid out that way through prefill and decode."""
    mesh = build_mesh(MeshConfig(data=2, fsdp=4, expert=1, tensor=1), jax.devices()[:8])
    rules = (("cache_seq", "fsdp"), ("batch", "data")) + DEFAULT_RULES
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        got, cache = prefill_then_decode(TINY, CHUNK, mesh_rules=(mesh, rules))
    want, _ = chunked_xla()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    latent = cache["segment_1"]["layer_0"]["latent"]                # [repeats, B, S, C]
    assert latent.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", "fsdp", None)), latent.ndim)
    assert latent.addressable_shards[0].data.shape[2] == SLOTS // 4


def test_generate_chunked_equals_unchunked_and_speculative_equals_greedy():
    variables = init_variables(TINY)
    seq = sequences(TINY, seed=3)
    T = int(LENGTHS.max())
    prompt = np.where(np.arange(T)[None] < LENGTHS[:, None], seq[:, :T], 0)
    kw = dict(max_new_tokens=6, temperature=0.0)
    whole = gen.generate(TINY, variables, prompt, LENGTHS, prefill_chunk=0, **kw)
    chunked = gen.generate(TINY, variables, prompt, LENGTHS, prefill_chunk=CHUNK, **kw)
    np.testing.assert_array_equal(np.asarray(chunked.tokens), np.asarray(whole.tokens))
    np.testing.assert_allclose(np.asarray(chunked.logprobs), np.asarray(whole.logprobs), atol=TOL, rtol=0)
    spec = gen.generate(TINY, variables, prompt, LENGTHS, prefill_chunk=CHUNK, speculative=True, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(whole.tokens))
    assert int(spec.drafted) > 0


def test_first_mtp_drafts_after_a_chunked_prefill_equal_the_full_forwards():
    """Depth d's draft after the prompt is the argmax of the full forward's MTP depth-d logits at the last
    prompt token, over the prompt followed by the first sampled token and the drafts before it."""
    cfg = gen.decode_config(TINY)
    K = cfg.mtp_depth
    variables = init_variables(TINY)
    seq = sequences(TINY, seed=4)
    B, T = 2, int(LENGTHS.max())
    prompt = np.where(np.arange(T)[None] < LENGTHS[:, None], seq[:, :T], 0)
    model = Transformer(cfg)

    @jax.jit
    def drafts(v, p, n):
        caches = init_cache(cfg, B, SLOTS, mtp=True)
        last, _, (mtp_cache, h_tail) = gen._prefill(model, v, p, n, caches["decoder"], CHUNK, caches["mtp"])
        token = jnp.argmax(last, -1).astype(jnp.int32)
        return token, gen._mtp_window(model, v, p, n, token, h_tail, mtp_cache)[0]

    token, got = (np.asarray(x) for x in drafts(variables, prompt, jnp.asarray(LENGTHS, jnp.int32)))
    rows = np.zeros((B, T + K), np.int32)          # causal: what follows a row's tokens changes nothing
    for b, L in enumerate(LENGTHS):
        rows[b, :L + K] = np.concatenate([prompt[b, :L], [token[b]], got[b, :K - 1]])
    out = jax.jit(lambda v, t: Transformer(TINY).apply(v, t, with_mtp=True))(variables, rows)
    last = LENGTHS - 1
    np.testing.assert_array_equal(np.argmax(np.asarray(out.logits)[np.arange(B), last], -1), token)
    want = np.argmax(np.asarray(out.mtp_logits)[:, np.arange(B), last], -1).T     # [B, K]
    np.testing.assert_array_equal(got, want)
