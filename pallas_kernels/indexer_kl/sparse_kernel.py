"""Pallas TPU kernels for the DSA sparse stage's indexer KL: forward and backward.

Background: docs/architecture.md#dsa-training-stages-and-the-indexer-kl. Per query token t with k selected
slots idx[t, :] (valid where ``valid``) and the attention's head-mean probabilities p[t, :] (the target):

    I[t, j] = sum_h w[t, h] ReLU(iq[t, h] . ik[idx[t, j]])
    kl[t]   = sum_{valid j} p log p - p log softmax_valid(I_t)_j          (0 for a token with no valid slot)

Both kernels walk the grid of the sparse-attention kernels (pallas_kernels/sparse_mla/kernel.py): one
step = one query x one block of ``block_k`` slots; the query's slots are streamed into SMEM and the H_I
per-head dots are one [H_I, D_I] x [D_I, block_k] MXU product. Nothing of size [tokens, k, D_I] or
[tokens, k, H_I] reaches HBM. The block's ik rows come from one of two places:
* resident (while an fp32 [S, D_I] copy of the batch row's keys takes at most `RESIDENT_KEYS_BUDGET`,
  S <= 16K at D_I = 128): the copy is one VMEM block, read from HBM once, and each selected row is copied
  from it into a [block_k, D_I] scratch (single rows of a 32-bit array load at any sublane offset);
* else ik stays in HBM and the sparse-attention kernels' double-buffered row-DMA gather fetches them
  (one DMA of a (2, 128)-tiled bf16 row per slot: a T x k x 512-byte read per kernel).

Forward: the scores of every block go into a [1, k] VMEM row; the query's last block takes the masked
log-softmax and the KL against p and stores (kl, lse_I) for the query (lse_I = log sum_valid exp I, for the
backward).

Backward (cotangent g[t] of kl[t]): with q = exp(I - lse_I) the gradient on the scores is
    dI[t, j] = g[t] (q_j sum_valid p - p_j) on valid slots, 0 elsewhere
(sum_valid p is 1 up to rounding; keeping it makes this the exact derivative of the forward). The step
recomputes the dots and, with G = [dots > 0] dI w,
    dw[t, h] = sum_j dI[t, j] ReLU(dots[h, j]),  dq[t, h] = sum_j G[h, j] ik[idx[t, j]]   (VMEM accumulators)
    dk[idx[t, j]] += sum_h G[h, j] iq[t, h]                                              (the scatter)
The scatter is done in VMEM: the kernel's dk output block is the whole [S, D_I] fp32 key gradient of one
batch row (2 MiB at S = 4096), resident while a contiguous share of the queries runs, and each slot's row
gradient is added to its key's row there (one dynamic-row read-modify-write per slot). The query axis is
split into ``n_split`` shares (a parallel grid axis: the two TensorCores of a megacore chip take one each)
that write separate partial dk blocks, summed by XLA: HBM sees n_split x [S, D_I] fp32 per batch row
instead of XLA's scatter-add of [T, k, D_I] fp32 row gradients (a gathered-row array written, then read
and scattered into tiled dk at (8, 128)-tile granularity). Within a share the grid runs in order, so two
slots naming the same key (another query's, or a padded slot at row 0 with a zero gradient) add one after
the other: no race.

The row copies and adds are vector loads and stores issued one row at a time (k per query in each
kernel); the declared cost (flops, HBM bytes) has no term for their issue time, which is not measured on
hardware yet.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kernel_math import column_to_row, mm, mm_nt, row_to_column
from pallas_kernels.sparse_mla.kernel import QUERIES_PER_BLOCK, _prepare, _RowGather
from pallas_kernels.tpu_utils import LANES, pad_axis, round_up

# The backward's resident dk block, double-buffered, must leave room in VMEM (64 MiB per v5p TensorCore, as
# the compiler reports it): up to 32 MiB, i.e. S <= 32768 keys of D = 128 (a 32K-token context shard). With
# ik resident too (S <= 16384) the backward holds 3 x [S, D] fp32.
DK_VMEM_BUDGET = 32 * 2**20
# ik stays in VMEM (fp32, one buffer) while it takes at most this: S <= 16384 keys of D = 128
RESIDENT_KEYS_BUDGET = 8 * 2**20
# Selected slots per grid step (sparse_mla.kernel.slot_block rounds it to a query's k). A step of 512 slots x
# 32 indexer heads x 128 is ~0.02 us of MXU work beside a step's ~0.35 us, so the whole selection in one step
# pays: compiled for v5p at the 200K step's shapes (k = 2048, 202,752 keys) the forward takes 45% less at 2048
# than at 512 and the row-gradient backward 33% less.
KL_BLOCK_K = 2048
TENSORCORES_PER_CHIP = 2   # v4 / v5p megacore: a "parallel" grid axis is split over the chip's two cores
# per-query scalars travel as one lane row: lane 0 / 1 of a [B, T, LANES] fp32 array
# VMEM the default scoped limit leaves us; the backward's resident dk block needs more for long sequences
_DEFAULT_SCOPED_VMEM = 16 * 2**20


def _lane(row_1L, i):
    """Lane i of a [1, LANES] row as a [1, 1] value."""
    lane = jax.lax.broadcasted_iota(jnp.int32, row_1L.shape, 1)
    return jnp.sum(jnp.where(lane == i, row_1L, 0.0), axis=1, keepdims=True)


def _scores(iq_HD, rows_KD, w_H1):
    """(dots [H, block_k] fp32, I [1, block_k] fp32) of the query's heads against a block of key rows."""
    dots_HK = mm_nt(iq_HD, rows_KD)
    return dots_HK, jnp.sum(w_H1 * jnp.maximum(dots_HK, 0.0), axis=0, keepdims=True)


