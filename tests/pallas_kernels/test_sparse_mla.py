"""Sparse MLA Pallas kernels (forward, custom_vjp backward) vs the XLA reference in interpret mode."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dsa_inputs import assert_close, normal, positions_and_segments
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.lightning_indexer import reference as indexer_reference
from pallas_kernels.sparse_mla import kernel, ops, reference
from pallas_kernels.row_scatter import packing, reference as row_scatter_reference

SCALE = 0.2


def make_inputs(B, T, S, H, C, topk, dtype=jnp.float32, seed=0):
    """q, kv and a real top-k selection (so early queries have fewer valid slots than k and padded
    queries have none)."""
    rng = np.random.default_rng(seed)
    q = normal(rng, (B, T, H, C), dtype)
    kv = normal(rng, (B, S, C), dtype)
    q_pos, kv_pos, q_seg, kv_seg = positions_and_segments(B, T, S)
    select = jax.jit(functools.partial(indexer_reference.indexer_topk, topk=topk))
    idx, valid = select(normal(rng, (B, T, 2, 8)), normal(rng, (B, S, 8)), normal(rng, (B, T, 2)),
                        q_pos, kv_pos, q_seg, kv_seg)
    return q, kv, idx, valid


def scalar_of(out, lse):
    """A scalar touching out and lse with non-trivial cotangents."""
    lse_term = jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0)
    return jnp.sum(jnp.cos(out.astype(jnp.float32))) + 0.5 * jnp.sum(lse_term)


def loss_of(impl, idx, valid, v_dim):
    return lambda q, kv: scalar_of(*ops.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=v_dim, impl=impl)[:2])


# (B, T, S, H, C, v_dim, topk, block_k): k not a multiple of block_k, T not a multiple of 8.
CASES = [(2, 13, 200, 4, 40, 32, 150, 64),
         (1, 10, 64, 8, 24, 16, 20, 128)]


@pytest.mark.parametrize("B,T,S,H,C,V,topk,block_k", CASES)
def test_forward_matches_reference_fp32(B, T, S, H, C, V, topk, block_k):
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk)
    valid_np = np.asarray(valid)
    assert (~valid_np).any() and valid_np.any() and not valid_np.any(-1).all()  # all three regimes
    out, lse = kernel.sparse_mla_fwd(q, kv, idx, valid, scale=SCALE, v_dim=V, block_k=block_k, interpret=True)
    ref_out, ref_lse = jax.jit(functools.partial(reference.sparse_mla, scale=SCALE, v_dim=V))(q, kv, idx, valid)
    assert out.shape == (B, T, H, V) and out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("B,T,S,H,C,V,topk,block_k", CASES)
def test_kl_target_sweep_matches_reference(B, T, S, H, C, V, topk, block_k):
    """The forward kernel's second sweep emits the indexer KL target: the head-mean attention probability
    of every selected slot, as the reference computes it from the same logits (0 at invalid slots, each
    query's target sums to 1 or, without valid slots, to 0); out and lse are unchanged by the sweep."""
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, seed=3)
    out, lse, target = kernel.sparse_mla_fwd(q, kv, idx, valid, scale=SCALE, v_dim=V, block_k=block_k,
                                             interpret=True, with_target=True)
    ref_out, ref_lse, ref_target = jax.jit(functools.partial(reference.sparse_mla, scale=SCALE, v_dim=V,
                                                             with_target=True))(q, kv, idx, valid)
    assert target.shape == (B, T, topk) and target.dtype == jnp.float32
    assert_close(target, ref_target, 1e-5)
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)
    valid_np = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(target)[~valid_np], 0.0)
    np.testing.assert_allclose(np.asarray(target).sum(-1), valid_np.any(-1).astype(np.float32), atol=1e-5)
    # through ops with gradients attached: the target carries none, out's gradients are the plain kernel's
    grads = jax.grad(lambda q_, kv_: scalar_of(*ops.sparse_mla(q_, kv_, idx, valid, scale=SCALE, v_dim=V,
                                                               impl="pallas_interpret", with_target=True)[:2]),
                     argnums=(0, 1))(q, kv)
    ref_grads = jax.grad(loss_of("reference", idx, valid, V), argnums=(0, 1))(q, kv)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, 1e-4)


