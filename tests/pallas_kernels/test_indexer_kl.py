"""Indexer KL loss: against an unchunked direct formula, and the hand-derived gradient.

Background: docs/architecture.md#dsa-training-stages-and-the-indexer-kl.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_inputs import assert_close, normal, positions_and_segments
from pallas_kernels.indexer_kl import ops, reference
from pallas_kernels.lightning_indexer import reference as indexer_reference
from pallas_kernels.masking import visible_mask

SCALE = 0.3
B, T, S, H, C, HI, DI = 2, 20, 26, 3, 12, 2, 8


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    return dict(q=normal(rng, (B, T, H, C)), kv=normal(rng, (B, S, C)),
                iq=normal(rng, (B, T, HI, DI)), ik=normal(rng, (B, S, DI)),
                iw=normal(rng, (B, T, HI)) * 0.5,
                pos_seg=positions_and_segments(B, T, S))


def direct_loss(x, allowed_BTS):
    """Unchunked: p from full [B,T,H,S] attention, q = softmax(I), KL over ``allowed``, token mean."""
    logits = jnp.einsum("bthc,bsc->bths", x["q"], x["kv"]) * SCALE
    probs = jax.nn.softmax(jnp.where(allowed_BTS[:, :, None], logits, -jnp.inf), axis=-1)
    p = jnp.nan_to_num(probs).sum(2)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    scores = indexer_reference.index_scores(x["iq"], x["ik"], x["iw"], allowed_BTS)
    log_q = jax.nn.log_softmax(scores, axis=-1)
    kl = jnp.sum(jnp.where(allowed_BTS, jax.scipy.special.xlogy(p, p) - p * log_q, 0.0), -1)
    has = allowed_BTS.any(-1)
    return jnp.sum(jnp.where(has, kl, 0.0)) / has.sum()


def loss_fn(x, stage, idx=None, valid=None, q_chunk=8):
    q_pos, kv_pos, q_seg, kv_seg = x["pos_seg"]
    return lambda q, kv, iq, ik, iw: reference.indexer_kl_loss(
        q, kv, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, scale=SCALE, stage=stage,
        idx_BTK=idx, valid_BTK=valid, q_chunk=q_chunk)


def selection(x, topk):
    return indexer_reference.indexer_topk(x["iq"], x["ik"], x["iw"], *x["pos_seg"], topk=topk)


def selected_mask(idx, valid):
    """Boolean [B, T, S]: key s is a valid selected slot of query t."""
    hits = jax.nn.one_hot(idx, S, dtype=jnp.int32) * valid[..., None]
    return hits.sum(2) > 0


ARGS = ("q", "kv", "iq", "ik", "iw")


def test_warmup_matches_direct_formula_and_grads_only_reach_indexer():
    x = make_inputs()
    visible = visible_mask(*x["pos_seg"])
    loss = loss_fn(x, "warmup")
    args = tuple(x[k] for k in ARGS)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=range(5)))(*args)
    direct_value, direct_grads = jax.jit(jax.value_and_grad(
        lambda iq, ik, iw: direct_loss(dict(x, iq=iq, ik=ik, iw=iw), visible), argnums=range(3)))(*args[2:])
    assert value > 0
    assert_close(value, direct_value, 1e-5)
    assert not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1]))  # q, kv detached
    for g, w in zip(grads[2:], direct_grads):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)


def test_sparse_matches_direct_formula_on_selected_set():
    x = make_inputs(seed=1)
    idx, valid = selection(x, topk=7)
    assert (~np.asarray(valid)).any()
    value, grads = jax.jit(jax.value_and_grad(loss_fn(x, "sparse", idx, valid), argnums=(2, 3, 4)))(
        *(x[k] for k in ARGS))
    direct_value, direct_grads = jax.jit(jax.value_and_grad(
        lambda iq, ik, iw: direct_loss(dict(x, iq=iq, ik=ik, iw=iw), selected_mask(idx, valid)),
        argnums=range(3)))(x["iq"], x["ik"], x["iw"])
    assert_close(value, direct_value, 1e-5)
    for g, w in zip(grads, direct_grads):
        assert_close(g, w, 1e-5)


def test_sparse_target_from_sparse_mla_gives_the_same_loss_and_grads():
    """The XLA sparse attention's head-averaged probabilities (sparse_mla with_target) are the KL target."""
    from pallas_kernels.sparse_mla import ops as sparse_mla_ops

    x = make_inputs(seed=3)
    idx, valid = selection(x, topk=7)
    _, _, target = sparse_mla_ops.sparse_mla(x["q"], x["kv"], idx, valid, scale=SCALE, v_dim=C, impl="reference",
                                             with_target=True)
    q_pos, kv_pos, q_seg, kv_seg = x["pos_seg"]

    def with_target(iq, ik, iw):
        return ops.indexer_kl_loss(None, None, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, scale=SCALE,
                                   stage="sparse", idx_BTK=idx, valid_BTK=valid, target_BTK=target)

    value, grads = jax.jit(jax.value_and_grad(with_target, argnums=range(3)))(x["iq"], x["ik"], x["iw"])
    direct_value, direct_grads = jax.jit(jax.value_and_grad(
        lambda iq, ik, iw: direct_loss(dict(x, iq=iq, ik=ik, iw=iw), selected_mask(idx, valid)),
        argnums=range(3)))(x["iq"], x["ik"], x["iw"])
    assert value > 0
    assert_close(value, direct_value, 1e-5)
    for g, w in zip(grads, direct_grads):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)
    # the Pallas forward kernel's target (its second sweep) is the same target
    kernel_target = sparse_mla_ops.sparse_mla(x["q"], x["kv"], idx, valid, scale=SCALE, v_dim=C,
                                              impl="pallas_interpret", with_target=True)[2]
    assert_close(kernel_target, target, 1e-5)