def _log_softmax_stats(scores_1K, valid_1K):
    """(shifted scores, log normaliser, has_set) of the masked softmax, as reference.kl_per_token takes them."""
    has_set = jnp.max(jnp.where(valid_1K, 1.0, 0.0), axis=1, keepdims=True) > 0.0
    row_max = jnp.max(jnp.where(valid_1K, scores_1K, -jnp.inf), axis=1, keepdims=True)
    row_max = jnp.where(has_set, row_max, 0.0)
    shifted = jnp.where(valid_1K, scores_1K - row_max, 0.0)
    norm = jnp.sum(jnp.where(valid_1K, jnp.exp(shifted), 0.0), axis=1, keepdims=True)
    log_norm = jnp.log(norm + jnp.where(has_set, 0.0, 1.0))
    return shifted, row_max, log_norm, has_set


def _slots_in_block(kb, block_k, n_slots):
    """How many of k-block kb's slots are real (the last block may end in padding: n_slots = k unpadded)."""
    return jnp.minimum(block_k, n_slots - kb * block_k)


def _gathered_rows(idx_ref, ik_ref, gather_scratch, b, kb, *, block_k, n_kb, n_slots, resident, dtype):
    """The current query's k-block of key rows [block_k, D] in ``dtype``. Resident: copied row by row from
    the VMEM copy of ik (ik_ref [1, S_pad, D] fp32) into a [block_k, D] fp32 scratch, real slots only (rows
    of padded slots are zero); else DMA-gathered from HBM (ik_ref [B, S, 1, D]) by the sparse-attention
    kernels' double-buffered gather (padded slots read row 0)."""
    if not resident:
        buf, sem = gather_scratch
        return _RowGather(idx_ref, ik_ref, buf, sem, b, block_k).rows(kb, n_kb)
    (rows_scr,) = gather_scratch
    start, n_real = kb * block_k, _slots_in_block(kb, block_k, n_slots)

    def copy_row(j, carry):
        rows_scr[pl.ds(j, 1), :] = ik_ref[0, pl.ds(idx_ref[start + j], 1), :]
        return carry

    jax.lax.fori_loop(0, n_real, copy_row, 0)
    real_K1 = jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < n_real
    return jnp.where(real_K1, rows_scr[...], 0.0).astype(dtype)   # exact: the fp32 copy holds dtype values


