"""Real Mosaic/XLA TPU compiles of every DSA kernel, ahead of time from a CPU host.

Background: docs/training.md#compiling-for-tpu-from-a-cpu-host.

Needs libtpu (requirements-tpu.txt); skipped without it. Shapes are GLM-5 production sizes: H = 64 query
heads on the absorbed latent C = 576 (value 512), k = 2048, indexer H_I = 32 x d_I = 128, T = S = 8192,
bf16, batch 1, on a v5p:2x2x1 slice (4 chips) with queries sharded over the chips inside shard_map.
Each compile must succeed and fit one v5p chip's HBM. The dense stage's flash attention (MHA form) and the
warm-up stage's indexer KL kernels compile at their own per-chip shapes (below).
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels.flash_attention import kernel as flash_kernel, ops as flash_ops  # noqa: E402
from pallas_kernels.indexer_kl import kernel as indexer_kl_kernel, ops as indexer_kl_ops  # noqa: E402
from pallas_kernels.lightning_indexer import ops as indexer_ops  # noqa: E402
from pallas_kernels.sparse_mla import ops as sparse_ops  # noqa: E402

T = S = int(os.environ.get("DSA_TPU_COMPILE_T", 8192))
H, C, V, TOPK, HI, DI = 64, 576, 512, 2048, 32, 128
V5P_HBM_BYTES = 95 * 2**30
QUERIES = P(None, "q")  # [B, T, ...] arrays split along T over the 4 chips; kv stays whole


@pytest.fixture(scope="module")
def mesh():
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    return Mesh(np.array(topology.devices).reshape(-1), ("q",))


def abstract(mesh, shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def compile_and_check(mesh, fn, args, in_specs, out_specs):
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    compiled = jax.jit(sharded).lower(*args).compile()
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    print(f"\n{fn.__name__}: argument {mem.argument_size_in_bytes / 2**20:.1f} MiB, output "
          f"{mem.output_size_in_bytes / 2**20:.1f} MiB, temp {mem.temp_size_in_bytes / 2**20:.1f} MiB per chip")
    assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel is really in the program
    assert 0 < total < V5P_HBM_BYTES
    return compiled


def test_lightning_indexer_compiles(mesh):
    args = (abstract(mesh, (1, T, HI, DI), jnp.bfloat16, QUERIES), abstract(mesh, (1, S, DI), jnp.bfloat16, P()),
            abstract(mesh, (1, T, HI), jnp.float32, QUERIES),
            abstract(mesh, (1, T), jnp.int32, QUERIES), abstract(mesh, (1, S), jnp.int32, P()),
            abstract(mesh, (1, T), jnp.int32, QUERIES), abstract(mesh, (1, S), jnp.int32, P()))

    def indexer_topk(*a):
        return indexer_ops.indexer_topk(*a, topk=TOPK, impl="pallas")

    compile_and_check(mesh, indexer_topk, args, (QUERIES, P(), QUERIES, QUERIES, P(), QUERIES, P()),
                      (QUERIES, QUERIES))


def sparse_args(mesh):
    return (abstract(mesh, (1, T, H, C), jnp.bfloat16, QUERIES), abstract(mesh, (1, S, C), jnp.bfloat16, P()),
            abstract(mesh, (1, T, TOPK), jnp.int32, QUERIES), abstract(mesh, (1, T, TOPK), jnp.bool_, QUERIES))


def sparse_mla_forward(q, kv, idx, valid):
    attended = sparse_ops.sparse_mla(q, kv, idx, valid, scale=192**-0.5, v_dim=V, impl="pallas")
    return attended.out, attended.lse


def test_sparse_mla_forward_compiles(mesh):
    compile_and_check(mesh, sparse_mla_forward, sparse_args(mesh), (QUERIES, P(), QUERIES, QUERIES),
                      (QUERIES, QUERIES))


def test_sparse_mla_forward_with_kl_target_compiles(mesh):
    def forward_with_target(q, kv, idx, valid):
        attended = sparse_ops.sparse_mla(q, kv, idx, valid, scale=192**-0.5, v_dim=V, impl="pallas",
                                         with_target=True)
        return attended.out, attended.lse, attended.target

    compile_and_check(mesh, forward_with_target, sparse_args(mesh), (QUERIES, P(), QUERIES, QUERIES),
                      (QUERIES, QUERIES, QUERIES))


def test_sparse_mla_backward_compiles(mesh):
    def sparse_mla_backward(q, kv, idx, valid):
        (out, lse), vjp = jax.vjp(lambda a, b: sparse_mla_forward(a, b, idx, valid), q, kv)
        dq, dkv = vjp((out, jnp.zeros_like(lse)))
        return dq, jax.lax.psum(dkv.astype(jnp.float32), "q")  # each chip holds d(kv) of its queries

    compile_and_check(mesh, sparse_mla_backward, sparse_args(mesh), (QUERIES, P(), QUERIES, QUERIES),
                      (QUERIES, P()))


# ---- dense-stage flash attention, MHA form: GLM-5's 64 heads of q/k 192 + 64 = 256 and v 256, one 4K
# sequence per chip (batch split over the 4 chips); a context-parallel shard of a 4K sequence over 2 chips
# (2 x 1024 queries over its 4096 gathered keys) and of a 32K one (16K queries: dQ too large for VMEM, so
# the backward takes the separate dQ kernel)
FLASH_H, FLASH_D = 64, 256
BATCH = P("q")


def flash_fwd_bwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, allowed=None, *, block=flash_ops.BLOCK):
    def attend(q, k, v):
        return tuple(flash_ops.flash_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, scale=192**-0.5,
                                               impl="pallas", allowed_BTS=allowed, block=block))

    (out, lse), vjp = jax.vjp(attend, q, k, v)
    return (out, lse, *vjp((out, lse)))


# masked: the sparse stage at 4K, attending densely over the keys restricted to the top-k selection (an int8
# [T, S] mask): (2048, 4096) a context shard of the 744B sparse config, (4096, 4096) GLM-5.3-Flash's MLA layers
# (one sequence a chip; its NoPE heads are q/k 256 and v 256 too)
@pytest.mark.parametrize("T, S, masked, block", [(4096, 4096, False, 512), (2048, 4096, False, 512),
                                                 (2048, 4096, True, 512), (4096, 4096, True, 512),
                                                 (16384, 32768, False, 512)])
def test_flash_attention_forward_and_backward_compile(mesh, T, S, masked, block):
    n = len(mesh.devices)
    args = (abstract(mesh, (n, T, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, S, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, S, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, T), jnp.int32, BATCH), abstract(mesh, (n, S), jnp.int32, BATCH),
            abstract(mesh, (n, T), jnp.int32, BATCH), abstract(mesh, (n, S), jnp.int32, BATCH))
    args += (abstract(mesh, (n, T, S), jnp.bool_, BATCH),) if masked else ()
    def fwd_bwd(*a):
        return flash_fwd_bwd(*a, block=block)

    compiled = compile_and_check(mesh, fwd_bwd, args, (BATCH,) * len(args), (BATCH,) * 5)
    fused = T * FLASH_D * 4 <= flash_kernel.FUSED_DQ_BYTES
    backward = ("flash_attention_bwd_fused",) if fused else ("flash_attention_bwd_dkv", "flash_attention_bwd_dq")
    text = compiled.as_text()
    assert all(name in text for name in ("flash_attention_fwd_masked" if masked else "flash_attention_fwd",)
               + backward)
    # XLA's cost analysis counts the kernels' declared FLOPs: the causal blocks' pairs x heads, forward
    # 2(D + Dv) and backward 6D + 4Dv fused, 8D + 6Dv split, per pair (D = Dv: 14 D or 18 D)
    n_k = S // block
    declared = FLASH_H * T * S * (n_k + 1) // (2 * n_k) * (14 if fused else 18) * FLASH_D
    cost = compiled.cost_analysis()
    print(f"flops per chip {cost['flops']:.4g} (kernels declare {declared:.4g}), bytes accessed "
          f"{cost['bytes accessed']:.4g}")
    assert declared <= cost["flops"] < 1.01 * declared


# ---- warm-up stage indexer KL from the flash attention's lse: one 4K sequence per chip (batch split over
# the 4 chips), the MHA query and per-head keys of 64 heads x 256 in bf16, the indexer's fp32 q, k, w; masked:
# with a bool selection mask [T, S] (the sparse stage's KL computed densely)
def warmup_kl_grads(q, k, lse, iq, ik, iw, pos, seg, *allowed):
    def loss(iq, ik, iw):
        kl, count = indexer_kl_ops.warmup_kl_sums(q, k, lse, iq, ik, iw, pos, pos, seg, seg, *allowed,
                                                  scale=192**-0.5, impl="pallas")
        return jnp.sum(kl), count

    (kl, count), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(iq, ik, iw)
    return (kl[None], count, *grads)


# 16K keys: d ik too long for VMEM, its own kernel (with the mask too)
@pytest.mark.parametrize("T, masked", [(4096, False), (4096, True), (16384, False), (16384, True)])
def test_warmup_indexer_kl_compiles(mesh, T, masked):
    n = len(mesh.devices)
    args = (abstract(mesh, (n, T, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, T, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, T, FLASH_H), jnp.float32, BATCH),
            abstract(mesh, (n, T, HI, DI), jnp.float32, BATCH), abstract(mesh, (n, T, DI), jnp.float32, BATCH),
            abstract(mesh, (n, T, HI), jnp.float32, BATCH),
            abstract(mesh, (n, T), jnp.int32, BATCH), abstract(mesh, (n, T), jnp.int32, BATCH))
    args += (abstract(mesh, (n, T, T), jnp.bool_, BATCH),) * masked
    compiled = compile_and_check(mesh, warmup_kl_grads, args, (BATCH,) * len(args), (BATCH,) * 5)
    text = compiled.as_text()
    resident = T * DI * 4 <= indexer_kl_kernel.RESIDENT_DK_BYTES
    assert "indexer_kl_warmup_lse" in text and "indexer_kl_warmup_grads" in text
    assert ("indexer_kl_warmup_dk" in text) == (not resident)
    # XLA's cost analysis counts the kernels' declared FLOPs: the causal blocks' (query, key) pairs x (2 H D
    # for the logits + 2 HI DI for I in the lse kernel + 6 HI DI for I, d iq and d ik in the KL kernel; with
    # the separate d ik kernel 4 HI DI in the KL kernel and 2 H D + 4 HI DI in the d ik kernel)
    n_q = T // indexer_kl_ops.BLOCK_Q            # causal: (n_q + 1) / 2 n_q of the blocks' pairs are needed
    per_pair = 2 * FLASH_H * FLASH_D + 8 * HI * DI if resident else 4 * FLASH_H * FLASH_D + 10 * HI * DI
    declared = T * T * (n_q + 1) // (2 * n_q) * per_pair
    cost = compiled.cost_analysis()
    print(f"flops per chip {cost['flops']:.4g} (kernels declare {declared:.4g}), bytes accessed "
          f"{cost['bytes accessed']:.4g}")
    assert declared <= cost["flops"] < 1.01 * declared


# ---- the sparse stage's indexer KL (loss + gradients of the indexer's q, k, w) at GLM-5's per-chip shapes:
# one 4K sequence per chip (batch split over the 4 chips; the keys stay in VMEM), a context shard of 1024
# queries over 32K gathered keys (row DMAs from HBM), and one over GLM-5's longest context, 202,752 keys (the
# key gradient no longer fits VMEM: the row scatter-add kernel adds the backward's row gradients); k = 2048
# selected keys, H_I = 32 x d_I = 128, the indexer q and k in fp32 as the model's Indexer returns them (and in
# bf16)
@pytest.mark.parametrize("KL_T, KL_S, kl_dtype", [(4096, 4096, jnp.float32), (4096, 4096, jnp.bfloat16),
                                                  (1024, 32768, jnp.float32), (1024, 202752, jnp.float32)])
def test_indexer_kl_sparse_kernels_compile(KL_T, KL_S, kl_dtype):
    from glm5_jax.cost.hlo_cost import hlo_cost
    from pallas_kernels.indexer_kl import ops as kl_ops, sparse_kernel, sparse_pallas

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("q",))
    n = len(mesh.devices)
    args = tuple(abstract(mesh, (n,) + shape, dtype, BATCH) for shape, dtype in [
        ((KL_T, HI, DI), kl_dtype), ((KL_S, DI), kl_dtype), ((KL_T, HI), jnp.float32),
        ((KL_T, TOPK), jnp.int32), ((KL_T, TOPK), jnp.bool_), ((KL_T, TOPK), jnp.float32)])

    def kl_loss_and_grads(iq, ik, iw, idx, valid, p):
        def loss(iq, ik, iw):
            return kl_ops.mean_over_tokens(*kl_ops.sparse_kl_per_token(iq, ik, iw, idx, valid, p, impl="pallas"))
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
        return (value[None],) + grads

    compiled = compile_and_check(mesh, kl_loss_and_grads, args, (BATCH,) * 6, (BATCH,) * 4)
    text = compiled.as_text()
    assert "indexer_kl_sparse_fwd" in text and "indexer_kl_sparse_bwd" in text
    # no gathered rows [..., k, d_I] nor per-head scores [..., k, H_I] of any query chunk in the program (the
    # XLA form has both): only the kernels see them, in VMEM
    assert not re.search(rf"\[[\d,]*{TOPK},({DI}|{HI})\]", text)
    # past 32K keys the backward's row gradients reach HBM, one chunk of queries at a time, and the sorted row
    # scatter-add kernel adds them into d ik (no XLA scatter)
    dk_in_vmem = sparse_kernel.fits_vmem(KL_S, DI)
    row_chunk = rf"f32\[1,{min(KL_T, sparse_pallas.ROWS_Q_CHUNK)},{TOPK},1,{DI}\]"
    assert bool(re.search(row_chunk, text)) == ("sorted_row_scatter_add" in text) == (not dk_in_vmem)
    assert not re.search(r"= f32\[[\d,]+\][^ ]* scatter\(", text)
    # the kernels' declared FLOPs (per slot and head: forward 2 d_I + 3, backward 6 d_I + 7; per slot 10 and
    # 8, and d_I for the scatter-add in VMEM, in the backward or the row scatter-add) are what the cost
    # model charges
    slots = KL_T * TOPK
    declared = slots * HI * (8 * DI + 10) + slots * (DI + 18)
    cost = hlo_cost(text)
    print(f"kernel FLOPs {cost.kernel_flops:.4g} (declared {declared:.4g}), HBM bytes {cost.bytes_accessed:.4g}")
    assert cost.kernel_flops == declared


def test_warmup_indexer_kl_compiles_with_its_gradients_kept_by_remat(mesh):
    """The masked warm-up KL inside a remat'd scan over three layers whose policy keeps the kernel's gradients,
    at the 744B sparse step's per-chip shapes (context 2: 2048 queries of a 4096-token sequence against all
    4096 keys): the kept gradients land in the scan's stacked residuals. Without the optimization barrier in
    ops.py the TPU compiler fuses the kernel with that write, and the fused kernel gets the default 16 MiB of
    scoped VMEM instead of its own limit: 36 MiB needed, no compile."""
    n, T, S = len(mesh.devices), 2048, 4096
    policy = jax.checkpoint_policies.save_only_these_names(*indexer_kl_ops.SAVED_NAMES)

    def layers(q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, allowed):
        def kl(iq, ik, iw):
            s, c = indexer_kl_ops.warmup_kl_sums(q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, allowed,
                                                 scale=192**-0.5, impl="pallas")
            return jnp.sum(s) / jnp.maximum(jnp.sum(c), 1.0)

        def loss(iq, ik, iw):
            layer = lambda carry, _: (carry + jax.checkpoint(kl, policy=policy)(iq * (1 + carry), ik, iw), None)  # noqa: E731
            return jax.lax.scan(layer, jnp.zeros((), jnp.float32), None, length=3)[0]

        return jax.grad(loss, argnums=(0, 1, 2))(iq, ik, iw)

    args = (abstract(mesh, (n, T, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, S, FLASH_H, FLASH_D), jnp.bfloat16, BATCH),
            abstract(mesh, (n, T, FLASH_H), jnp.float32, BATCH),
            abstract(mesh, (n, T, HI, DI), jnp.float32, BATCH), abstract(mesh, (n, S, DI), jnp.float32, BATCH),
            abstract(mesh, (n, T, HI), jnp.float32, BATCH),
            abstract(mesh, (n, T), jnp.int32, BATCH), abstract(mesh, (n, S), jnp.int32, BATCH),
            abstract(mesh, (n, T), jnp.int32, BATCH), abstract(mesh, (n, S), jnp.int32, BATCH),
            abstract(mesh, (n, T, S), jnp.int8, BATCH))
    text = compile_and_check(mesh, layers, args, (BATCH,) * len(args), (BATCH,) * 3).as_text()
    assert "indexer_kl_warmup_grads" in text


def test_sparse_mla_compiles_at_pooled_slot_counts(mesh):
    """GLM-5.3-Flash's NoPE MLA (C = V = kv_lora 512) over the pooled indexer's slots: index_topk + 15 = 2,063
    a query, padded to the kernel's 512-slot blocks: 2,560. That is no rank-1 SMEM block length (a power of
    two, or a multiple of 1024), so each query's index row is laid out in 3,072 entries."""
    t, k, c = 1024, 2560, 512
    args = (abstract(mesh, (1, t, H, c), jnp.bfloat16, QUERIES), abstract(mesh, (1, t, c), jnp.bfloat16, P()),
            abstract(mesh, (1, t, k), jnp.int32, QUERIES), abstract(mesh, (1, t, k), jnp.bool_, QUERIES))

    def forward_backward(q, kv, idx, valid):
        def fwd(a, b):
            attended = sparse_ops.sparse_mla(a, b, idx, valid, scale=c**-0.5, v_dim=c, impl="pallas")
            return attended.out, attended.lse
        (out, lse), vjp = jax.vjp(fwd, q, kv)
        dq, dkv = vjp((out, jnp.zeros_like(lse)))
        return out, dq, jax.lax.psum(dkv.astype(jnp.float32), "q")

    compiled = compile_and_check(mesh, forward_backward, args, (QUERIES, P(), QUERIES, QUERIES),
                                 (QUERIES, QUERIES, P()))
    assert "sparse_mla_fwd" in compiled.as_text()