def test_sparse_equals_warmup_when_every_visible_key_is_selected():
    x = make_inputs(seed=2)
    idx, valid = selection(x, topk=S)
    args = tuple(x[k] for k in ARGS)
    assert_close(loss_fn(x, "sparse", idx, valid)(*args), loss_fn(x, "warmup")(*args), 1e-5)


def test_gradient_wrt_scores_is_softmax_minus_target():
    """Hand check of d KL / d I = softmax(I) - p on the set, 0 outside 
    (docs/architecture.md#dsa-training-stages-and-the-indexer-kl)."""
    rng = np.random.default_rng(3)
    scores = normal(rng, (2, 5, 9)) * 3
    allowed = jnp.asarray(rng.uniform(size=(2, 5, 9)) < 0.6)
    allowed = allowed.at[1, 2].set(False)  # a token with an empty set
    p = jnp.where(allowed, jnp.asarray(rng.uniform(size=(2, 5, 9)), jnp.float32), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)

    def mean_kl(s):
        kl, has = reference.kl_per_token(p, s, allowed)
        return kl.sum() / has.sum()

    grad = jax.jit(jax.grad(mean_kl))(scores)
    n_tokens = int(np.asarray(allowed).any(-1).sum())
    s, a, pn = np.asarray(scores, np.float64), np.asarray(allowed), np.asarray(p, np.float64)
    row_max = np.where(a, s, -np.inf).max(-1, keepdims=True, initial=-np.inf)
    e = np.exp(np.where(a, s - np.where(np.isfinite(row_max), row_max, 0.0), -np.inf))
    softmax = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    expected = np.where(a, softmax - pn, 0.0) / n_tokens
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)
    assert np.all(np.asarray(grad)[1, 2] == 0)