def _fwd_kernel(idx_ref, iq_ref, iw_ref, valid_ref, p_ref, ik_ref, stats_ref, *scratch, block_k, n_kb, n_slots,
                resident):
    # idx_ref (SMEM) [k_pad]; iq_ref [1, 1, H, D]; iw_ref [1, TQ, H] fp32; valid_ref [1, TQ, k_pad] int32;
    # p_ref [1, TQ, k_pad] fp32; stats_ref [1, TQ, LANES] fp32; scratch: the gather's, then scores [1, k_pad].
    *gather_scratch, scores_scr = scratch
    b, qi, kb = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    rows_KD = _gathered_rows(idx_ref, ik_ref, gather_scratch, b, kb, block_k=block_k, n_kb=n_kb, n_slots=n_slots,
                             resident=resident, dtype=iq_ref.dtype)
    _, scores_1K = _scores(iq_ref[0, 0], rows_KD, row_to_column(iw_ref[0, pl.ds(qi, 1), :]))
    scores_scr[:, pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)] = scores_1K

    @pl.when(kb == n_kb - 1)
    def _kl():
        valid_1K = valid_ref[0, pl.ds(qi, 1), :] != 0
        p_1K = p_ref[0, pl.ds(qi, 1), :]
        shifted, row_max, log_norm, has_set = _log_softmax_stats(scores_scr[...], valid_1K)
        p_log_p = jnp.where(p_1K > 0.0, p_1K * jnp.log(jnp.where(p_1K > 0.0, p_1K, 1.0)), 0.0)
        terms = jnp.where(valid_1K, p_log_p - p_1K * (shifted - log_norm), 0.0)
        kl_11 = jnp.where(has_set, jnp.sum(terms, axis=1, keepdims=True), 0.0)
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
        stats_ref[0, pl.ds(qi, 1), :] = jnp.where(lane == 0, kl_11, jnp.where(lane == 1, row_max + log_norm, 0.0))


def _bwd_kernel(idx_ref, iq_ref, iw_ref, valid_ref, p_ref, scal_ref, ik_ref, diq_ref, diw_ref, dik_ref,
                *scratch, block_k, n_kb, n_slots, resident, dk_rows):
    # scal_ref [1, TQ, LANES] fp32: lane 0 g (the cotangent of kl), lane 1 lse_I; diq_ref [1, 1, H, D] fp32
    # (resident over the k-blocks); diw_ref [1, TQ, H] fp32; dik_ref [1, 1, S_pad, D] fp32 (resident over
    # this share's queries), or with ``dk_rows`` the slots' row gradients [1, 1, block_k, 1, W] (W = D rounded
    # up to 128 lanes: in HBM each row its own (1, 128) tiles); scratch: the gather's, then dw [H, 1] and
    # (without ``dk_rows``) the row gradients [block_k, D] fp32.
    if dk_rows:
        *gather_scratch, dw_scr = scratch
    else:
        *gather_scratch, dw_scr, drows_scr = scratch
    b, t, qi, kb = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    rows_KD = _gathered_rows(idx_ref, ik_ref, gather_scratch, b, kb, block_k=block_k, n_kb=n_kb, n_slots=n_slots,
                             resident=resident, dtype=iq_ref.dtype)
    iq_HD = iq_ref[0, 0]
    w_H1 = row_to_column(iw_ref[0, pl.ds(qi, 1), :])
    dots_HK, scores_1K = _scores(iq_HD, rows_KD, w_H1)

    start = pl.multiple_of(kb * block_k, block_k)
    valid_row = valid_ref[0, pl.ds(qi, 1), :] != 0
    p_sum = jnp.sum(jnp.where(valid_row, p_ref[0, pl.ds(qi, 1), :], 0.0), axis=1, keepdims=True)
    valid_1K = valid_ref[0, pl.ds(qi, 1), pl.ds(start, block_k)] != 0
    p_1K = p_ref[0, pl.ds(qi, 1), pl.ds(start, block_k)]
    scal = scal_ref[0, pl.ds(qi, 1), :]
    g_11, lse_11 = _lane(scal, 0), _lane(scal, 1)
    softmax_1K = jnp.exp(jnp.where(valid_1K, scores_1K - lse_11, -jnp.inf))
    d_scores_1K = jnp.where(valid_1K, g_11 * (softmax_1K * p_sum - p_1K), 0.0)

    if not dk_rows:
        @pl.when((t == 0) & (qi == 0) & (kb == 0))
        def _init_share():
            dik_ref[...] = jnp.zeros(dik_ref.shape, jnp.float32)

    @pl.when(kb == 0)
    def _init_query():
        diq_ref[...] = jnp.zeros(diq_ref.shape, jnp.float32)
        dw_scr[...] = jnp.zeros(dw_scr.shape, jnp.float32)

    dw_scr[...] += jnp.sum(d_scores_1K * jnp.maximum(dots_HK, 0.0), axis=1, keepdims=True)
    g_HK = jnp.where(dots_HK > 0.0, d_scores_1K * w_H1, 0.0)
    # MXU operands in the keys' dtype with fp32 accumulation (as selected_scores._product_grads)
    diq_ref[0, 0] += mm(g_HK.astype(rows_KD.dtype), rows_KD)
    drows_KD = mm(g_HK.T.astype(iq_HD.dtype), iq_HD)
    if dk_rows:   # the rows the row scatter-add kernel fetches with one DMA each
        W = dik_ref.shape[4]
        if W > drows_KD.shape[1]:
            drows_KD = jnp.concatenate([drows_KD, jnp.zeros((block_k, W - drows_KD.shape[1]), jnp.float32)], 1)
        dik_ref[0, 0, :, 0, :] = drows_KD
    else:
        drows_scr[...] = drows_KD

        def add_row(j, carry):
            key = idx_ref[start + j]
            dik_ref[0, 0, pl.ds(key, 1), :] += drows_scr[pl.ds(j, 1), :]
            return carry

        jax.lax.fori_loop(0, _slots_in_block(kb, block_k, n_slots), add_row, 0)   # padded slots add zeros

    @pl.when(kb == n_kb - 1)
    def _store_dw():
        diw_ref[0, pl.ds(qi, 1), :] = column_to_row(dw_scr[...])