def test_gradients_match_reference_fp32():
    B, T, S, H, C, V, topk, _ = CASES[0]
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, seed=1)
    got = jax.jit(jax.grad(loss_of("pallas_interpret", idx, valid, V), argnums=(0, 1)))(q, kv)
    want = jax.jit(jax.grad(loss_of("reference", idx, valid, V), argnums=(0, 1)))(q, kv)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32 and np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)


def test_forward_and_gradients_bf16():
    B, T, S, H, C, V, topk, _ = CASES[1]
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, dtype=jnp.bfloat16, seed=2)
    out, lse, _ = ops.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V, impl="pallas_interpret")
    ref_out, ref_lse, _ = ops.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V, impl="reference")
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref_out, 2e-2)
    assert_close(lse, ref_lse, 1e-3)
    got = jax.jit(jax.grad(loss_of("pallas_interpret", idx, valid, V), argnums=(0, 1)))(q, kv)
    q32, kv32 = q.astype(jnp.float32), kv.astype(jnp.float32)
    want = jax.jit(jax.grad(loss_of("reference", idx, valid, V), argnums=(0, 1)))(q32, kv32)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 3e-2)


def test_bf16_kv_rows_gathered_packed_equal_the_bf16_rows():
    """With bf16 kv the kernels gather rows packed as bf16 pairs in uint32 lanes (kernel.kv_row_view: C = 288 ->
    256 lanes) and unpack them exactly: forward (out, lse, KL target) and backward (dq, row gradients) equal
    bit for bit the same kernels gathering the bf16 rows [B, S, 1, C] unpacked. A row DMA moves whole 128-lane
    tiles of 32-bit words: 256 x 4 = 1,024 bytes packed against 384 x 4 = 1,536 for a bf16 row (its (2, 128)
    tiles interleave two rows); at GLM-5's C = 576, 1,536 against 2,560."""
    B, T, S, H, C, V, topk = 1, 21, 24, 2, 288, 200, 12
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, dtype=jnp.bfloat16, seed=8)
    packed, plain = kernel.kv_row_view(kv), kv[:, :, None, :]
    assert packed.shape == (B, S, 1, 256) and packed.dtype == jnp.uint32
    assert kernel.gathered_row_bytes(packed) == 1024 and kernel.gathered_row_bytes(plain) == 1536
    assert kernel.gathered_row_bytes(jnp.zeros((1, 4, 1, 576), jnp.bfloat16)) == 2560
    assert kernel.gathered_row_bytes(kernel.kv_row_view(jnp.zeros((1, 4, 576), jnp.bfloat16))) == 1536
    fwd = functools.partial(kernel.sparse_mla_fwd, q, idx_BTK=idx, valid_BTK=valid, scale=SCALE, v_dim=V, block_k=8,
                            interpret=True, with_target=True)
    got, want = fwd(kv_BSC=packed), fwd(kv_BSC=plain)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    out, lse = got[:2]
    dout = normal(np.random.default_rng(9), out.shape, jnp.bfloat16)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    bwd = functools.partial(kernel.sparse_mla_bwd_rows, q, idx_BTK=idx, valid_BTK=valid, dout_BTHV=dout, lse_BTH=lse,
                            delta_BTH=delta, scale=SCALE, v_dim=V, block_k=8, dma_rows=True, packed_rows=True,
                            interpret=True)
    for g, w in zip(bwd(kv_BSC=packed), bwd(kv_BSC=plain)):
        assert np.abs(np.asarray(w)).max() > 0
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # declared bytes (forward): every padded (query, slot) row at its DMA's bytes + q, out and lse per query;
    # T = 21 -> 24 (blocks of 8 queries), k = 12 -> 16 (k-blocks of 8)
    d = kernel._prepare(q, idx, valid, S, 8)
    per_query = B * 24 * H * (C + V) * 2 + B * 24 * H * 4
    assert kernel._cost(d, V, 2, backward=False, row_bytes_in=1024).bytes_accessed == B * 24 * 16 * 1024 + per_query


