"""Warm-up indexer KL kernel (Pallas interpreter on CPU) against the XLA reference: the loss sums and the
gradients of index q, k, w on packed documents with uneven boundaries, padding, and blocks that are
partial, invisible (skipped by the tables) or hold a query without keys. With a selection mask, kernels and
XLA impl against the sparse stage's KL of the same selection, its target computed here by hand.

Background: docs/architecture.md#dsa-training-stages-and-the-indexer-kl.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import masking
from pallas_kernels.indexer_kl import kernel, ops, reference
from pallas_kernels.lightning_indexer import reference as indexer_reference
from dsa_inputs import packed

SCALE = 0.25
B, H, D, HI, DI = 2, 2, 64, 3, 32      # D and DI are padded to 128 by ops.py


def inputs(T, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    pos, seg = packed(B, T, boundaries=(45, 170, 171, 300), pad_from=T - 70, shift=29)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, H, D))
    # the attention's own lse of the scaled logits over the visible keys (-inf for a query without keys)
    visible = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0) & (pos[:, None, :] <= pos[:, :, None])
    logits = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * SCALE
    lse = jnp.swapaxes(jax.nn.logsumexp(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1), 1, 2)
    iq = jax.random.normal(ks[2], (B, T, HI, DI))
    ik = jax.random.normal(ks[3], (B, T, DI))
    iw = jax.random.normal(ks[4], (B, T, HI)) * 0.3
    return (q, k, lse, iq, ik, iw, pos, pos, seg, seg)


def loss_and_grads(args, impl, weights, allowed=None, index_lse=None):
    """sum_b weights[b] * sum_t KL_t (an uneven cotangent per row) + the count, and d/d(iq, ik, iw)."""
    def objective(iq, ik, iw):
        kl_B, count_B = ops.warmup_kl_sums(*args[:3], iq, ik, iw, *args[6:], allowed, scale=SCALE, impl=impl,
                                           index_lse_BT=index_lse)
        return jnp.sum(kl_B * weights), (kl_B, count_B)

    return jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(*args[3:6])


def test_kernel_matches_reference_loss_and_grads():
    """384 tokens: two query blocks of 256 (the last one padded; one query group each), key blocks of 128."""
    T = 384
    args = inputs(T)
    weights = jnp.asarray([1.0, -0.5])
    (_, (kl, count)), grads = loss_and_grads(args, "pallas_interpret", weights)
    (_, (want_kl, want_count)), want_grads = loss_and_grads(args, "xla", weights)
    np.testing.assert_array_equal(count, want_count)
    assert float(count[1]) == T - 70                                     # padding has no key set
    np.testing.assert_allclose(kl, want_kl, rtol=2e-5)
    assert np.all(np.asarray(want_kl) > 1.0)                             # a real KL to match
    for got, want in zip(grads, want_grads):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)


def run_kernel(args, **kw):
    """kernel.warmup_indexer_kl on 128-query / 128-key blocks, head dims padded to 128."""
    q, k, lse, iq, ik, iw, pos, _, seg, _ = args
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 128 - x.shape[-1])])   # noqa: E731
    return kernel.warmup_indexer_kl(pad(q), pad(k), jnp.swapaxes(lse, 1, 2), pad(iq), pad(ik), jnp.swapaxes(iw, 1, 2),
                                    pos, pos, seg, seg, scale=SCALE, interpret=True, **kw)


def test_loss_only_kernel_per_token():
    """The kernel without gradients (kernel.py's ``with_grads=False``): per-token KL as the reference's."""
    args = inputs(256)
    q, k, lse, iq, ik, iw, pos, _, seg, _ = args
    r = run_kernel(args, with_grads=False)
    want_kl, want_has = reference.indexer_kl_per_token(q, k, iq, ik, iw, pos, pos, seg, seg, scale=SCALE,
                                                       stage="warmup", lse_BTH=lse)
    assert r.d_iq is None and r.d_ik is None and r.d_iw is None
    np.testing.assert_array_equal(r.has_set_BT, want_has)
    np.testing.assert_allclose(r.kl_BT, want_kl, rtol=2e-5, atol=1e-6)


def test_separate_dk_kernel_for_long_key_sets():
    """d ik from the keys-outer kernel (used when the fp32 [S, d_I] accumulator does not fit VMEM; forced
    here) equals the reference gradient, as do d iq and d w from the KL kernel without it."""
    args = inputs(256, seed=2)
    r = run_kernel(args, resident_dk_bytes=0)
    program = str(jax.make_jaxpr(lambda *a: run_kernel(a, resident_dk_bytes=0))(*args))
    assert "indexer_kl_warmup_dk" in program
    (_, (_, _)), want = loss_and_grads(args, "xla", jnp.ones(B))
    for got, w in zip((r.d_iq[..., :DI], r.d_ik[..., :DI], r.d_iw), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(w))))


def test_undifferentiated_op_runs_the_loss_only_kernel():
    args = inputs(200)
    call = lambda *a: ops.warmup_kl_sums(*a, scale=SCALE, impl="pallas_interpret")   # noqa: E731
    program = str(jax.make_jaxpr(call)(*args))
    assert "indexer_kl_warmup_lse" in program and "name=indexer_kl_warmup " in program.replace("\n", " ")
    assert "_grads" not in program


def test_gradient_formula_through_the_relu():
    """The kernel's d iq / d w for one query against autodiff of the scores' definition with the target
    held fixed: dKL/dI = softmax(I) - p, then dI/d(iq_h . ik) = w_h [iq_h . ik > 0]."""
    args = inputs(200, seed=1)
    q, k, lse, iq, ik, iw, pos, _, seg, _ = args
    r = ops._run((*args, None, None), (SCALE, 128, 128, True), with_grads=True)[1]
    b, t = 0, 150
    visible = (seg[b] == seg[b, t]) & (pos[b] <= pos[b, t])
    logits = jnp.einsum("hd,shd->hs", q[b, t], k[b], precision="highest") * SCALE
    p = jnp.where(visible, jnp.exp(logits - lse[b, t][:, None]), 0.0).mean(0)

    def kl_t(iq_t, iw_t):
        scores = jnp.einsum("h,hs->s", iw_t, jax.nn.relu(jnp.einsum("hd,sd->hs", iq_t, ik[b], precision="highest")))
        log_q = jax.nn.log_softmax(jnp.where(visible, scores, -jnp.inf))
        return jnp.sum(jnp.where(visible, -p * log_q, 0.0))

    d_iq, d_iw = jax.grad(kl_t, argnums=(0, 1))(iq[b, t], iw[b, t])
    np.testing.assert_allclose(r[0][b, t], d_iq, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(d_iq))))
    np.testing.assert_allclose(r[2][b, t], d_iw, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(d_iw))))


def test_declared_cost_counts_block_rereads():
    d = kernel.Shapes(B=1, T=4096, S=4096, H=64, D=256, HI=32, DI=128, bq=256, bk=128)
    steps = sum(2 * (i + 1) for i in range(16))   # causal: query block i of 256 needs key blocks 0 .. 2i+1
    pairs = steps * 256 * 128
    per_query, per_key = 32 * 128 * 4 + 32 * 4 + 8, 128 * 4 + 8          # iq, iw, meta; ik, meta
    att_query, att_key = 64 * (256 * 2 + 4), 64 * 256 * 2                # q, lse; k
    grads = 4096 * 32 * 129 * 4                                          # d iq, d w
    lse_cost, kl_cost = kernel.cost(d, 2, 4, with_grads=True)
    assert lse_cost.flops == pairs * 2 * 32 * 128
    assert lse_cost.bytes_accessed == 4096 * (per_query + 4) + steps * 128 * per_key
    assert kl_cost.flops == pairs * (2 * 64 * 256 + 6 * 32 * 128)
    # the query side once (with lseI in, kl out), a key block per needed step, d ik once per query group
    assert kl_cost.bytes_accessed == (4096 * (att_query + per_query + 8) + steps * 128 * (att_key + per_key)
                                      + grads + 2 * 4096 * 128 * 4)
    _, kl_cost, dk_cost = kernel.cost(d, 2, 4, with_grads=True, resident=False)
    assert kl_cost.flops == pairs * (2 * 64 * 256 + 4 * 32 * 128)
    assert dk_cost.flops == pairs * (2 * 64 * 256 + 4 * 32 * 128)
    # keys outer: the key side once (with d ik out), a query block per needed step
    assert dk_cost.bytes_accessed == 4096 * (att_key + per_key + 128 * 4) + steps * 256 * (att_query + per_query + 4)


def test_rejects_mismatched_shapes():
    x = jnp.zeros((1, 128, 1, 128))
    with pytest.raises(ValueError, match="iq has shape"):
        kernel.check_shapes(x, x, jnp.zeros((1, 1, 128)), jnp.zeros((1, 64, 1, 128)), jnp.zeros((1, 128, 128)),
                            jnp.zeros((1, 1, 128)), 128, 128)


# ---- with a selection mask: the sparse stage's KL computed densely
TOPK, EMPTY_QUERY = 48, (0, 100)   # a query that sees keys but is given an empty selection


def selected(args, seed=3):
    """A random DSA-style selection -- up to TOPK distinct visible keys per query (all of them for a query
    with fewer), none for EMPTY_QUERY -- as (idx, valid [B, T, TOPK]), and its mask [B, T, S]."""
    pos, seg = args[6], args[8]
    visible = masking.visible_mask(pos, pos, seg, seg)
    draw = jax.random.uniform(jax.random.PRNGKey(seed), visible.shape)
    top, idx = jax.lax.top_k(jnp.where(visible, draw, -1.0), TOPK)
    valid = (top >= 0.0).at[EMPTY_QUERY].set(False)
    return idx, valid, masking.selection_mask(idx, valid, visible.shape[2])


def with_masked_lse(args, allowed):
    """The inputs with the attention's lse over the allowed keys, and the sparse stage's target by hand:
    the head-mean of exp(s_h - lse_h) at each valid selected slot."""
    q, k = args[:2]
    logits_BHTS = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * SCALE
    lse_BHT = jax.nn.logsumexp(jnp.where(allowed[:, None], logits_BHTS, -jnp.inf), axis=-1)
    return (*args[:2], jnp.swapaxes(lse_BHT, 1, 2), *args[3:]), logits_BHTS, lse_BHT


def hand_target(logits_BHTS, lse_BHT, idx, valid):
    at_slots = jnp.take_along_axis(logits_BHTS, idx[:, None], axis=-1)   # [B, H, T, K]
    probs = jnp.exp(at_slots - jnp.where(jnp.isfinite(lse_BHT), lse_BHT, 0.0)[..., None])
    return jnp.where(valid, jnp.mean(probs, axis=1), 0.0)


def sparse_stage(args, idx, valid, target, weights):
    """The sparse stage's per-token KL (reference.py, given target) -> (weighted loss, (kl sums, count)) and
    d/d(iq, ik, iw)."""
    def objective(iq, ik, iw):
        kl, has_set = reference.indexer_kl_per_token(None, None, iq, ik, iw, None, None, None, None, scale=None,
                                                     stage="sparse", idx_BTK=idx, valid_BTK=valid, target_BTK=target)
        kl_B = jnp.sum(kl, axis=1)
        return jnp.sum(kl_B * weights), (kl_B, jnp.sum(has_set.astype(jnp.float32), axis=1))

    return jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(*args[3:6])


@pytest.mark.parametrize("impl,given_lse", [("pallas_interpret", False), ("xla", False), ("pallas_interpret", True)])
def test_selection_mask_gives_the_sparse_stage_kl(impl, given_lse):
    """384 packed tokens with padding, TOPK random visible keys per query (about half of a long document's
    keys), one query with an empty selection: loss sums and gradients of the op with the selection's mask
    equal the sparse stage's KL of the same selection with the target computed by hand. ``given_lse``: the
    indexer's log-sum-exp over the selection handed in (as the top-k does), and the kernels' lse pass skipped."""
    args = inputs(384)
    idx, valid, allowed = selected(args)
    visible = masking.visible_mask(args[6], args[6], args[8], args[8])
    assert bool(jnp.any(jnp.sum(visible, -1) > 2 * TOPK)) and bool(jnp.any(visible[EMPTY_QUERY]))
    args, logits, lse = with_masked_lse(args, allowed)
    weights = jnp.asarray([1.0, -0.5])
    index_lse = None
    if given_lse:
        index_lse = jax.nn.logsumexp(indexer_reference.index_scores(*args[3:6], allowed), axis=-1)
        assert not bool(jnp.isfinite(index_lse[EMPTY_QUERY]))
        program = str(jax.make_jaxpr(lambda *a: loss_and_grads(args, impl, weights, allowed, a[0]))(index_lse))
        assert "indexer_kl_warmup_grads" in program and "indexer_kl_warmup_lse" not in program
    (_, (kl, count)), grads = loss_and_grads(args, impl, weights, allowed, index_lse)
    (_, (want_kl, want_count)), want_grads = sparse_stage(args, idx, valid, hand_target(logits, lse, idx, valid),
                                                          weights)
    np.testing.assert_array_equal(count, want_count)
    assert float(count[0]) == 384 - 1 and float(count[1]) == 384 - 70   # the empty selection; padding
    np.testing.assert_allclose(kl, want_kl, rtol=2e-5)
    assert np.all(np.asarray(want_kl) > 1.0)
    for got, want in zip(grads, want_grads):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)


def test_selection_mask_in_the_loss_only_and_separate_dk_kernels():
    """The mask in the kernels ops.py does not exercise above: the loss-only KL kernel (per-token KL) and the
    keys-outer d ik kernel (forced), on 128 x 128 blocks, against the sparse stage of the same selection."""
    args = inputs(256, seed=4)
    idx, valid, allowed = selected(args, seed=5)
    args, logits, lse = with_masked_lse(args, allowed)
    target = hand_target(logits, lse, idx, valid)
    mask = allowed.astype(jnp.int8)
    want_kl, want_has = reference.indexer_kl_per_token(None, None, *args[3:6], None, None, None, None, scale=None,
                                                       stage="sparse", idx_BTK=idx, valid_BTK=valid, target_BTK=target)
    r = run_kernel(args, with_grads=False, allowed_BTS=mask)
    np.testing.assert_array_equal(r.has_set_BT, want_has)
    assert not bool(r.has_set_BT[EMPTY_QUERY])
    np.testing.assert_allclose(r.kl_BT, want_kl, rtol=2e-5, atol=1e-6)
    r = run_kernel(args, allowed_BTS=mask, resident_dk_bytes=0)
    program = str(jax.make_jaxpr(lambda *a: run_kernel(a[:-1], allowed_BTS=a[-1], resident_dk_bytes=0))(*args, mask))
    assert "indexer_kl_warmup_dk" in program
    _, want = sparse_stage(args, idx, valid, target, jnp.ones(B))
    for got, w in zip((r.d_iq[..., :DI], r.d_ik[..., :DI], r.d_iw), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(w))))


def test_declared_cost_of_the_mask():
    """Each kernel reads one int8 mask byte per (query, key) pair of its needed steps; nothing else changes."""
    d = kernel.Shapes(B=1, T=4096, S=4096, H=64, D=256, HI=32, DI=128, bq=256, bk=128)
    pairs = sum(2 * (i + 1) for i in range(16)) * 256 * 128
    for resident in (True, False):
        plain = kernel.cost(d, 2, 4, with_grads=True, resident=resident)
        masked = kernel.cost(d, 2, 4, with_grads=True, resident=resident, masked=True)
        assert len(masked) == len(plain) == (2 if resident else 3)
        for m, p in zip(masked, plain):
            assert (m.flops, m.transcendentals) == (p.flops, p.transcendentals)
            assert m.bytes_accessed == p.bytes_accessed + pairs


def test_rejects_a_bad_mask():
    x = jnp.zeros((1, 128, 1, 128))
    pos = jnp.zeros((1, 128), jnp.int32)
    args = (x, x, jnp.zeros((1, 1, 128)), x, jnp.zeros((1, 128, 128)), jnp.zeros((1, 1, 128)), pos, pos, pos, pos)
    with pytest.raises(ValueError, match="allowed has shape"):
        kernel.warmup_indexer_kl(*args, jnp.zeros((1, 128, 64), bool), scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="allowed must be bool or int8"):
        kernel.warmup_indexer_kl(*args, jnp.zeros((1, 128, 128), jnp.float32), scale=1.0, interpret=True)
