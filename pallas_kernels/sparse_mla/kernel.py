"""Pallas TPU kernels for token-sparse absorbed MLA: forward and backward.

Background: docs/architecture.md#sparse-attention-absorbed-form.

One grid step = one query token x one block of ``block_k`` of its k selected slots. The latent cache
kv [B, S, C] stays in HBM (``memory_space=pl.ANY``); the step DMA-gathers the block's rows into a VMEM
buffer (one gather serves all H query heads: MQA form) while the next block's rows are already in
flight (two buffer slots). The query's k indices are streamed into SMEM one query at a time through a
1-D SMEM BlockSpec: whole-array scalar prefetch would need B*T*k*4 bytes of SMEM (64 MiB at T=8192,
k=2048), far beyond the SMEM of any TPU.

Row DMAs and tiling: Mosaic only slices tiled (second-minor) dims at tile-aligned offsets, so a single
row of kv [B, S, C] cannot be DMA'd. The kernels therefore gather from a row view [B, S, 1, X] into a VMEM
buffer [2, block_k, 1, X], where the row index is an untiled leading dim (`kv_row_view`, made once per call
or per backward). A row DMA moves whole tiles of its HBM layout: 128 lanes of 32-bit words, and a 16-bit
array's (2, 128) tiles interleave two rows, so a bf16 row of C = 576 would move 640 x 2 x 2 = 2,560 bytes.
bf16 kv is therefore gathered as bf16 pairs packed into uint32 lanes (pallas_kernels/row_scatter/packing.py:
384 lanes, 1,536 bytes a row) and unpacked exactly in VMEM; the declared cost charges each gathered row the
bytes its DMA moves (`gathered_row_bytes`).

Grid: (B, T / TQ, TQ, k / block_k). TQ = 8 queries share one [TQ, H] block of lse (and of the backward's
per-query scalars) so those blocks obey the (8, 128) tiling rule without a [T, H, 1] padded layout.

Forward: online softmax over the k-blocks (fp32 m, l, acc in VMEM); out = acc / l, lse = m + log l.
With ``with_target`` the forward also emits the DSA indexer's KL target, the head-mean attention
probability of every selected slot, mean_h exp(s[h, j] - lse[h]). It needs the final lse, which the sweep
knows only at its end, so each k-block keeps its p~ = exp(s - m_b) [H, block_k] (m_b: the running max after
block b, the same exponentials the online softmax sums) and m_b [H, 1] in VMEM ([H, k] fp32: 512 KiB at
H = 64, k = 2048), and after the last block target[j] = mean_h p~[h, j] exp(m_b[h] - lse[h]): one gather of
the rows and one logits product, no second sweep and no [B, T, k, C] rows in HBM. The [TQ, k] target block
of 8 queries stays in VMEM (64 KiB at k = 2048) while they run.
Backward (per query, same gather): recompute p = exp(s - lse), then
    dp = dO v^T,  ds = p (dp - delta),  delta = rowsum(dO * O) - dlse
    dq       += ds @ rows * scale                          (accumulated over k-blocks in VMEM)
    drows     = ds^T @ q * scale  (+ p^T @ dO on the first v_dim columns: the value part)
The per-slot row gradients drows [B, T, k, C] are added into d(kv) by the row scatter-add kernel
(pallas_kernels/row_scatter; ops.py runs one query chunk at a time, so only [B, T_chunk, k, ...] exists at
once), as [.., 1, W] rows of (1, 128) tiles, or with bf16 kv as bf16 pairs packed into uint32 lanes. An
in-kernel scatter-add would race whenever two queries that run concurrently select the same key.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kernel_math import column_to_row, mm, mm_nt, row_to_column
from pallas_kernels.row_scatter.packing import pack_bf16_pairs, packed_width, unpack_bf16_pairs
from pallas_kernels.tpu_utils import LANES, pad_axis, round_up, smem_row_length

QUERIES_PER_BLOCK = 8  # TQ
# Selected slots per grid step (rounded down to a query's k). Each step costs ~0.35 us beside its work, and a
# step of 512 slots x 64 heads is about that much MXU work, so larger blocks pay: compiled for v5p at the 200K
# step's shapes (64 heads, k = 2048, 202,752 keys) the forward with the KL target takes 25% less at 2048 than
# at 512 (its 1024-slot form exceeds the scoped VMEM with the target), the backward 10% less at 1024 (its
# 2048-slot form exceeds it).
FWD_BLOCK_K = 2048
BWD_BLOCK_K = 1024


class _RowGather:
    """Double-buffered DMA gather of kv rows named by the current query's SMEM index block. Packed rows
    (uint32 bf16 pairs) are unpacked to [block_k, C] in ``dtype``."""

    def __init__(self, idx_ref, kv_hbm, buf, sem, batch, block_k, C=None, dtype=None):
        self.idx_ref, self.kv_hbm, self.buf, self.sem = idx_ref, kv_hbm, buf, sem
        self.batch, self.block_k, self.C, self.dtype = batch, block_k, C, dtype

    def _copy(self, src_row, slot, j):
        return pltpu.make_async_copy(self.kv_hbm.at[self.batch, src_row],
                                     self.buf.at[slot, j], self.sem.at[slot])

    def start(self, k_block, slot):
        base = k_block * self.block_k

        def start_row(j, carry):
            self._copy(self.idx_ref[base + j], slot, j).start()
            return carry

        jax.lax.fori_loop(0, self.block_k, start_row, 0)

    def wait(self, slot):
        def wait_row(j, carry):
            self._copy(0, slot, j).wait()  # same-sized descriptor: waits for one row's bytes
            return carry

        jax.lax.fori_loop(0, self.block_k, wait_row, 0)

    def rows(self, kb, n_blocks):
        """Start the next k-block's gather, wait for this one's, return its rows [block_k, C]."""
        slot = kb % 2

        @pl.when(kb == 0)
        def _():
            self.start(0, 0)

        @pl.when(kb + 1 < n_blocks)
        def _():
            self.start(kb + 1, 1 - slot)

        self.wait(slot)
        rows_K1C = self.buf[slot]
        rows_KC = rows_K1C.reshape(rows_K1C.shape[0], rows_K1C.shape[2])
        if rows_KC.dtype == jnp.uint32:             # bf16 pairs: exact bf16 values
            return unpack_bf16_pairs(rows_KC, self.C).astype(self.dtype)
        return rows_KC


def _fwd_kernel(idx_ref, q_ref, valid_ref, kv_hbm, *refs, scale, v_dim, block_k, n_kb, with_target):
    # idx_ref (SMEM) [k_pad] this query's slots; q_ref [1, 1, H, C]; valid_ref [1, TQ, block_k] int32;
    # out_ref [1, 1, H, v_dim]; lse_ref [1, TQ, H]; target_ref [1, TQ, k_pad] fp32 (with_target);
    # buf [2, block_k, 1, C]; m/l [H, 1]; acc [H, v_dim]; with_target: p~ [n_kb, H, block_k] and the running
    # max after each block [n_kb, H, 1].
    if with_target:
        out_ref, lse_ref, target_ref, buf, sem, m_scr, l_scr, acc_scr, p_scr, m_blocks_scr = refs
    else:
        (out_ref, lse_ref, buf, sem, m_scr, l_scr, acc_scr), target_ref = refs, None
    b, qi, kb = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    rows_KC = _RowGather(idx_ref, kv_hbm, buf, sem, b, block_k, q_ref.shape[-1], q_ref.dtype).rows(kb, n_kb)

    @pl.when(kb == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    q_HC = q_ref[0, 0]
    valid_1K = valid_ref[0, pl.ds(qi, 1), :] != 0
    s_HK = mm_nt(q_HC, rows_KC) * scale
    s_HK = jnp.where(valid_1K, s_HK, -jnp.inf)

    def final_lse_H1():
        l = l_scr[...]
        has_keys = l > 0.0
        return jnp.where(has_keys, m_scr[...] + jnp.log(jnp.where(has_keys, l, 1.0)), -jnp.inf)

    m_prev = m_scr[...]
    m_new = jnp.maximum(m_prev, jnp.max(s_HK, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all-invalid so far: keep exp() finite
    alpha = jnp.exp(m_prev - m_safe)
    p_HK = jnp.exp(s_HK - m_safe)
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p_HK, axis=1, keepdims=True)
    acc_scr[...] = alpha * acc_scr[...] + mm(p_HK.astype(rows_KC.dtype), rows_KC[:, :v_dim])
    m_scr[...] = m_new
    if with_target:
        p_scr[kb] = p_HK
        m_blocks_scr[kb] = m_safe

    @pl.when(kb == n_kb - 1)
    def _finalize():
        l = l_scr[...]
        has_keys = l > 0.0
        out_ref[0, 0] = jnp.where(has_keys, acc_scr[...] / jnp.where(has_keys, l, 1.0), 0.0).astype(out_ref.dtype)
        lse_H1 = final_lse_H1()
        lse_ref[0, pl.ds(qi, 1), :] = column_to_row(lse_H1)
        if with_target:
            lse_safe = jnp.where(lse_H1 == -jnp.inf, 0.0, lse_H1)   # no valid slot: every p~ is 0
            for j in range(n_kb):     # p[h, slot] = p~[h, slot] exp(m_b[h] - lse[h]), its block's max
                p_block = p_scr[j] * jnp.exp(m_blocks_scr[j] - lse_safe)
                target_ref[0, pl.ds(qi, 1), j * block_k:(j + 1) * block_k] = jnp.mean(p_block, axis=0,
                                                                                      keepdims=True)


def _bwd_kernel(idx_ref, q_ref, *refs, scale, v_dim, block_k, wide):
    # q_ref [1, 1, H, C]; (wide: qw_ref [1, 1, H, W], q zero-padded to W = C rounded up to 128 lanes);
    # dout_ref [1, 1, H, v_dim]; lse/delta [1, TQ, H] fp32; valid [1, TQ, block_k]; dq_ref [1, 1, H, C]
    # fp32 (resident across k-blocks); drows_ref [1, 1, block_k, C] fp32, or wide: [1, 1, block_k, 1, W]
    # (each row its own run of (1, 128) tiles in HBM: one DMA per row for the row scatter-add).
    if wide:
        qw_ref, dout_ref, lse_ref, delta_ref, valid_ref, kv_hbm, dq_ref, drows_ref, buf, sem = refs
    else:
        (dout_ref, lse_ref, delta_ref, valid_ref, kv_hbm, dq_ref, drows_ref, buf, sem), qw_ref = refs, q_ref
    b, qi, kb, n_kb = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    rows_KC = _RowGather(idx_ref, kv_hbm, buf, sem, b, block_k, q_ref.shape[-1], q_ref.dtype).rows(kb, n_kb)

    q_HC, dout_HV = q_ref[0, 0], dout_ref[0, 0]
    valid_1K = valid_ref[0, pl.ds(qi, 1), :] != 0
    lse_H1 = row_to_column(lse_ref[0, pl.ds(qi, 1), :])
    delta_H1 = row_to_column(delta_ref[0, pl.ds(qi, 1), :])
    lse_H1 = jnp.where(lse_H1 == -jnp.inf, 0.0, lse_H1)  # rows without keys: every p is masked to 0

    s_HK = mm_nt(q_HC, rows_KC) * scale
    p_HK = jnp.where(valid_1K, jnp.exp(s_HK - lse_H1), 0.0)
    dp_HK = mm_nt(dout_HV, rows_KC[:, :v_dim])
    ds_HK = jnp.where(valid_1K, p_HK * (dp_HK - delta_H1), 0.0)  # masked: delta may be non-finite there

    @pl.when(kb == 0)
    def _init():
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    dq_ref[0, 0] += mm(ds_HK.astype(rows_KC.dtype), rows_KC) * scale
    dvalue_KV = mm(p_HK.T.astype(dout_HV.dtype), dout_HV)
    if not wide:
        drows_ref[0, 0] = mm(ds_HK.T.astype(q_HC.dtype), q_HC) * scale
        drows_ref[0, 0, :, :v_dim] += dvalue_KV
        return
    # key part over the padded width (the query is 0 past C, so are those columns), plus the value part on
    # the first v_dim columns
    dkey_KW = mm(ds_HK.T.astype(q_HC.dtype), qw_ref[0, 0]) * scale
    W = dkey_KW.shape[1]
    dvalue_KW = jnp.concatenate([dvalue_KV, jnp.zeros((block_k, W - v_dim), jnp.float32)], 1) if W > v_dim \
        else dvalue_KV
    drows_KW = dkey_KW + dvalue_KW
    drows_ref[0, 0, :, 0, :] = pack_bf16_pairs(drows_KW) if drows_ref.dtype == jnp.uint32 else drows_KW


class _Padded(NamedTuple):
    """A call's sizes and its padded selection: T padded to QUERIES_PER_BLOCK, k to block_k."""
    B: int
    T: int
    H: int
    C: int
    K: int
    T_pad: int
    K_pad: int
    block_k: int
    idx_row: int               # slots per query in idx_flat: K_pad rounded to a rank-1 SMEM block (smem_row_length)
    idx_flat: jax.Array        # int32 [B * T_pad * idx_row]; invalid / padded slots point at row 0
    valid: jax.Array           # int32 [B, T_pad, K_pad]