def test_reference_query_chunks_agree():
    """The XLA reference's query chunking (ragged last chunk: padded queries) changes nothing: outputs,
    lse and gradients equal those of a single chunk; the default chunk fits the gathered-rows budget."""
    B, T, S, H, C, V, topk, _ = CASES[0]
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, seed=5)

    def run(q_chunk):
        def loss(q, kv):
            out, lse = reference.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V, q_chunk=q_chunk)
            return scalar_of(out, lse), (out, lse)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, kv)

    (_, (out1, lse1)), grads1 = run(T)
    (_, (out3, lse3)), grads3 = run(3)
    assert_close(out3, out1, 1e-6)
    assert_close(lse3, lse1, 1e-6)
    for g3, g1 in zip(grads3, grads1):
        assert_close(g3, g1, 1e-5)   # dkv: scatter-add order differs
    per_query = 2 * 256 * 144 * 4                  # bench shape: B=2, k=256, C=144, fp32
    chunk = reference.rows_q_chunk(2, 256, 144, 4)
    assert chunk & (chunk - 1) == 0 and chunk * per_query <= reference.ROWS_CHUNK_BYTES < 2 * chunk * per_query
    assert reference.rows_q_chunk(1, 2048, 576, 2) == 1   # one query's rows already exceed the budget


@pytest.mark.parametrize("C,V", [(16, 8), (288, 200)])   # rows of 1 and 3 lane tiles, value in 1 and 2
def test_backward_chunks_and_scatter_add(C, V):
    """Several backward query chunks, with keys selected by many queries (scatter-add collisions)."""
    B, T, S, H, topk = 1, 21, 24, 2, 12
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, seed=3)
    out, lse = reference.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V)
    dout = normal(np.random.default_rng(4), out.shape)
    delta = jnp.sum(dout * out, axis=-1)
    dq, dkv = ops.sparse_mla_grads(q, kv, idx, valid, dout, lse, delta, scale=SCALE, v_dim=V,
                                   interpret=True, q_chunk=8)
    _, vjp = jax.vjp(lambda a, b: reference.sparse_mla(a, b, idx, valid, scale=SCALE, v_dim=V)[0], q, kv)
    want_dq, want_dkv = vjp(dout)
    assert_close(dq, want_dq, 1e-5)
    assert_close(dkv, want_dkv, 1e-5)


def test_bf16_row_gradients_travel_packed_and_are_added_in_fp32():
    """With bf16 kv the backward kernel writes each row gradient rounded to bf16, packed two per uint32 lane
    (C = 288: 384 fp32 lanes -> 256 packed): unpacked, they are exactly the bf16 roundings of the fp32 rows
    the kernel writes otherwise, and ops.sparse_mla_grads' d(kv) is the fp32 sum of those roundings."""
    B, T, S, H, C, V, topk = 1, 21, 24, 2, 288, 200, 12
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, dtype=jnp.bfloat16, seed=6)
    out, lse = reference.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V)
    dout = normal(np.random.default_rng(7), out.shape, jnp.bfloat16)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    bwd = functools.partial(kernel.sparse_mla_bwd_rows, q, kv, idx, valid, dout, lse, delta, scale=SCALE, v_dim=V,
                            dma_rows=True, interpret=True)
    _, rows = bwd()
    _, packed = bwd(packed_rows=True)
    assert rows.shape[-1] == 384 and packed.shape[-1] == 256 and packed.dtype == jnp.uint32
    rounded = np.asarray(rows.astype(jnp.bfloat16).astype(jnp.float32))
    assert np.abs(rounded - np.asarray(rows)).max() > 0
    np.testing.assert_array_equal(packing.unpack_bf16_pairs(packed, 384), rounded)
    _, dkv = ops.sparse_mla_grads(q, kv, idx, valid, dout, lse, delta, scale=SCALE, v_dim=V, interpret=True,
                                  q_chunk=8)
    want = row_scatter_reference.row_scatter_add(jnp.zeros((B, S, 384), jnp.float32),
                                                 jnp.asarray(rounded).reshape(B, -1, 384),
                                                 jnp.where(valid, idx, S).reshape(B, -1))
    assert_close(dkv, want[..., :C], 1e-6)