class _Call(NamedTuple):
    """A call's padded operands (T to TQ, k to block_k; invalid and padded slots read row 0, masked)."""
    B: int
    T: int
    S: int
    H: int
    D: int
    K: int
    T_pad: int
    K_pad: int
    block_k: int
    resident: bool          # ik kept in VMEM (fp32 [S_pad, D] per batch row) instead of row DMAs from HBM
    idx_row: int            # slots per query in idx_flat (sparse_mla.kernel._prepare)
    idx_flat: jax.Array     # int32 [B * T_pad * idx_row]
    valid: jax.Array        # int32 [B, T_pad, K_pad]
    iq: jax.Array           # [B, T_pad, H, D] in the common dtype of iq and ik
    iw: jax.Array           # fp32 [B, T_pad, H]
    p: jax.Array            # fp32 [B, T_pad, K_pad], 0 on padded slots
    ik: jax.Array           # resident: fp32 [B, S_pad, D]; else [B, S, 1, D], rows as an untiled leading dim
                            # (see sparse_mla/kernel.py)


def keys_fit_vmem(S, D):
    """Whether ik stays in VMEM: one fp32 [S, D] buffer of at most `RESIDENT_KEYS_BUDGET`."""
    return round_up(S, 8) * D * 4 <= RESIDENT_KEYS_BUDGET


def fits_vmem(S, D):
    """Whether the backward's [S, D] fp32 key-gradient block (two buffers) fits `DK_VMEM_BUDGET`."""
    return 2 * round_up(S, 8) * D * 4 <= DK_VMEM_BUDGET