def slot_block(K, preferred):
    """Slots per grid step for k = K selected slots: of ``preferred`` and its halvings down to 512 (each at
    most K rounded up to 128), the one that pads K the least, the largest among equals (K = 2048: 2048; the
    pooled indexer's K = 2063: 512, padded to 2560 rather than 4096)."""
    blocks, b = [min(preferred, round_up(K, 128))], preferred // 2
    while b >= 512:
        blocks.append(min(b, round_up(K, 128)))
        b //= 2
    return min(blocks, key=lambda blk: (round_up(K, blk), -blk))


def _prepare(q_BTHC, idx_BTK, valid_BTK, S, block_k) -> _Padded:
    """Pad T to TQ and k to block_k; invalid/padded slots point at row 0 (gathered, then masked). The flat
    index array holds each query's slots in a row of `smem_row_length` (K_pad) entries, the SMEM block one
    query streams; the entries past K_pad are never read."""
    B, T, H, C = q_BTHC.shape
    K = idx_BTK.shape[2]
    block_k = slot_block(K, block_k)
    T_pad, K_pad = round_up(T, QUERIES_PER_BLOCK), round_up(K, block_k)
    valid = pad_axis(pad_axis(valid_BTK, 2, K_pad, False), 1, T_pad, False)
    idx = jnp.where(valid, jnp.clip(pad_axis(pad_axis(idx_BTK, 2, K_pad), 1, T_pad), 0, S - 1), 0)
    idx_row = smem_row_length(K_pad)
    return _Padded(B=B, T=T, H=H, C=C, K=K, T_pad=T_pad, K_pad=K_pad, block_k=block_k, idx_row=idx_row,
                   idx_flat=pad_axis(idx.astype(jnp.int32), 2, idx_row).reshape(-1), valid=valid.astype(jnp.int32))


