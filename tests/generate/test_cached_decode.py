"""Decoding over the latent cache computes exactly what a full forward computes.

Background: docs/architecture.md#mla-attention, #top-k-selection-and-validity.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer
from glm5_jax.generate.decoding import decode_config
from glm5_jax.model.kv_cache import cache_bytes_per_token, init_cache
from pallas_kernels.sparse_mla import ops as sparse_mla_ops
from tests.generate.tiny_models import TINY, full_logits, init_variables

TOL = 1e-5


@pytest.mark.parametrize("cfg,dense_decode_factor", [
    (TINY, 0), (TINY, 4), (TINY.replace(attention_mode="dense", mla_form="mha"), 4),
    (TINY.replace(use_indexer=False, indexer_types=None), 4)],
    ids=["dsa_gather_rows", "dsa_selection_mask", "dense_mha_config", "no_indexer"])
def test_prefill_and_each_decode_step_match_full_forward(cfg, dense_decode_factor, monkeypatch):
    """Prompts of 5 and 11 tokens in one batch, then one token per step up to 30 > index_topk = 8, so the
    decode-time top-k over the cache drops keys; logits at every position equal the full forward's.
    DSA attends to the selected slots either by gathering their rows or through a mask over the cache."""
    monkeypatch.setattr(sparse_mla_ops, "DENSE_DECODE_FACTOR", dense_decode_factor)
    variables = init_variables(cfg)
    B, T, P = 2, 30, 12
    lengths = np.array([5, 11])
    seq = np.random.default_rng(0).integers(2, cfg.vocab_size, (B, T)).astype(np.int32)
    want = np.asarray(full_logits(cfg, variables, seq))
    model = Transformer(decode_config(cfg))
    step = jax.jit(lambda v, t, p, s, c: model.apply(v, t, p, s, c, method=Transformer.decode))

    positions = np.broadcast_to(np.arange(P, dtype=np.int32), (B, P))
    segments = (positions < lengths[:, None]).astype(np.int32)
    prompt = np.where(segments > 0, seq[:, :P], 0)
    cache = init_cache(decode_config(cfg), B, T)["decoder"]
    logits, _, cache = step(variables, prompt, positions, segments, cache)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(logits)[b, :lengths[b]], want[b, :lengths[b]], atol=TOL, rtol=0)
    for s in range(T - lengths.max()):
        pos = lengths + s
        tok = seq[np.arange(B), pos]
        logits, _, cache = step(variables, tok[:, None], pos[:, None].astype(np.int32), np.ones((B, 1), np.int32),
                                cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], want[np.arange(B), pos], atol=TOL, rtol=0,
                                   err_msg=f"decode step {s}")


def test_several_tokens_per_step_match_full_forward():
    """A verify window of 3 tokens per row at different offsets (what speculative decoding feeds)."""
    cfg = TINY
    variables = init_variables(cfg)
    B, T = 2, 24
    seq = np.random.default_rng(1).integers(2, cfg.vocab_size, (B, T)).astype(np.int32)
    want = np.asarray(full_logits(cfg, variables, seq))
    model = Transformer(decode_config(cfg))
    cache = init_cache(decode_config(cfg), B, T)["decoder"]
    step = jax.jit(lambda v, t, p, c: model.apply(v, t, p, jnp.ones_like(t), c, method=Transformer.decode))
    starts = np.array([0, 0])
    for width in (9, 3, 3, 2, 3):
        pos = (starts[:, None] + np.arange(width)[None]).astype(np.int32)
        logits, _, cache = step(variables, np.take_along_axis(seq, pos, 1), pos, cache)
        np.testing.assert_allclose(np.asarray(logits), np.take_along_axis(want, pos[..., None], 1), atol=TOL, rtol=0)
        # row 1 re-feeds its window's last position next time, overwriting that slot (a rejected draft)
        starts = starts + width - np.array([0, 1])


def test_cache_holds_latent_rope_key_and_index_key_only():
    glm5 = __import__("configs.glm5_744b", fromlist=["model_config"]).model_config()
    # docs/architecture.md#notation-and-sizes: per token and layer 512 latent + 64 rope key + 128 indexer key,
    # bf16, 78 layers
    assert cache_bytes_per_token(glm5, "bfloat16") == 78 * (512 + 64 + 128) * 2 == 109_824
    cache = init_cache(TINY, batch=3, max_len=16)
    layer = cache["decoder"]["segment_1"]["layer_0"]
    assert layer["latent"].shape[1:] == (3, 16, TINY.kv_lora_rank + TINY.qk_rope_head_dim)
    assert "index_key" not in layer                       # a shared-index layer reuses the full layer's top-k
    shapes = jax.tree.map(lambda x: x.shape[-1], cache["decoder"])
    widths = sorted({w for w in jax.tree.leaves(shapes)})
    assert widths == [TINY.index_head_dim, TINY.kv_lora_rank + TINY.qk_rope_head_dim]