def _call(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, block_k, resident) -> _Call:
    B, T, H, D = iq_BTHD.shape
    S = ik_BSD.shape[1]
    resident = keys_fit_vmem(S, D) if resident is None else resident
    d = _prepare(iq_BTHD, idx_BTK, valid_BTK, S, block_k)
    dtype = jnp.promote_types(iq_BTHD.dtype, ik_BSD.dtype)
    p = pad_axis(pad_axis(target_BTK.astype(jnp.float32), 2, d.K_pad), 1, d.T_pad)
    # a resident copy is fp32 (single rows of a 32-bit array load at any sublane offset), holding dtype values
    ik = (pad_axis(ik_BSD.astype(dtype).astype(jnp.float32), 1, round_up(S, 8)) if resident
          else ik_BSD.astype(dtype)[:, :, None, :])
    return _Call(B=B, T=T, S=S, H=H, D=D, K=d.K, T_pad=d.T_pad, K_pad=d.K_pad, block_k=d.block_k, resident=resident,
                 idx_row=d.idx_row, idx_flat=d.idx_flat, valid=d.valid, iq=pad_axis(iq_BTHD.astype(dtype), 1, d.T_pad),
                 iw=pad_axis(iw_BTH.astype(jnp.float32), 1, d.T_pad), p=p, ik=ik)


def _keys_spec_and_scratch(c: _Call):
    """(in-spec of ik, the gather's scratch): resident, one buffer of the batch row's keys (its block index
    changes only with the batch row); else ik stays in HBM and two [block_k, 1, D] buffers take row DMAs."""
    if c.resident:
        return (pl.BlockSpec((1,) + c.ik.shape[1:], lambda *g: (g[0], 0, 0), pipeline_mode=pl.Buffered(1)),
                [pltpu.VMEM((c.block_k, c.D), jnp.float32)])
    return (pl.BlockSpec(memory_space=pl.ANY),
            [pltpu.VMEM((2, c.block_k, 1, c.D), c.ik.dtype), pltpu.SemaphoreType.DMA((2,))])


def _vmem_limit(c: _Call, resident_bytes):
    """Compiler params asking for more scoped VMEM than the default when the resident blocks need it."""
    gather = c.block_k * c.D * 4 if c.resident else 2 * c.block_k * 16 * c.D * c.ik.dtype.itemsize
    need = resident_bytes + gather + 8 * 2**20     # + the per-query blocks and temporaries
    return dict(vmem_limit_bytes=need) if need > _DEFAULT_SCOPED_VMEM else {}


def _keys_bytes(c: _Call):
    """HBM bytes of reading the keys. Resident: the fp32 copy, once per batch row and TensorCore (a megacore
    chip's two cores each load it). Else one row DMA per slot: a [1, D] row of the [B, S, 1, D] operand,
    which XLA lays out in (1, 128) tiles for fp32 and (2, 128) tiles for bf16 (seen in the compiled HLO for
    v5p), one row per tile, so a row DMA moves D 32-bit words either way."""
    if c.resident:
        return TENSORCORES_PER_CHIP * c.ik.size * 4
    itemsize = c.ik.dtype.itemsize
    return c.B * c.T_pad * c.K_pad * c.D * max(itemsize, 4)


def _bytes_per_query_common(c: _Call):
    """Per query, what both kernels read besides the keys: idx (its SMEM row), valid, p, q, w."""
    return 4 * (c.idx_row + 2 * c.K_pad) + c.H * c.D * c.iq.dtype.itemsize + 4 * c.H


def _fwd_cost(c: _Call):
    slots = c.B * c.T_pad * c.K_pad
    return pl.CostEstimate(
        flops=slots * c.H * (2 * c.D + 3) + 10 * slots, transcendentals=2 * slots,
        bytes_accessed=_keys_bytes(c) + c.B * c.T_pad * (_bytes_per_query_common(c) + 4 * LANES))


def _bwd_cost(c: _Call, n_split, dk_rows=False):
    # per (slot, head): dots 2D, scores 3, dq 2D, row gradient 2D, dw and G 4; per slot 8, and D for the
    # in-VMEM scatter-add (with ``dk_rows`` the row scatter-add kernel does those adds, and this kernel writes
    # each slot's row gradient: W = D rounded up to 128 lanes, fp32)
    slots = c.B * c.T_pad * c.K_pad
    if dk_rows:
        dk_bytes, scatter_flops = slots * round_up(c.D, LANES) * 4, 0
    else:
        dk_bytes, scatter_flops = c.B * n_split * round_up(c.S, 8) * c.D * 4, slots * c.D
    per_query_out = 4 * c.H * c.D + 4 * c.H
    return pl.CostEstimate(
        flops=slots * c.H * (6 * c.D + 7) + slots * 8 + scatter_flops, transcendentals=slots,
        bytes_accessed=_keys_bytes(c) + dk_bytes
        + c.B * c.T_pad * (_bytes_per_query_common(c) + 4 * LANES + per_query_out))


