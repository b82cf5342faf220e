"""The causal MHA flash attention kernels (pallas_kernels/flash_attention) against the XLA reference.

Kernel level (Pallas interpreter on CPU): out, lse and the gradients of q, k, v (through both an out and an
lse cotangent) over packed documents with padding, several blocks each way so that blocks are skipped, and
for a context-parallel shard (zig-zag queries over the keys of the whole sequence). The block tables never
skip a block pair holding a visible pair. Model level: the dense and warm-up stages give the XLA path's
logits and indexer KL with the kernel per (batch, head) shard (training through the kernel with the
sequence split over `context`: tests/train/test_context_parallel.py).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from jax.sharding import NamedSharding

from glm5_jax import Transformer
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from pallas_kernels.flash_attention import kernel, ops
from pallas_kernels.masking import visible_mask
from tests.model.test_model_properties import TINY
from dsa_inputs import packed

SCALE = 256 ** -0.5


def random_qkv(key, B, T, S, H, D, Dv):
    ks = jax.random.split(key, 5)
    return (jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, S, H, D)),
            jax.random.normal(ks[2], (B, S, H, Dv)), jax.random.normal(ks[3], (B, T, H, Dv)),
            jax.random.normal(ks[4], (B, T, H)))


def check_against_reference(q, k, v, dout, dlse, q_pos, kv_pos, q_seg, kv_seg, block, backward_kernels,
                            allowed=None):
    def run(impl):
        def objective(q, k, v):
            out, lse = ops.flash_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, scale=SCALE, impl=impl,
                                           block=block, allowed_BTS=allowed)
            return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse), (out, lse)
        value_and_grad = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)
        if impl == "pallas_interpret":
            program = str(jax.make_jaxpr(value_and_grad)(q, k, v))
            assert all(name in program for name in backward_kernels), backward_kernels
        (_, (out, lse)), grads = jax.jit(value_and_grad)(q, k, v)
        return out, lse, grads

    out, lse, grads = run("pallas_interpret")
    want_out, want_lse, want_grads = run("reference")
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))    # the same queries see no key
    assert np.isinf(want_lse).any() and np.isfinite(want_lse).any()
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(want_lse), 0, want_lse),
                               atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", grads, want_grads):
        assert float(jnp.max(jnp.abs(w))) > 0.1, name
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")


def test_forward_and_gradients_match_reference_on_packed_documents():
    """3 x 3 blocks of 128; D = 192 + 64 and Dv = 256 like GLM-5's heads; dQ inside the dK/dV kernel."""
    B, T, H = 2, 384, 2
    pos, seg = packed(B, T, boundaries=(100, 290), pad_from=350)
    q, k, v, dout, dlse = random_qkv(jax.random.PRNGKey(0), B, T, T, H, 256, 256)
    check_against_reference(q, k, v, dout, dlse, pos, pos, seg, seg, block=128,
                            backward_kernels=("flash_attention_bwd_fused",))


def test_context_shard_and_unaligned_head_dims_match_reference(monkeypatch):
    """The queries of zig-zag shard 0 of 2 (chunks 0 and 3 of 4) over the keys of the whole sequence in
    natural order; T, S and the head dims (40, 20) are padded by ops.py. dQ from its own kernel (the
    backward of a dQ too large for VMEM) rather than inside the dK/dV kernel."""
    monkeypatch.setattr(kernel, "FUSED_DQ_BYTES", 0)
    B, S, H, c = 2, 320, 2, 80
    kv_pos, kv_seg = packed(B, S, boundaries=(130,), pad_from=300)
    rows = np.r_[0:c, 3 * c:4 * c]
    q, k, v, dout, dlse = random_qkv(jax.random.PRNGKey(1), B, 2 * c, S, H, 40, 20)
    check_against_reference(q, k, v, dout, dlse, kv_pos[:, rows], kv_pos, kv_seg[:, rows], kv_seg, block=128,
                            backward_kernels=("flash_attention_bwd_dkv", "flash_attention_bwd_dq"))


@pytest.mark.parametrize("fused_dq", [True, False])
def test_selection_mask_matches_reference(monkeypatch, fused_dq):
    """With a selection mask (DSA's top-k set as a [B, T, S] mask): attention over the visible AND allowed
    keys only. The reference gets the mask too; a few queries are allowed none of their visible keys
    (lse -inf, zero gradients), and the reference with every key allowed differs (the mask matters)."""
    if not fused_dq:
        monkeypatch.setattr(kernel, "FUSED_DQ_BYTES", 0)
    B, T, H = 2, 256, 2
    pos, seg = packed(B, T, boundaries=(90,), pad_from=240)
    q, k, v, dout, dlse = random_qkv(jax.random.PRNGKey(2), B, T, T, H, 128, 128)
    allowed = jax.random.bernoulli(jax.random.PRNGKey(3), 0.4, (B, T, T))
    allowed = allowed.at[:, 130:140].set(False)
    check_against_reference(q, k, v, dout, dlse, pos, pos, seg, seg, block=128, allowed=allowed,
                            backward_kernels=("flash_attention_bwd_fused",) if fused_dq else
                            ("flash_attention_bwd_dkv", "flash_attention_bwd_dq"))
    masked = ops.flash_attention(q, k, v, pos, pos, seg, seg, scale=SCALE, impl="reference", allowed_BTS=allowed)
    full = ops.flash_attention(q, k, v, pos, pos, seg, seg, scale=SCALE, impl="reference")
    assert np.isinf(masked.lse[:, 130:140]).all() and np.isfinite(full.lse[:, 130:140]).all()
    assert float(jnp.max(jnp.abs(masked.out - full.out))) > 0.1
    with pytest.raises(ValueError, match="allowed"):
        ops.flash_attention(q, k, v, pos, pos, seg, seg, scale=SCALE, impl="pallas_interpret",
                            allowed_BTS=allowed[:, :, :-1])


