"""Key windows (pallas_kernels/key_window.py): the windowed indexer top-k selects exactly what plain
``lax.top_k`` over every key selects, for any positions/segments."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_inputs import positions_and_segments
from pallas_kernels.key_window import visible_key_range, window_widths
from pallas_kernels.lightning_indexer import reference
from pallas_kernels.masking import visible_mask


def packed_docs(B, T, S, rng):
    """Queries = the last T of S keys; per row 1-4 packed documents (positions restart) and a padded
    tail of 0-5 keys (segment 0)."""
    pos, seg = np.zeros((B, S), np.int32), np.zeros((B, S), np.int32)
    for b in range(B):
        n_pad = int(rng.integers(0, 6))
        cuts = np.sort(rng.choice(np.arange(1, S - n_pad), size=int(rng.integers(0, 4)), replace=False))
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [S - n_pad]])
        for i, (a, e) in enumerate(zip(starts, ends)):
            pos[b, a:e], seg[b, a:e] = np.arange(e - a), i + 1
    return tuple(jnp.asarray(x) for x in (pos[:, S - T:], pos, seg[:, S - T:], seg))


def quantized_inputs(B, T, S, H, D, rng, levels=3):
    """Small-integer q, k and quarter-step w: every score is exact in fp32 whatever the summation
    order, and exact ties (equal dot products, ReLU zeros) are common."""
    q = jnp.asarray(rng.integers(-levels, levels + 1, (B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.integers(-levels, levels + 1, (B, S, D)), jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, (B, T, H)) / 4, jnp.float32)
    return q, k, w


def oracle_topk(q, k, w, q_pos, kv_pos, q_seg, kv_seg, *, topk):
    """Plain lax.top_k over the scores of every key."""
    scores = reference.index_scores(q, k, w, visible_mask(q_pos, kv_pos, q_seg, kv_seg))
    top, idx = jax.lax.top_k(scores, min(topk, k.shape[1]))
    return idx.astype(jnp.int32), top > -jnp.inf


def assert_same(got, want, S):
    (idx, valid), (ref_idx, ref_valid) = (tuple(np.asarray(x) for x in pair) for pair in (got, want))
    assert idx.shape == ref_idx.shape and idx.dtype == np.int32
    np.testing.assert_array_equal(valid, ref_valid)
    np.testing.assert_array_equal(np.where(valid, idx, -1), np.where(ref_valid, ref_idx, -1))
    assert ((idx >= 0) & (idx < S)).all()  # invalid slots too: callers gather with them


@pytest.mark.parametrize("B,T,S,topk,q_chunk,seed", [
    (2, 300, 300, 37, 64, 0),     # k not a power of two, T not a multiple of the chunk
    (2, 120, 333, 100, 32, 1),    # queries = last T of S (prefill after a cache), several documents
    (1, 256, 256, 300, 64, 2),    # topk > S: k = S, every row has fewer visible keys than k
    (3, 200, 200, 8, 200, 3),     # one chunk
])
def test_windowed_topk_matches_plain_top_k_with_ties(B, T, S, topk, q_chunk, seed):
    rng = np.random.default_rng(seed)
    q, k, w = quantized_inputs(B, T, S, 4, 8, rng)
    args = (q, k, w) + packed_docs(B, T, S, rng)
    want = jax.jit(functools.partial(oracle_topk, topk=topk))(*args)
    scores = np.asarray(reference.index_scores(q, k, w, visible_mask(*args[3:])))
    finite = np.where(np.isfinite(scores), scores, np.nan)
    assert np.isinf(scores).all(-1).any()                      # padded queries: all keys -inf
    assert (np.asarray(want[1]).sum(-1) < want[1].shape[-1]).any()  # rows with fewer visible than k
    assert any(len(np.unique(r[~np.isnan(r)])) < np.sum(~np.isnan(r)) for r in finite[0])  # ties
    for key_windows in (1, 3, 8):
        got = jax.jit(functools.partial(reference.indexer_topk, topk=topk, q_chunk=q_chunk,
                                        key_windows=key_windows, min_window=0))(*args)
        assert_same(got, want, S)


def test_windowed_topk_matches_plain_top_k_random_scores():
    rng = np.random.default_rng(5)
    B, T, S, topk = 2, 150, 260, 50
    q = jnp.asarray(rng.standard_normal((B, T, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, 4)) * 0.1, jnp.float32)
    args = (q, k, w) + positions_and_segments(B, T, S)
    got = reference.indexer_topk(*args, topk=topk, q_chunk=32, key_windows=6, min_window=0)
    assert_same(got, oracle_topk(*args, topk=topk), S)


def test_visible_key_range_covers_every_visible_key():
    rng = np.random.default_rng(7)
    for trial in range(8):
        B, S = 2, int(rng.integers(10, 120))
        T = int(rng.integers(1, S + 1))
        q_pos, kv_pos, q_seg, kv_seg = packed_docs(B, T, S, rng)
        start = int(rng.integers(0, T))
        stop = int(rng.integers(start + 1, T + 1))
        chunk = (q_pos[:, start:stop], q_seg[:, start:stop])
        lo, hi = (np.asarray(x) for x in visible_key_range(chunk[0], chunk[1], kv_pos, kv_seg))
        visible = np.asarray(visible_mask(chunk[0], kv_pos, chunk[1], kv_seg)).any(1)  # [B, S]
        s = np.arange(S)
        assert not (visible & ((s < lo[:, None]) | (s >= hi[:, None]))).any()
        for b in range(B):
            if not visible[b].any():
                assert lo[b] == S and hi[b] == 0


def test_window_widths():
    assert window_widths(1000, 0, 4) == (250, 500, 750, 1000)
    assert window_widths(1000, 600, 4) == (600, 750, 1000)
    assert window_widths(300, 1024, 16) == (300,)
    assert window_widths(10, 0, 16)[-1] == 10