def test_ops_switch_and_bad_stage():
    x = make_inputs()
    q_pos, kv_pos, q_seg, kv_seg = x["pos_seg"]
    args = tuple(x[k] for k in ARGS) + (q_pos, kv_pos, q_seg, kv_seg)
    assert_close(jax.jit(lambda *a: ops.indexer_kl_loss(*a, scale=SCALE, stage="warmup"))(*args),
                 jax.jit(loss_fn(x, "warmup", q_chunk=128))(*args[:5]), 1e-6)
    with pytest.raises(ValueError):
        ops.indexer_kl_loss(*args, scale=SCALE, stage="sparse")  # needs idx/valid


def test_selected_index_scores_hand_vjp_matches_autodiff_of_dense_scores():
    """selected_scores: forward = the dense indexer scores at the chosen keys; its hand-written VJP (the
    CPU multiply-add form, and the product form other platforms use) = autodiff of that dense formula,
    with keys chosen several times per query and by several queries (the scatter-add)."""
    from pallas_kernels.indexer_kl import selected_scores
    from pallas_kernels.sparse_mla.reference import gather_rows

    rng = np.random.default_rng(5)
    x = make_inputs(seed=5)
    idx = jnp.asarray(rng.integers(0, S, size=(B, T, 9)), jnp.int32)
    idx = idx.at[:, :, 1].set(idx[:, :, 0])                        # a repeated key within each query
    d_scores = normal(rng, (B, T, 9))
    all_visible = jnp.ones((B, T, S), bool)

    def dense(iq, ik, iw):
        scores = indexer_reference.index_scores(iq, ik, iw, all_visible)
        return jnp.take_along_axis(scores, idx, axis=-1)

    def weighted(fn):
        return lambda iq, ik, iw: jnp.sum(fn(iq, ik, iw) * d_scores)

    args = (x["iq"], x["ik"], x["iw"])
    got = jax.jit(lambda *a: selected_scores.selected_index_scores(*a, idx))(*args)
    assert_close(got, dense(*args), 1e-5)
    grads = jax.jit(jax.grad(weighted(lambda *a: selected_scores.selected_index_scores(*a, idx)),
                             argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.grad(weighted(dense), argnums=(0, 1, 2)))(*args)
    for g, w in zip(grads, want):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)

    # the product form (non-CPU platforms) computes the same dq and gathered-key gradients
    g_BTKH = normal(rng, (B, T, 9, HI))
    keys = gather_rows(x["ik"], idx)
    for a, b in zip(selected_scores._product_grads(g_BTKH, keys, x["iq"]),
                    selected_scores._multiply_add_grads(g_BTKH, keys, x["iq"])):
        assert_close(a, b, 1e-5)

    # bf16 inputs get bf16 gradients (the sums run in fp32)
    bf16 = tuple(a.astype(jnp.bfloat16) for a in args)
    grads16 = jax.jit(jax.grad(weighted(lambda *a: selected_scores.selected_index_scores(*a, idx)),
                               argnums=(0, 1, 2)))(*bf16)
    want16 = jax.jit(jax.grad(weighted(dense), argnums=(0, 1, 2)))(*(a.astype(jnp.float32) for a in bf16))
    for g, w in zip(grads16, want16):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 2e-2)


# ---- the sparse stage's KL on the Pallas kernels (pallas_kernels/indexer_kl/sparse_kernel.py), interpreted

def _sparse_kl_loss(impl, idx, valid, target):
    def loss(iq, ik, iw):
        return reference.mean_over_tokens(*ops.sparse_kl_per_token(iq, ik, iw, idx, valid, target, impl=impl))
    return loss


