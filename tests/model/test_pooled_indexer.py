"""The pooled indexer's selection as a token mask (what the masked flash core attends over) equals the mask of its
(idx, valid) selection on every visible key: packed documents with incomplete pools, padding, the tail on and
off, queries in chunks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import glm53_flash
from glm5_jax.model import pooled_indexer
from pallas_kernels.masking import selection_mask, visible_mask

B, T, H, D = 2, 45, 3, 8


def _cfg(**kw):
    """GLM-5.3-Flash's config with a small indexer (the selection reads only the index_* fields)."""
    base = dict(index_n_heads=H, index_head_dim=D, index_topk=12, index_kpool=4, index_kpool_always_select_tail=True)
    base.update(kw)
    return glm53_flash.model_config().replace(**base)


def _packed_rows():
    """Row 0: documents of 13, 18 and 9 tokens then 5 of padding; row 1: one document of 45. Positions restart
    at each document."""
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    start = 0
    for doc, n in enumerate((13, 18, 9), 1):
        seg[0, start:start + n], pos[0, start:start + n] = doc, np.arange(n)
        start += n
    seg[1], pos[1] = 1, np.arange(T)
    return jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("kw", [dict(), dict(index_kpool_always_select_tail=False), dict(attention_q_chunk=16),
                                dict(index_topk=64), dict(index_kpool=1),
                                dict(index_kpool=64, index_topk=128)])
def test_mask_equals_the_selected_slots_where_visible(kw):
    cfg = _cfg(**kw)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    gate = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    ape = jnp.asarray(rng.normal(size=(cfg.index_kpool, D)), jnp.float32)
    pos, seg = _packed_rows()
    slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    args = (cfg, q, w, k, gate, ape, pos, pos, seg, seg, slot)
    idx, valid = pooled_indexer.pooled_topk(*args)
    idx_m, valid_m, mask = pooled_indexer.pooled_topk(*args, with_mask=True)
    np.testing.assert_array_equal(idx_m, idx)
    np.testing.assert_array_equal(valid_m, valid)
    assert mask.dtype == jnp.int8 and mask.shape == (B, T, T)
    visible = np.asarray(visible_mask(pos, pos, seg, seg))
    want = np.asarray(selection_mask(idx, valid, T))
    assert not np.any(want & ~visible)                  # the selection only names visible keys
    np.testing.assert_array_equal(np.asarray(mask, bool) & visible, want)
    # the selection drops keys: a late query of the long document attends to fewer than it sees
    if cfg.index_topk < T and cfg.index_kpool > 1:
        assert want[1, -1].sum() < visible[1, -1].sum()