def _common_specs(c: _Call, query_block):
    """In-specs of the per-query operands; ``query_block(grid indices)`` -> (b, block of TQ queries)."""
    TQ = QUERIES_PER_BLOCK

    def per_query(*g):
        b, t = query_block(*g)
        return b, t * TQ + g[-2], 0, 0

    def rows_of(shape_tail):
        return pl.BlockSpec((1, TQ) + shape_tail, lambda *g: (*query_block(*g), 0))

    def idx_block(*g):
        b, t = query_block(*g)
        return (b * c.T_pad + t * TQ + g[-2],)

    return [pl.BlockSpec((c.idx_row,), idx_block, memory_space=pltpu.SMEM),
            pl.BlockSpec((1, 1, c.H, c.D), per_query),
            rows_of((c.H,)), rows_of((c.K_pad,)), rows_of((c.K_pad,))], rows_of


def sparse_kl_fwd(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, *, block_k=KL_BLOCK_K, interpret=False,
                  resident=None):
    """(kl [B, T] fp32, lse_I [B, T] fp32): the KL per query token and the log-normaliser of its masked
    indexer softmax. ``target_BTK`` is p (0 at invalid slots). ``resident``: keep ik in VMEM (default: when
    `keys_fit_vmem`)."""
    c = _call(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, block_k, resident)
    TQ, n_kb = QUERIES_PER_BLOCK, c.K_pad // c.block_k
    in_specs, rows_of = _common_specs(c, lambda b, t, i, kb: (b, t))
    keys_spec, gather_scratch = _keys_spec_and_scratch(c)
    stats = pl.pallas_call(
        functools.partial(_fwd_kernel, block_k=c.block_k, n_kb=n_kb, n_slots=c.K, resident=c.resident),
        grid=(c.B, c.T_pad // TQ, TQ, n_kb),
        in_specs=in_specs + [keys_spec],
        out_specs=rows_of((LANES,)),
        out_shape=jax.ShapeDtypeStruct((c.B, c.T_pad, LANES), jnp.float32),
        scratch_shapes=gather_scratch + [pltpu.VMEM((1, c.K_pad), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
            **_vmem_limit(c, c.ik[0].size * 4 if c.resident else 0)),
        interpret=interpret,
        name="indexer_kl_sparse_fwd",
        cost_estimate=_fwd_cost(c),
    )(c.idx_flat, c.iq, c.iw, c.valid, c.p, c.ik)
    return stats[:, :c.T, 0], stats[:, :c.T, 1]


def _n_split(n_query_blocks):
    """Query shares of the backward: two (one per TensorCore of a megacore chip) when they divide evenly."""
    return TENSORCORES_PER_CHIP if n_query_blocks % TENSORCORES_PER_CHIP == 0 else 1


def sparse_kl_bwd(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, lse_BT, g_BT, *, block_k=KL_BLOCK_K,
                  interpret=False, resident=None):
    """(d iq [B,T,H,D], d ik [B,S,D], d iw [B,T,H]) fp32 for the cotangent ``g_BT`` of the per-token KL, with
    d ik accumulated in VMEM (`fits_vmem`)."""
    if not fits_vmem(ik_BSD.shape[1], ik_BSD.shape[2]):
        raise ValueError(f"sparse_kl_bwd: the [S, D] = {ik_BSD.shape[1:]} fp32 key-gradient block does not fit "
                         f"the VMEM budget of {DK_VMEM_BUDGET >> 20} MiB (use sparse_kl_bwd_rows)")
    c = _call(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, block_k, resident)
    diq, diw, dik = _bwd(c, lse_BT, g_BT, dk_rows=False, interpret=interpret)
    return diq[:, :c.T], jnp.sum(dik, axis=1)[:, :c.S], diw[:, :c.T]


def sparse_kl_bwd_rows(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, lse_BT, g_BT, *, block_k=KL_BLOCK_K,
                       interpret=False, resident=None):
    """(d iq [B,T,H,D], drows [B,T,k,1,W], d iw [B,T,H]) fp32, any number of keys: instead of d ik, each
    slot's row gradient (W = D rounded up to 128 lanes, zero past D; in HBM each row its own (1, 128) tiles;
    padded and invalid slots carry zeros), to be added into d ik by pallas_kernels/row_scatter (sparse_pallas
    does, per query chunk)."""
    c = _call(iq_BTHD, ik_BSD, iw_BTH, idx_BTK, valid_BTK, target_BTK, block_k, resident)
    diq, diw, drows = _bwd(c, lse_BT, g_BT, dk_rows=True, interpret=interpret)
    return diq[:, :c.T], drows[:, :c.T, :c.K], diw[:, :c.T]


def _bwd(c: _Call, lse_BT, g_BT, *, dk_rows, interpret):
    """The backward kernel: (d iq, d iw, dk) with dk either n_split partial [S_pad, D] blocks per batch row
    or (``dk_rows``) the slots' row gradients; T and k still padded."""
    TQ, n_kb = QUERIES_PER_BLOCK, c.K_pad // c.block_k
    n_blocks = c.T_pad // TQ
    n_split = 1 if dk_rows else _n_split(n_blocks)
    n_local = n_blocks // n_split
    lane = jnp.arange(LANES)
    scal = jnp.where(lane == 0, g_BT.astype(jnp.float32)[..., None],
                     jnp.where(lane == 1, lse_BT.astype(jnp.float32)[..., None], 0.0))
    scal = pad_axis(scal, 1, c.T_pad)     # padded queries: g = 0, and no valid slot

    def query_block(b, s, t, i, kb):
        return b, s * n_local + t

    in_specs, rows_of = _common_specs(c, query_block)
    keys_spec, gather_scratch = _keys_spec_and_scratch(c)
    if dk_rows:
        W = round_up(c.D, LANES)
        dk_spec = pl.BlockSpec((1, 1, c.block_k, 1, W),
                               lambda b, s, t, i, kb: (b, (s * n_local + t) * TQ + i, kb, 0, 0))
        dk_shape = (c.B, c.T_pad, c.K_pad, 1, W)
        resident_bytes = 0
        # queries write their own blocks: the query-block axis may be split over a megacore's TensorCores
        semantics = ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
    else:
        S_pad = round_up(c.S, 8)
        dk_spec = pl.BlockSpec((1, 1, S_pad, c.D), lambda b, s, t, i, kb: (b, s, 0, 0))
        dk_shape = (c.B, n_split, S_pad, c.D)
        resident_bytes = 2 * S_pad * c.D * 4
        semantics = ("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary")
    if c.resident:
        resident_bytes += c.ik[0].size * 4
    return pl.pallas_call(
        functools.partial(_bwd_kernel, block_k=c.block_k, n_kb=n_kb, n_slots=c.K, resident=c.resident,
                          dk_rows=dk_rows),
        grid=(c.B, n_split, n_local, TQ, n_kb),
        in_specs=in_specs + [rows_of((LANES,)), keys_spec],
        out_specs=[pl.BlockSpec((1, 1, c.H, c.D), lambda b, s, t, i, kb: (b, (s * n_local + t) * TQ + i, 0, 0)),
                   rows_of((c.H,)), dk_spec],
        out_shape=[jax.ShapeDtypeStruct((c.B, c.T_pad, c.H, c.D), jnp.float32),
                   jax.ShapeDtypeStruct((c.B, c.T_pad, c.H), jnp.float32),
                   jax.ShapeDtypeStruct(dk_shape, jnp.float32)],
        scratch_shapes=gather_scratch + [pltpu.VMEM((c.H, 1), jnp.float32)]
        + ([] if dk_rows else [pltpu.VMEM((c.block_k, c.D), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, **_vmem_limit(c, resident_bytes)),
        interpret=interpret,
        name="indexer_kl_sparse_bwd",
        cost_estimate=_bwd_cost(c, n_split, dk_rows),
    )(c.idx_flat, c.iq, c.iw, c.valid, c.p, scal, c.ik)