def test_tpu_interpreter_out_of_bounds_checked():
    B, T, S, H, C, V, topk = 1, 8, 16, 2, 16, 8, 6
    q, kv, idx, valid = make_inputs(B, T, S, H, C, topk, seed=5)
    params = pltpu.InterpretParams(out_of_bounds_reads="raise")
    try:
        out, lse = kernel.sparse_mla_fwd(q, kv, idx, valid, scale=SCALE, v_dim=V, block_k=8, interpret=params)
        dout = jnp.ones_like(out)
        dq, rows = kernel.sparse_mla_bwd_rows(q, kv, idx, valid, dout, lse, jnp.sum(out, -1),
                                              scale=SCALE, v_dim=V, block_k=8, interpret=params)
        # the row gradients as [..., 1, W] rows zero-padded to 128 lanes, as ops.sparse_mla_grads asks
        dq_w, rows_w = kernel.sparse_mla_bwd_rows(q, kv, idx, valid, dout, lse, jnp.sum(out, -1), scale=SCALE,
                                                  v_dim=V, block_k=8, dma_rows=True, interpret=params)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    ref_out, ref_lse = reference.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V)
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)
    _, vjp = jax.vjp(lambda a: reference.sparse_mla(a, kv, idx, valid, scale=SCALE, v_dim=V)[0], q)
    assert_close(dq, vjp(dout)[0], 1e-5)
    assert np.all(np.asarray(rows)[~np.asarray(valid)] == 0)
    assert rows_w.shape == rows.shape[:3] + (1, 128)
    np.testing.assert_array_equal(np.asarray(rows_w[..., 0, :C]), np.asarray(rows))
    assert np.all(np.asarray(rows_w[..., 0, C:]) == 0)
    np.testing.assert_array_equal(np.asarray(dq_w), np.asarray(dq))


def test_inside_shard_map_over_queries():
    """How the model calls it: queries split over devices, kv whole; grads of kv summed over devices."""
    mesh = jax.make_mesh((2,), ("q",))
    B, T, S, H, C, V, topk = 1, 16, 40, 2, 16, 8, 12
    specs = (P(None, "q"), P(), P(None, "q"), P(None, "q"))
    inputs = make_inputs(B, T, S, H, C, topk, seed=6)
    q, kv, idx, valid = (jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(inputs, specs))

    def loss(impl):
        def per_device(q, kv, idx, valid):
            out = ops.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V, impl=impl).out
            return jax.lax.psum(jnp.sum(jnp.sin(out)), "q")

        return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss("pallas_interpret"), argnums=(0, 1)))(q, kv, idx, valid)
        want = jax.jit(jax.value_and_grad(loss("reference"), argnums=(0, 1)))(q, kv, idx, valid)
    assert_close(got[0], want[0], 1e-5)
    for g, w in zip(got[1], want[1]):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(g, w, 1e-5)


def test_dsa_equals_dense_when_every_visible_key_fits_in_k():
    """With k >= S the kernels' DSA (indexer top-k + sparse attention) is dense attention
    (docs/architecture.md#top-k-selection-and-validity)."""
    from pallas_kernels.lightning_indexer import ops as indexer_ops
    from pallas_kernels.masking import visible_mask

    B, T, S, H, C, V = 2, 12, 30, 2, 16, 8
    rng = np.random.default_rng(7)
    q, kv = normal(rng, (B, T, H, C)), normal(rng, (B, S, C))
    pos_seg = positions_and_segments(B, T, S)
    idx, valid = indexer_ops.indexer_topk(normal(rng, (B, T, 2, 8)), normal(rng, (B, S, 8)),
                                          normal(rng, (B, T, 2)), *pos_seg, topk=64, impl="pallas_interpret")
    out, lse, _ = ops.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V, impl="pallas_interpret")
    dense_out, dense_lse = reference.dense_mla(q, kv, visible_mask(*pos_seg), scale=SCALE, v_dim=V)
    assert_close(out, dense_out, 1e-5)
    assert_close(lse, dense_lse, 1e-5)


def test_slot_block_takes_the_largest_block_that_pads_k_least():
    # GLM-5's k = 2048: one 2048-slot step a query forward, two 1024-slot steps backward
    assert kernel.slot_block(2048, kernel.FWD_BLOCK_K) == 2048
    assert kernel.slot_block(2048, kernel.BWD_BLOCK_K) == 1024
    # the pooled indexer's 2,063 slots: 5 x 512 = 2,560 padded slots, not 2 x 2048 = 4,096 or 3 x 1024 = 3,072
    assert kernel.slot_block(2063, kernel.FWD_BLOCK_K) == 512
    # 3,000 slots: 1024 and 512 both pad to 3,072; the larger block wins
    assert kernel.slot_block(3000, 2048) == 1024
    # short selections: one block of k rounded up to 128 lanes; tests' small blocks are kept as given
    assert kernel.slot_block(100, 2048) == 128
    assert kernel.slot_block(40, 16) == 16
