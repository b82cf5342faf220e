"""The Pallas kernels under the TPU interpreter's dynamic race detector and out-of-bounds checks, with the
grid's parallel dimensions split over two simulated cores (v5p's megacore): sparse MLA forward and
backward rows, and the lightning indexer's scores, each compared with its XLA reference. A deliberately
racy kernel (reading a VMEM buffer while a DMA into it is in flight) shows the detector fires."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsa_inputs import assert_close, normal, positions_and_segments
from pallas_kernels.lightning_indexer import kernel as indexer_kernel
from pallas_kernels.lightning_indexer import reference as indexer_reference
from pallas_kernels.masking import visible_mask
from pallas_kernels.sparse_mla import kernel as sparse_kernel
from pallas_kernels.sparse_mla import reference as sparse_reference

CHECKED = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
SCALE = 0.2


def run_checked(fn, *args):
    """fn(*args, interpret=CHECKED) -> (outputs, whether the race detector saw a race). The detector's
    state belongs to one pallas_call, so `fn` must run exactly one."""
    try:
        out = jax.block_until_ready(fn(*args, interpret=CHECKED))
        races = interpret_pallas_call.races
        assert races is not None, "the race detector did not run"
        return out, races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def _racy_kernel(x_hbm, o_ref, scratch, sem):
    copy = pltpu.make_async_copy(x_hbm, scratch, sem)
    copy.start()
    o_ref[...] = scratch[...]                 # reads the DMA's destination before waiting on it
    copy.wait()


def racy_copy(x, *, interpret):
    return pl.pallas_call(
        _racy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        interpret=interpret)(x)


def test_detector_reports_a_read_during_a_dma():
    _, raced = run_checked(racy_copy, jnp.ones((8, 128), jnp.float32))
    assert raced


def test_sparse_mla_kernels_race_free_and_in_bounds():
    B, T, S, H, C, V, topk, block_k = 1, 8, 16, 2, 16, 8, 12, 8      # 2 key blocks, one part-filled
    rng = np.random.default_rng(0)
    q, kv = normal(rng, (B, T, H, C)), normal(rng, (B, S, C))
    pos_seg = positions_and_segments(B, T, S)
    idx, valid = indexer_reference.indexer_topk(normal(rng, (B, T, 2, 8)), normal(rng, (B, S, 8)),
                                                normal(rng, (B, T, 2)), *pos_seg, topk=topk)
    fwd = functools.partial(sparse_kernel.sparse_mla_fwd, scale=SCALE, v_dim=V, block_k=block_k)
    (out, lse), raced = run_checked(fwd, q, kv, idx, valid)
    assert not raced
    want_out, want_lse = sparse_reference.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=V)
    assert_close(out, want_out, 1e-5)
    assert_close(lse, want_lse, 1e-5)

    dout = normal(rng, out.shape)
    delta = jnp.sum(dout * out, -1)
    bwd = functools.partial(sparse_kernel.sparse_mla_bwd_rows, scale=SCALE, v_dim=V, block_k=block_k)
    (dq, rows), raced = run_checked(bwd, q, kv, idx, valid, dout, lse, delta)
    assert not raced
    _, vjp = jax.vjp(lambda a: sparse_reference.sparse_mla(a, kv, idx, valid, scale=SCALE, v_dim=V)[0], q)
    assert_close(dq, vjp(dout)[0], 1e-5)
    assert np.all(np.asarray(rows)[~np.asarray(valid)] == 0)


def test_indexer_scores_race_free_and_in_bounds():
    B, T, S, H, D = 2, 130, 140, 2, 8
    rng = np.random.default_rng(1)
    q, k, w = normal(rng, (B, T, H, D)), normal(rng, (B, S, D)), normal(rng, (B, T, H))
    pos_seg = positions_and_segments(B, T, S)
    scores = functools.partial(indexer_kernel.index_scores, block_t=128, block_s=128)
    got, raced = run_checked(scores, q, k, w, *pos_seg)
    assert not raced
    assert_close(got, indexer_reference.index_scores(q, k, w, visible_mask(*pos_seg)), 1e-5)


@pytest.mark.parametrize("resident", [True, False])
def test_indexer_kl_sparse_kernels_race_free_and_in_bounds(resident):
    """The sparse-stage KL kernels, keys resident in VMEM or row-DMA'd: the backward's two query shares run on
    the two simulated cores, each adding row gradients into its own resident key-gradient block."""
    from pallas_kernels.indexer_kl import ops as kl_ops
    from pallas_kernels.indexer_kl import sparse_kernel as kl_kernel

    B, T, S, H, D, topk, block_k = 1, 16, 40, 2, 8, 12, 8       # 2 query blocks; 2 key blocks, one part-filled
    rng = np.random.default_rng(2)
    iq, ik, iw = normal(rng, (B, T, H, D)), normal(rng, (B, S, D)), normal(rng, (B, T, H))
    idx = jnp.asarray(rng.integers(0, S, (B, T, topk)), jnp.int32)
    valid = jnp.asarray(rng.uniform(size=(B, T, topk)) < 0.8)
    p = jnp.where(valid, jnp.asarray(rng.uniform(size=(B, T, topk)), jnp.float32), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    options = dict(block_k=block_k, resident=resident)
    (kl, lse), raced = run_checked(functools.partial(kl_kernel.sparse_kl_fwd, **options), iq, ik, iw, idx, valid, p)
    assert not raced

    def reference_kl(iq, ik, iw):
        return kl_ops.sparse_kl_per_token(iq, ik, iw, idx, valid, p, impl="reference")[0]

    want_kl, vjp = jax.vjp(reference_kl, iq, ik, iw)
    assert_close(kl, want_kl, 1e-5)
    g = normal(rng, (B, T))
    grads, raced = run_checked(functools.partial(kl_kernel.sparse_kl_bwd, **options), iq, ik, iw, idx, valid, p,
                               lse, g)
    assert not raced
    for got, want in zip(grads, vjp(g)):
        assert_close(got, want, 1e-5)