def test_sparse_kernel_equals_reference_on_packed_segments_and_uneven_masks():
    """Loss, per-token KL and the gradients of iq, ik, iw from the kernels = the XLA path, on a top-k
    selection over padded / packed sequences (uneven valid counts, a query without any valid slot)."""
    from pallas_kernels.sparse_mla import ops as sparse_mla_ops

    x = make_inputs(seed=4)
    idx, valid = selection(x, topk=9)
    valid = valid.at[1, 5].set(False)                     # a query with an empty set
    counts = np.asarray(valid).sum(-1)
    assert counts.min() == 0 and len(np.unique(counts)) > 3
    target = sparse_mla_ops.sparse_mla(x["q"], x["kv"], idx, valid, scale=SCALE, v_dim=C, impl="reference",
                                       with_target=True).target
    args = (x["iq"], x["ik"], x["iw"])
    want_kl, want_has = jax.jit(lambda *a: ops.sparse_kl_per_token(*a, idx, valid, target, impl="reference"))(*args)
    got_kl, got_has = jax.jit(lambda *a: ops.sparse_kl_per_token(*a, idx, valid, target,
                                                                 impl="pallas_interpret"))(*args)
    np.testing.assert_array_equal(got_has, want_has)
    assert float(got_kl[1, 5]) == 0.0 and np.asarray(want_kl).max() > 1e-2
    assert_close(got_kl, want_kl, 1e-5)
    grad = lambda impl: jax.jit(jax.value_and_grad(_sparse_kl_loss(impl, idx, valid, target),  # noqa: E731
                                                   argnums=(0, 1, 2)))(*args)
    (value, grads), (want_value, want_grads) = grad("pallas_interpret"), grad("reference")
    assert_close(value, want_value, 1e-5)
    for g, w in zip(grads, want_grads):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)


@pytest.mark.parametrize("resident, dk_in_vmem", [(True, True), (False, True), (False, False)])
def test_sparse_kernel_gradients_over_several_key_blocks_and_query_shares(resident, dk_in_vmem):
    """k = 300 slots in blocks of 128 (three blocks, the last padded) and 16 queries in two backward shares
    (each accumulating its own dk block) or, with the row gradients added by the row scatter-add kernel (as
    past 32K keys), in chunks of 8 queries: keys chosen by many queries and repeated within a query, weighted
    per-token cotangents; the kernels' gradients = the XLA path's, with the keys resident in VMEM and with row DMAs
    from HBM; bf16 inputs give bf16 gradients."""
    from pallas_kernels.indexer_kl import sparse_kernel, sparse_pallas

    rng = np.random.default_rng(6)
    Bk, Tk, Sk, K = 1, 16, 40, 300
    iq, ik, iw = normal(rng, (Bk, Tk, HI, DI)), normal(rng, (Bk, Sk, DI)), normal(rng, (Bk, Tk, HI)) * 0.5
    idx = jnp.asarray(rng.integers(0, Sk, (Bk, Tk, K)), jnp.int32)
    valid = jnp.asarray(rng.uniform(size=(Bk, Tk, K)) < 0.8)
    p = jnp.where(valid, jnp.asarray(rng.uniform(size=(Bk, Tk, K)), jnp.float32), 0.0)
    p = p / p.sum(-1, keepdims=True)
    cotangent = normal(rng, (Bk, Tk))
    assert sparse_kernel._n_split(Tk // sparse_kernel.QUERIES_PER_BLOCK) == 2

    def weighted(per_token):
        return lambda *a: jnp.sum(per_token(*a)[0] * cotangent)

    ref = weighted(lambda *a: ops.sparse_kl_per_token(*a, idx, valid, p, impl="reference"))
    ker = weighted(lambda *a: sparse_pallas.sparse_kl_per_token(*a, idx, valid, p, interpret=True, block_k=128,
                                                                 resident=resident, dk_in_vmem=dk_in_vmem,
                                                                 q_chunk=8))
    (value, grads), (want_value, want_grads) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(iq, ik, iw)
                                                for f in (ker, ref))
    assert_close(value, want_value, 1e-5)
    for g, w in zip(grads, want_grads):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)

    bf16 = tuple(a.astype(jnp.bfloat16) for a in (iq, ik, iw))
    grads16 = jax.jit(jax.grad(ker, argnums=(0, 1, 2)))(*bf16)
    want16 = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(a.astype(jnp.float32) for a in bf16))
    for g, w in zip(grads16, want16):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 2e-2)