def _grid_and_common_specs(d):
    """Grid (B, T/TQ, TQ, k/block_k): the last axis walks the k-blocks."""
    TQ, block_k, T_pad = QUERIES_PER_BLOCK, d.block_k, d.T_pad
    grid = (d.B, T_pad // TQ, TQ, d.K_pad // block_k)
    per_query = lambda b, t, i, kb: (b, t * TQ + i, 0, 0)  # noqa: E731
    idx_spec = pl.BlockSpec((d.idx_row,), lambda b, t, i, kb: (b * T_pad + t * TQ + i,),
                            memory_space=pltpu.SMEM)
    valid_spec = pl.BlockSpec((1, TQ, block_k), lambda b, t, i, kb: (b, t, kb))
    per_query_row_block = pl.BlockSpec((1, TQ, d.H), lambda b, t, i, kb: (b, t, 0))
    return grid, per_query, idx_spec, valid_spec, per_query_row_block


_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"))


def kv_row_view(kv_BSC):
    """The rows the kernels gather, one DMA each: bf16 kv as bf16 pairs packed into uint32 lanes [B, S, 1,
    packed_width(C)] (row_scatter/packing.py: 384 lanes at C = 576), other dtypes as [B, S, 1, C]. A row DMA
    moves whole (1, 128) tiles of 32-bit words (`gathered_row_bytes`): a bf16 [B, S, 1, C] array's (2, 128)
    tiles interleave two rows, so one of its rows costs 2560 bytes at C = 576 where a packed row costs 1536."""
    return (pack_bf16_pairs(kv_BSC) if kv_BSC.dtype == jnp.bfloat16 else kv_BSC)[:, :, None, :]


def gathered_row_bytes(rows_BS1X) -> int:
    """HBM bytes one row DMA from the row view moves: its last dim in 128-lane tiles of 32-bit words
    (a tile of 16-bit values holds two rows, of 8-bit four), round_up(X, 128) x 4."""
    return round_up(rows_BS1X.shape[-1], LANES) * 4


def _row_view(kv):
    """(the row view of kv [B, S, C], or kv itself when given as a row view; the dtype its rows compute in)."""
    rows = kv if kv.ndim == 4 else kv_row_view(kv)
    return rows, (jnp.bfloat16 if rows.dtype == jnp.uint32 else rows.dtype)


def _cost(d, v_dim, itemsize, backward, *, row_bytes_in, with_target=False, dma_rows=False, packed_rows=False):
    """Declared cost of one call (what the kernel does, for FLOP/byte accounting of compiled programs).

    Per (query, slot, head): logits 2C; forward adds p @ V 2v (the KL target: a rescale and a head mean of
    the kept exponentials, no matmul); the backward recomputes the logits (2C), dP = dO V^T (2v), dq += dS rows (2C),
    drows = dS^T q (2C) and += p^T dO (2v). Bytes: the gathered rows, q and
    the per-query outputs (+ the fp32 target); the backward also reads dO and writes the row gradients.
    With ``dma_rows`` it also reads the query padded to W = C rounded up to 128 lanes, the key part's
    product runs over W (2W FLOPs instead of 2C) and each row gradient is written as W fp32 lanes ((1, 128)
    tiles), or with ``packed_rows`` as packed_width(W) uint32 lanes. ``row_bytes_in``: what one gathered row
    moves (`gathered_row_bytes`)."""
    B, T, H, C, K = d.B, d.T_pad, d.H, d.C, d.K_pad
    W = round_up(C, LANES) if dma_rows else C
    row_bytes = (packed_width(W) if packed_rows else W) * 4
    pairs = B * T * K * H
    rows = B * T * K * row_bytes_in
    per_query = B * T * H * (C + v_dim) * itemsize + B * T * H * 4
    if not backward:
        if with_target:
            return pl.CostEstimate(flops=pairs * (2 * C + 2 * v_dim), transcendentals=2 * pairs,
                                   bytes_accessed=rows + per_query + B * T * K * 4)
        return pl.CostEstimate(flops=pairs * (2 * C + 2 * v_dim), transcendentals=pairs,
                               bytes_accessed=rows + per_query)
    wide_q = B * T * H * W * itemsize if dma_rows else 0
    return pl.CostEstimate(flops=pairs * (4 * C + 2 * W + 4 * v_dim), transcendentals=pairs,
                           bytes_accessed=rows + 2 * per_query + wide_q + B * T * H * C * 4 + B * T * K * row_bytes)


def sparse_mla_fwd(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, block_k=FWD_BLOCK_K, interpret=False,
                   with_target=False):
    """(out [B, T, H, v_dim] in q's dtype, lse [B, T, H] fp32), with ``with_target`` also the indexer KL
    target [B, T, k] fp32 (head-mean probabilities of the selected slots, 0 at invalid ones); the same
    contract as reference.sparse_mla."""
    kv_rows, dtype = _row_view(kv_BSC)
    S = kv_rows.shape[1]
    d = _prepare(q_BTHC, idx_BTK, valid_BTK, S, block_k)
    B, H, C, T_pad, K_pad, block_k = d.B, d.H, d.C, d.T_pad, d.K_pad, d.block_k
    grid, per_query, idx_spec, valid_spec, row_block = _grid_and_common_specs(d)
    q = pad_axis(q_BTHC, 1, T_pad).astype(dtype)
    out_specs = [pl.BlockSpec((1, 1, H, v_dim), per_query), row_block]
    out_shape = [jax.ShapeDtypeStruct((B, T_pad, H, v_dim), q_BTHC.dtype),
                 jax.ShapeDtypeStruct((B, T_pad, H), jnp.float32)]
    if with_target:   # one [TQ, k_pad] block per 8 queries, resident while they run
        out_specs.append(pl.BlockSpec((1, QUERIES_PER_BLOCK, K_pad), lambda b, t, i, kb: (b, t, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, T_pad, K_pad), jnp.float32))
    results = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, v_dim=v_dim, block_k=block_k, n_kb=K_pad // block_k,
                          with_target=with_target),
        grid=grid,
        in_specs=[idx_spec,
                  pl.BlockSpec((1, 1, H, C), per_query),
                  valid_spec,
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((2, block_k, *kv_rows.shape[2:]), kv_rows.dtype), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, 1), jnp.float32),
                        pltpu.VMEM((H, v_dim), jnp.float32)]
        + ([pltpu.VMEM((K_pad // block_k, H, block_k), jnp.float32), pltpu.VMEM((K_pad // block_k, H, 1), jnp.float32)]
           if with_target else []),
        compiler_params=_SEMANTICS,
        interpret=interpret,
        name="sparse_mla_fwd_target" if with_target else "sparse_mla_fwd",
        cost_estimate=_cost(d, v_dim, jnp.dtype(dtype).itemsize, backward=False, with_target=with_target,
                            row_bytes_in=gathered_row_bytes(kv_rows)),
    )(d.idx_flat, q, d.valid, kv_rows)
    T, K = d.T, d.K
    out, lse = results[0][:, :T], results[1][:, :T]
    return (out, lse, results[2][:, :T, :K]) if with_target else (out, lse)


def sparse_mla_bwd_rows(q_BTHC, kv_BSC, idx_BTK, valid_BTK, dout_BTHV, lse_BTH, delta_BTH, *,
                        scale, v_dim, block_k=BWD_BLOCK_K, dma_rows=False, packed_rows=False, interpret=False):
    """(dq [B, T, H, C] fp32, drows [B, T, k, C] fp32): gradients of q and of every gathered slot's row.

    ``delta = rowsum(dO * O) - dlse`` [B, T, H] fp32. Invalid slots get zero row gradients. With
    ``dma_rows`` drows is [B, T, k, 1, W], each row zero-padded to W = C rounded up to 128 lanes: in HBM a
    row is then its own W / 128 (1, 128) tiles, which the row scatter-add kernel fetches with one DMA.
    ``packed_rows`` (with ``dma_rows``): each row rounded to bf16 and packed in pairs into packed_width(W)
    uint32 lanes (pallas_kernels/row_scatter/packing.py), 40% fewer bytes at W = 640; the row scatter-add
    unpacks and adds them in fp32.
    ``kv_BSC`` may also be given as the row view the kernel gathers from (`kv_row_view`, made once by a
    caller that runs the kernel over several query chunks, so the packing is not repeated per chunk).
    """
    kv_rows, dtype = _row_view(kv_BSC)
    S = kv_rows.shape[1]
    d = _prepare(q_BTHC, idx_BTK, valid_BTK, S, block_k)
    B, H, C, T_pad, K_pad, block_k = d.B, d.H, d.C, d.T_pad, d.K_pad, d.block_k
    W = round_up(C, LANES) if dma_rows else C
    wide = dma_rows
    if packed_rows and not dma_rows:
        raise ValueError("sparse_mla_bwd_rows: packed_rows needs dma_rows")
    row_tiles = (1, packed_width(W) if packed_rows else W) if dma_rows else (C,)
    row_dtype = jnp.uint32 if packed_rows else jnp.float32
    grid, per_query, idx_spec, valid_spec, row_block = _grid_and_common_specs(d)
    q = pad_axis(q_BTHC, 1, T_pad).astype(dtype)
    dout = pad_axis(dout_BTHV, 1, T_pad).astype(dtype)
    lse = pad_axis(lse_BTH.astype(jnp.float32), 1, T_pad, -jnp.inf)
    delta = pad_axis(delta_BTH.astype(jnp.float32), 1, T_pad)
    q_in = [q, pad_axis(q, 3, W)] if wide else [q]
    q_specs = [pl.BlockSpec((1, 1, H, C), per_query)] + ([pl.BlockSpec((1, 1, H, W), per_query)] if wide else [])
    dq, drows = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, v_dim=v_dim, block_k=block_k, wide=wide),
        grid=grid,
        in_specs=[idx_spec, *q_specs,
                  pl.BlockSpec((1, 1, H, v_dim), per_query),
                  row_block, row_block,
                  valid_spec,
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((1, 1, H, C), per_query),
                   pl.BlockSpec((1, 1, block_k, *row_tiles),
                                lambda b, t, i, kb: (b, t * QUERIES_PER_BLOCK + i, kb) + (0,) * len(row_tiles))],
        out_shape=[jax.ShapeDtypeStruct((B, T_pad, H, C), jnp.float32),
                   jax.ShapeDtypeStruct((B, T_pad, K_pad, *row_tiles), row_dtype)],
        scratch_shapes=[pltpu.VMEM((2, block_k, *kv_rows.shape[2:]), kv_rows.dtype), pltpu.SemaphoreType.DMA((2,))],
        compiler_params=_SEMANTICS,
        interpret=interpret,
        name="sparse_mla_bwd",
        cost_estimate=_cost(d, v_dim, jnp.dtype(dtype).itemsize, backward=True, dma_rows=dma_rows,
                            packed_rows=packed_rows, row_bytes_in=gathered_row_bytes(kv_rows)),
    )(d.idx_flat, *q_in, dout, lse, delta, d.valid, kv_rows)
    T, K = d.T, d.K
    if (T, K) != (T_pad, K_pad):
        dq, drows = dq[:, :T], drows[:, :T, :K]
    return dq, drows
