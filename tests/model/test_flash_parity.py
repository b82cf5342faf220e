"""GLM-5.3-Flash logits equal transformers' Glm5NextForConditionalGeneration (text only) on a tiny random
checkpoint: KDA layers, the NoPE MLA layer with its pooled indexer, mHC hyper-connections, clamped SwiGLU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer, load_hf
from hf_reference_flash import build_flash_model, flash_logits

TOL = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build_flash_model()
    path = tmp_path_factory.mktemp("flash")
    model.save_pretrained(path)
    cfg, variables = load_hf(str(path))
    return model, cfg, variables


def _ours(cfg, variables, ids, segment_ids):
    fn = jax.jit(lambda v, t, s: Transformer(cfg).apply(v, t, segment_ids=s).logits)
    return np.asarray(fn(variables, jnp.asarray(ids), jnp.asarray(segment_ids)))


def _ragged_batch(cfg, seed=1):
    """Two rows of 5 x index_topk + 3 tokens, the second right-padded by 11."""
    T = 5 * cfg.index_topk + 3
    ids = np.random.default_rng(seed).integers(1, cfg.vocab_size, (2, T))
    mask = np.ones((2, T), np.int64)
    mask[1, T - 11:] = 0
    return ids, mask


def test_loaded_config_is_flash(saved):
    model, cfg, _ = saved
    text = model.config.text_config
    assert cfg.layer_attention_types == ("kda", "kda", "kda", "mla", "kda")
    assert (cfg.index_kpool, cfg.hc_mult, cfg.swiglu_limit, cfg.qk_rope_head_dim) == (
        text.index_kpool, text.hc_mult, text.swiglu_limit, 0)
    assert cfg.num_nextn_predict_layers == 0 and cfg.first_k_dense_replace == 3


def test_logits_match_hf_on_a_right_padded_batch(saved):
    model, cfg, variables = saved
    ids, mask = _ragged_batch(cfg)
    ref = flash_logits(model, ids, mask)
    ours = _ours(cfg, variables, ids, mask.astype(np.int32))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)
    # the pooled indexer's queries in chunks of 16 (the last one padded) select the same
    chunked = _ours(cfg.replace(attention_q_chunk=16), variables, ids, mask.astype(np.int32))
    np.testing.assert_allclose(chunked[valid], ref[valid], atol=TOL, rtol=0)


@pytest.mark.parametrize("change", [dict(swiglu_limit=1e9), dict(index_topk=64),
                                    dict(index_kpool_always_select_tail=False)])
def test_the_parity_batch_exercises_clamp_selection_and_tail(saved, change):
    """The same weights (same seed; these fields change no shape) without the SwiGLU clamp, selecting every
    pool, or without the tail give other logits on the parity batch: the match above tests each."""
    model, cfg, _ = saved
    ids, mask = _ragged_batch(cfg)
    valid = mask.astype(bool)
    other = flash_logits(build_flash_model(**change), ids, mask)
    assert np.abs(other[valid] - flash_logits(model, ids, mask)[valid]).max() > 100 * TOL


def test_packed_documents_equal_separate_rows(saved):
    """Two documents packed in one row (segment ids 1, 2) give each one's logits alone: the KDA conv and
    state, the pools and the selection all restart at the boundary."""
    _, cfg, variables = saved
    ids, _ = _ragged_batch(cfg, seed=3)
    T = ids.shape[1]
    a, b = ids[0, :21], ids[1, :T - 21]
    rows = np.zeros((3, T), np.int64)
    rows[0], rows[1, :21], rows[2, :T - 21] = np.concatenate([a, b]), a, b
    segments = np.zeros((3, T), np.int32)
    segments[0, :21], segments[0, 21:], segments[1, :21], segments[2, :T - 21] = 1, 2, 1, 1
    out = _ours(cfg, variables, rows, segments)
    np.testing.assert_allclose(out[0, :21], out[1, :21], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[0, 21:], out[2, :T - 21], atol=TOL, rtol=0)


def test_masked_flash_core_matches_hf(saved):
    """On TPU impls a short sequence's MLA layers attend with the flash kernel (MHA form, NoPE heads) over the
    pooled selection as a mask (glm5_jax/model/pooled_indexer.py): transformers' logits on the ragged batch
    and on two packed documents, with no per-slot gathers in the program."""
    model, cfg, variables = saved
    masked = cfg.replace(attention_impl="pallas_interpret", masked_flash_factor=8.0)
    ids, mask = _ragged_batch(cfg)
    program = str(jax.make_jaxpr(lambda v, t: Transformer(masked).apply(v, t).logits)(variables, jnp.asarray(ids)))
    assert "flash_attention_fwd_masked" in program and "sparse_mla" not in program
    valid = mask.astype(bool)
    ours = _ours(masked, variables, ids, mask.astype(np.int32))
    np.testing.assert_allclose(ours[valid], flash_logits(model, ids, mask)[valid], atol=TOL, rtol=0)
    rows = np.concatenate([ids[0, :21], ids[1, :ids.shape[1] - 21]])[None]
    segments = np.where(np.arange(ids.shape[1]) < 21, 1, 2).astype(np.int32)[None]
    packed = _ours(masked, variables, rows, segments)
    np.testing.assert_allclose(packed, _ours(cfg, variables, rows, segments), atol=TOL, rtol=0)