@pytest.mark.parametrize("boundaries", [(300, 700), tuple(range(50, 1024, 50))])
def test_block_tables_skip_only_invisible_blocks(boundaries):
    """Documents longer than a block: a pair is needed exactly when it holds a visible pair (so the whole
    causal upper triangle is skipped); documents shorter than a block: never skips a visible pair."""
    B, T, blk = 2, 1024, 128
    pos, seg = packed(B, T, boundaries=boundaries, pad_from=900)
    needed = np.asarray(kernel.needed_blocks(pos, pos, seg, seg, blk, blk))
    visible = np.asarray(visible_mask(pos, pos, seg, seg)).reshape(B, T // blk, blk, T // blk, blk)
    has_visible = visible.any(axis=(2, 4))
    if len(boundaries) == 2:
        np.testing.assert_array_equal(needed, has_visible)
    else:
        assert np.all(needed[has_visible]) and needed.sum() < 1.2 * has_visible.sum()
    assert not needed[:, np.triu_indices(T // blk, 1)[0], np.triu_indices(T // blk, 1)[1]].any()  # causal
    tables = kernel.block_tables(jnp.asarray(needed))
    fetch = np.asarray(tables.fetch).reshape(needed.shape)
    assert np.all(fetch[needed] == np.nonzero(needed)[2])     # a needed step loads its own block
    # a skipped step repeats the block loaded before it (no new DMA), or the first needed one
    for b, i, j in zip(*np.nonzero(~needed)):
        before = np.nonzero(needed[b, i, :j])[0]
        assert fetch[b, i, j] == (before[-1] if len(before) else int(np.argmax(needed[b, i])))


def test_rejects_unknown_impl():
    x = jnp.zeros((1, 8, 1, 128))
    p = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="unknown impl"):
        ops.flash_attention(x, x, x, p, p, p, p, scale=1.0, impl="splash")


# --------------------------------------------------------------------------------------------- model level
CFG = TINY.replace(num_nextn_predict_layers=0, mtp_depth=0, attention_mode="dense")


def _model_outputs(cfg, variables, tokens, mesh=None):
    fn = lambda v, t: (lambda o: (o.logits, o.stats.indexer_kl))(Transformer(cfg).apply(v, t))  # noqa: E731
    if mesh is None:
        return jax.device_get(jax.jit(fn)(variables, tokens))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        batch = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq")))
        return jax.device_get(jax.jit(fn)(variables, jax.device_put(tokens, batch)))


def test_warmup_stage_model_equals_xla_path():
    """Dense attention with the warm-up indexer KL: the flash kernel (MHA form, interpreted) and the warm-up
    KL kernel give the XLA absorbed-form logits and per-layer indexer KL (the warm-up target from the flash
    kernel's lse) with batch and heads split over chips (the kernels per shard). Training through the kernel (dense stage,
    gradients): tests/train/test_context_parallel.py."""
    cfg = CFG.replace(indexer_loss="warmup")
    variables = meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64)), jnp.int32)
    want_logits, want_kl = _model_outputs(cfg, variables, tokens)
    assert np.sum(want_kl > 1e-3) >= 2                        # a real KL in every full-indexer layer
    pallas = cfg.replace(attention_impl="pallas_interpret")
    program = str(jax.make_jaxpr(lambda v, t: Transformer(pallas).apply(v, t).logits)(variables, tokens))
    assert "flash_attention_fwd" in program                   # the kernel really runs
    assert "indexer_kl_warmup_lse" in program                 # and so does the warm-up KL kernel
    mesh = build_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=2), jax.devices()[:4])
    logits, kl = _model_outputs(pallas, variables, tokens, mesh)
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=0)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-5, atol=1e-7)


def test_sparse_stage_masked_flash_model_equals_xla_path():
    """The sparse stage at short context on TPU impls: the top-k selection as a mask over the flash kernel
    (MHA form) and the indexer KL on the warm-up kernels over that mask give the XLA path's logits and
    sparse-stage KL (per-slot gathers, target from the absorbed-form attention over the selected slots).
    64 tokens, k = 8: the selection drops most keys."""
    cfg = CFG.replace(attention_mode="sparse", indexer_loss="sparse", masked_flash_factor=8.0)
    variables = meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(1), jnp.zeros((1, 8), jnp.int32)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 64)), jnp.int32)
    want_logits, want_kl = _model_outputs(cfg, variables, tokens)
    assert np.sum(want_kl > 1e-3) >= 2
    pallas = cfg.replace(attention_impl="pallas_interpret")
    program = str(jax.make_jaxpr(lambda v, t: Transformer(pallas).apply(v, t).logits)(variables, tokens))
    assert "flash_attention_fwd_masked" in program and "indexer_kl_warmup" in program
    assert "indexer_kl_warmup_lse" not in program             # the indexer's lse comes with the top-k
    assert "sparse_mla_fwd" not in program                    # no per-slot gathers
    gathered = cfg.replace(attention_impl="pallas_interpret", masked_flash_factor=0.0)
    assert "sparse_mla_fwd" in str(jax.make_jaxpr(lambda v, t: Transformer(gathered).apply(v, t).logits)(
        variables, tokens))
    mesh = build_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=2), jax.devices()[:4])
    logits, kl = _model_outputs(pallas, variables, tokens, mesh)
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=0)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-5, atol=1e-7)
