"""Lightning-indexer Pallas kernel vs the XLA reference (interpret mode on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from dsa_inputs import assert_close, normal, positions_and_segments
from pallas_kernels.lightning_indexer import kernel, ops, reference
from pallas_kernels.masking import selection_mask, visible_mask


def make_inputs(B, T, S, H=4, D=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = normal(rng, (B, T, H, D), dtype)
    k = normal(rng, (B, S, D), dtype)
    w = normal(rng, (B, T, H)) * (H * D) ** -0.5  # may be negative, like weights_proj
    return (q, k, w) + positions_and_segments(B, T, S)


@pytest.mark.parametrize("B,T,S", [(2, 300, 300), (1, 40, 200)])
def test_scores_match_reference_fp32(B, T, S):
    q, k, w, q_pos, kv_pos, q_seg, kv_seg = make_inputs(B, T, S)
    got = kernel.index_scores(q, k, w, q_pos, kv_pos, q_seg, kv_seg, block_t=128, block_s=128, interpret=True)
    want = reference.index_scores(q, k, w, visible_mask(q_pos, kv_pos, q_seg, kv_seg))
    assert np.isinf(np.asarray(want)).any() and np.isfinite(np.asarray(want)).any()
    assert_close(got, want, 1e-5)


def test_scores_match_reference_bf16():
    q, k, w, q_pos, kv_pos, q_seg, kv_seg = make_inputs(2, 150, 260, dtype=jnp.bfloat16)
    got = kernel.index_scores(q, k, w, q_pos, kv_pos, q_seg, kv_seg, block_t=128, block_s=128, interpret=True)
    want = reference.index_scores(q, k, w, visible_mask(q_pos, kv_pos, q_seg, kv_seg))
    assert_close(got, want, 1e-5)  # bf16 products are exact in fp32; only summation order differs


def assert_same_selection(args, idx, valid, ref_idx, ref_valid):
    """Same validity and the same selected score values slot by slot (ReLU makes exact-zero ties, and
    tied keys may come out in a different order, so indices are compared through their scores)."""
    q, k, w, q_pos, kv_pos, q_seg, kv_seg = args
    scores = reference.index_scores(q, k, w, visible_mask(q_pos, kv_pos, q_seg, kv_seg))
    np.testing.assert_array_equal(valid, ref_valid)
    picked = np.take_along_axis(np.asarray(scores), np.asarray(idx), axis=-1)
    ref_picked = np.take_along_axis(np.asarray(scores), np.asarray(ref_idx), axis=-1)
    assert_close(np.where(valid, picked, 0.0), np.where(ref_valid, ref_picked, 0.0), 1e-5)
    assert len(np.unique(np.asarray(idx)[0, -1])) == idx.shape[-1]  # distinct keys per query


def test_topk_matches_reference():
    args = make_inputs(2, 150, 260)
    idx, valid = ops.indexer_topk(*args, topk=200, impl="pallas_interpret")
    ref_idx, ref_valid = ops.indexer_topk(*args, topk=200, impl="xla")
    assert idx.shape == ref_idx.shape == (2, 150, 200) and idx.dtype == jnp.int32
    valid = np.asarray(valid)
    assert (~valid).any() and valid.any()  # early rows see fewer than k keys; padded rows see none
    assert not valid[0, -1].any() and valid[0, -4].any()
    assert_same_selection(args, idx, valid, ref_idx, ref_valid)


def integer_inputs(rng, B, T, S, H=2, D=4):
    """Small-integer q, k and half-integer w: exact fp32 scores, so ties (equal scores, ReLU zeros) are common."""
    q = jnp.asarray(rng.integers(-2, 3, (B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.integers(-2, 3, (B, S, D)), jnp.float32)
    w = jnp.asarray(rng.integers(-2, 3, (B, T, H)) / 2, jnp.float32)
    return (q, k, w) + positions_and_segments(B, T, S)


def test_selection_mask_from_scores_equals_the_top_k_with_ties():
    """The mask the kernel path makes from each chunk's scores (masking.top_k_mask) is exactly the set of
    (idx, valid) it returns: small-integer inputs make exact ties (equal scores, ReLU zeros) common, at
    the k-th value too; rows with fewer visible keys than k and padded rows included."""
    B, T, S, topk = 2, 100, 140, 24
    args = integer_inputs(np.random.default_rng(3), B, T, S)
    q, k, w = args[:3]
    idx, valid, mask = ops.indexer_topk(*args, topk=topk, impl="pallas_interpret", with_mask=True)
    np.testing.assert_array_equal(mask, selection_mask(idx, valid, S))
    scores = np.asarray(reference.index_scores(q, k, w, visible_mask(*args[3:])))
    kth = np.sort(np.where(np.isfinite(scores), scores, -np.inf), axis=-1)[..., -topk]
    picked_at_kth = np.take_along_axis(scores, np.asarray(idx), -1) == kth[..., None]
    # ties at the k-th value of which top_k took only some (the lowest-indexed) occur
    assert ((scores == kth[..., None]).sum(-1) > (picked_at_kth & np.asarray(valid)).sum(-1))[np.isfinite(kth)].any()
    assert (np.asarray(valid).sum(-1) < topk).any() and np.asarray(valid).any()
    _, _, xla_mask = ops.indexer_topk(*args, topk=topk, impl="xla", with_mask=True)
    np.testing.assert_array_equal(np.asarray(xla_mask).sum(-1), np.asarray(mask).sum(-1))
    # with_lse: the log-sum-exp of the selected scores (the sparse KL's normaliser), -inf for a padded row
    *picked, lse = ops.indexer_topk(*args, topk=topk, impl="pallas_interpret", with_mask=True, with_lse=True)
    for got, want in zip(picked, (idx, valid, mask)):
        np.testing.assert_array_equal(got, want)
    on_mask = np.where(np.asarray(mask) != 0, scores, -np.inf)
    top = np.max(on_mask, -1, keepdims=True)
    with np.errstate(divide="ignore"):   # log(0) = -inf for a row with nothing selected
        want_lse = (top + np.log(np.sum(np.exp(on_mask - np.where(np.isfinite(top), top, 0)), -1, keepdims=True)))[..., 0]
    assert np.isinf(want_lse).any() and np.isfinite(want_lse).any()
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    *_, xla_lse = ops.indexer_topk(*args, topk=topk, impl="xla", with_mask=True, with_lse=True)
    np.testing.assert_allclose(xla_lse, want_lse, rtol=1e-6)
    with pytest.raises(ValueError, match="with_lse comes with the selection mask"):
        ops.indexer_topk(*args, topk=topk, impl="xla", with_lse=True)


def test_sorted_selection_is_lax_top_k_exactly_with_ties():
    """Without a mask the kernel path selects by one sort of the negated, keys-major scores by (score, key
    index) (`index_scores(keys_major=True)`: [B, S_pad, T_pad], +inf where not visible or padded) and reads back
    only the first k rows; on small-integer inputs (exact scores, so ties everywhere: equal scores, ReLU
    zeros, whole rows of -inf) it returns exactly what ``lax.top_k`` of the scores returns, invalid slots
    included, over query chunks that do not divide T."""
    B, T, S, topk = 2, 100, 140, 24
    args = integer_inputs(np.random.default_rng(5), B, T, S)
    q, k, w = args[:3]
    scores = reference.index_scores(q, k, w, visible_mask(*args[3:]))
    neg, key_index = kernel.index_scores(*args, block_t=128, block_s=128, keys_major=True, interpret=True)
    assert neg.shape == key_index.shape == (B, 256, 128)
    np.testing.assert_array_equal(key_index, np.broadcast_to(np.arange(256)[None, :, None], (B, 256, 128)))
    np.testing.assert_array_equal(np.asarray(neg)[:, :S, :T], -np.swapaxes(np.asarray(scores), 1, 2))
    assert np.isposinf(np.asarray(neg)[:, S:]).all() and np.isposinf(np.asarray(neg)[:, :, T:]).all()
    top_scores, want_idx = jax.lax.top_k(scores, topk)
    idx, valid = kernel.indexer_topk(*args, topk=topk, q_chunk=64, block_t=128, block_s=128, interpret=True)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(valid, top_scores > -jnp.inf)
    assert (np.asarray(top_scores)[..., :-1] == np.asarray(top_scores)[..., 1:]).any()    # ties were there
    assert (~np.asarray(valid)).any() and np.asarray(valid).any()


def test_query_chunks_not_multiple_of_chunk():
    args = make_inputs(1, 70, 90)
    idx, valid = kernel.indexer_topk(*args, topk=16, q_chunk=32, interpret=True)
    ref_idx, ref_valid = reference.indexer_topk(*args, topk=16, q_chunk=32)
    assert_same_selection(args, idx, valid, ref_idx, ref_valid)


def test_tpu_interpreter_out_of_bounds_checked():
    q, k, w, q_pos, kv_pos, q_seg, kv_seg = make_inputs(1, 130, 140, H=2, D=8)
    params = pltpu.InterpretParams(out_of_bounds_reads="raise")
    try:
        got = kernel.index_scores(q, k, w, q_pos, kv_pos, q_seg, kv_seg, block_t=128, block_s=128,
                                  interpret=params)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert_close(got, reference.index_scores(q, k, w, visible_mask(q_pos, kv_pos, q_seg, kv_seg)), 1e-5)
