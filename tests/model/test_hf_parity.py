"""Logits equal transformers' GlmMoeDsaForCausalLM on tiny random checkpoints."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer, load_hf
from hf_reference import assert_no_boundary_ties, build_hf_model, hf_logits

TOL = 1e-4


@pytest.fixture(scope="module", params=["shared_index", "grouped"])
def saved(request, tmp_path_factory):
    model = build_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, variables = load_hf(str(path))
    return model, cfg, variables


def _ours(cfg, variables, ids, segment_ids=None):
    fn = jax.jit(lambda v, t, s: Transformer(cfg).apply(v, t, segment_ids=s).logits)
    return np.asarray(fn(variables, jnp.asarray(ids), None if segment_ids is None else jnp.asarray(segment_ids)))


def test_loaded_config_matches_checkpoint(saved):
    model, cfg, _ = saved
    hf = model.config
    assert cfg.indexer_types in (None, tuple(hf.indexer_types))
    assert cfg.layer_indexer_types == tuple(hf.indexer_types)
    assert (cfg.n_group, cfg.topk_group, cfg.index_topk) == (hf.n_group, hf.topk_group, hf.index_topk)


def test_logits_match_hf_with_selection(saved):
    """T = 5 x index_topk, so most queries see more keys than the indexer keeps."""
    model, cfg, variables = saved
    T = 5 * cfg.index_topk
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, T))
    assert_no_boundary_ties(model, ids)
    ref = hf_logits(model, ids)
    ours = _ours(cfg, variables, ids)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    # the comparison is meaningful: dense attention would give different logits
    dense = _ours(cfg.replace(attention_mode="dense"), variables, ids)
    assert np.abs(dense - ref).max() > 100 * TOL


def test_logits_match_hf_with_right_padding(saved):
    model, cfg, variables = saved
    T = 4 * cfg.index_topk + 3
    rng = np.random.default_rng(2)
    ids = rng.integers(0, cfg.vocab_size, (2, T))
    mask = np.ones((2, T), np.int64)
    mask[1, T - 11:] = 0                      # second row: 11 padding tokens at the end
    assert_no_boundary_ties(model, ids)
    ref = hf_logits(model, ids, mask)
    ours = _ours(cfg, variables, ids, segment_ids=mask.astype(np.int32))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)


def test_mha_form_matches_hf(saved):
    model, cfg, variables = saved
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 4 * cfg.index_topk))
    ref = hf_logits(model, ids)
    np.testing.assert_allclose(_ours(cfg.replace(mla_form="mha"), variables, ids), ref, atol=TOL, rtol=0)
