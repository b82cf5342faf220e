"""Pallas TPU kernel for the lightning-indexer scores, then the top-k per query chunk.

Background: docs/architecture.md#lightning-indexer.

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])     (fp32 accumulation; -inf where not visible)

The kernel tiles queries (block_t) x keys (block_s) and loops over the H_I indexer heads in VMEM, so
neither [T, S, H_I] nor [T, H_I, S] is ever written to HBM; it emits the masked score tile [block_t,
block_s]. The caller runs it on one query chunk at a time and selects that chunk's top k (one sort along
keys; ``lax.top_k`` where it also needs the selection mask), so HBM holds at most [B, T_chunk, S] scores.

Layout choice: a tile is computed transposed, scores^T [block_s, block_t] = k @ q_h^T, because then the
per-query head weight w[:, h] is a lane *row* [1, block_t] (a cheap sublane broadcast) and no [T, 1]
column of weights is needed. The selection path stores it as it is (keys-major, negated, with each entry's
key index: the layout and payload of its sort, `select_top_k`); the [T, S] scores path (the selection
mask at short context, tests) turns the tile back with one 2-D transpose before the store.

Causal block skipping: per query block the largest visible query position and per key block the
smallest key position are scalar-prefetched; a tile whose keys all lie after all its queries is
written as -inf (+inf negated) without touching the MXU (about half of the tiles of a causal sequence).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.chunking import chunked_over_queries
from pallas_kernels.kernel_math import mm_nt
from pallas_kernels.masking import top_k_mask
from pallas_kernels.tpu_utils import LANES, pad_axis, removable_when_unused, round_up

_NO_POS = jnp.iinfo(jnp.int32).max // 2  # position sentinel for padding in the block-skip bounds


def _scores_kernel(q_max_pos_ref, kv_min_pos_ref,  # scalar prefetch (SMEM): [B * n_t], [B * n_s]
                   q_ref, k_ref, w_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref,
                   out_ref, *key_index_out, n_heads, keys_major):
    # q_ref [1, H, bt, D]; k_ref [1, bs, D]; w_ref [1, H, bt] fp32; q_pos/q_seg [1, 1, bt];
    # kv_pos/kv_seg [1, bs, 1]; out_ref [1, bt, bs] fp32, or with keys_major [1, bs, bt] holding -scores and
    # key_index_ref [1, bs, bt] int32 each row's key index (the sort's payload).
    b, ti, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_t, n_s = pl.num_programs(1), pl.num_programs(2)
    block_t, block_s = q_ref.shape[2], k_ref.shape[1]
    all_in_future = kv_min_pos_ref[b * n_s + si] > q_max_pos_ref[b * n_t + ti]
    if keys_major:
        (key_index_ref,) = key_index_out
        key_index_ref[0] = si * block_s + jax.lax.broadcasted_iota(jnp.int32, (block_s, block_t), 0)

    @pl.when(all_in_future)
    def _skip():
        out_ref[0] = jnp.full(out_ref.shape[1:], jnp.inf if keys_major else -jnp.inf, jnp.float32)

    @pl.when(jnp.logical_not(all_in_future))
    def _compute():
        k_SD = k_ref[0]

        def add_head(h, acc_ST):
            q_TD = q_ref[0, h]
            dots_ST = mm_nt(k_SD, q_TD)
            w_1T = w_ref[0, pl.ds(h, 1), :]
            return acc_ST + w_1T * jnp.maximum(dots_ST, 0.0)

        scores_ST = jax.lax.fori_loop(0, n_heads, add_head, jnp.zeros((block_s, block_t), jnp.float32))
        q_seg_1T, kv_seg_S1 = q_seg_ref[0], kv_seg_ref[0]
        visible_ST = ((kv_seg_S1 == q_seg_1T) & (q_seg_1T != 0)
                      & (kv_pos_ref[0] <= q_pos_ref[0]))
        if keys_major:
            out_ref[0] = jnp.where(visible_ST, -scores_ST, jnp.inf)
        else:
            out_ref[0] = jnp.where(visible_ST, scores_ST, -jnp.inf).T


def _block_bounds(pos_BN, seg_BN, block, reduce, empty):
    """Per-block min/max position over non-padding entries, flattened to [B * n_blocks] int32."""
    B, N = pos_BN.shape
    pos = jnp.where(seg_BN != 0, pos_BN, empty).reshape(B, N // block, block)
    return reduce(pos, axis=-1).reshape(-1).astype(jnp.int32)


def index_scores(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *,
                 block_t=256, block_s=512, keys_major=False, interpret=False):
    """Masked indexer scores [B, T, S] fp32 from the Pallas kernel (-inf where not visible).

    ``keys_major``: (the negated scores as [B, S_pad, T_pad], +inf where not visible; keys and queries
    padded up to the blocks, padding invisible; each entry's key index [B, S_pad, T_pad] int32), the layout,
    order and payload `select_top_k` sorts. The kernel writes the index array because XLA hoists a
    loop-invariant iota out of the query-chunk loop and then copies it per chunk (the sort overwrites its
    operands): a write instead of a read and a write."""
    B, T, H, D = q_BTHD.shape
    S = k_BSD.shape[1]
    block_t = min(block_t, round_up(T, 128))
    block_s = min(block_s, round_up(S, 128))
    T_pad, S_pad = round_up(T, block_t), round_up(S, block_s)

    # Padding rows/keys get segment 0, which makes them invisible (masking.visible_mask).
    q_BHTD = pad_axis(jnp.transpose(q_BTHD, (0, 2, 1, 3)), 2, T_pad)
    w_BHT = pad_axis(jnp.transpose(w_BTH.astype(jnp.float32), (0, 2, 1)), 2, T_pad)
    k_BSD = pad_axis(k_BSD.astype(q_BTHD.dtype), 1, S_pad)
    q_pos, q_seg = (pad_axis(x.astype(jnp.int32), 1, T_pad) for x in (q_pos_BT, q_seg_BT))
    kv_pos, kv_seg = (pad_axis(x.astype(jnp.int32), 1, S_pad) for x in (kv_pos_BS, kv_seg_BS))

    q_max_pos = _block_bounds(q_pos, q_seg, block_t, jnp.max, -_NO_POS)
    kv_min_pos = _block_bounds(kv_pos, kv_seg, block_s, jnp.min, _NO_POS)

    n_t, n_s = T_pad // block_t, S_pad // block_s
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, n_t, n_s),
        in_specs=[
            pl.BlockSpec((1, H, block_t, D), lambda b, i, j, *_: (b, 0, i, 0)),
            pl.BlockSpec((1, block_s, D), lambda b, i, j, *_: (b, j, 0)),
            pl.BlockSpec((1, H, block_t), lambda b, i, j, *_: (b, 0, i)),
            pl.BlockSpec((1, 1, block_t), lambda b, i, j, *_: (b, 0, i)),
            pl.BlockSpec((1, 1, block_t), lambda b, i, j, *_: (b, 0, i)),
            pl.BlockSpec((1, block_s, 1), lambda b, i, j, *_: (b, j, 0)),
            pl.BlockSpec((1, block_s, 1), lambda b, i, j, *_: (b, j, 0)),
        ],
        out_specs=([pl.BlockSpec((1, block_s, block_t), lambda b, i, j, *_: (b, j, i))] * 2 if keys_major else
                   pl.BlockSpec((1, block_t, block_s), lambda b, i, j, *_: (b, i, j))),
    )
    scores = pl.pallas_call(
        functools.partial(_scores_kernel, n_heads=H, keys_major=keys_major),
        grid_spec=grid_spec,
        out_shape=([jax.ShapeDtypeStruct((B, S_pad, T_pad), jnp.float32),
                    jax.ShapeDtypeStruct((B, S_pad, T_pad), jnp.int32)] if keys_major else
                   jax.ShapeDtypeStruct((B, T_pad, S_pad), jnp.float32)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="lightning_indexer_scores",
        # each computed tile's H dots of width D. Which tiles run is data-dependent (positions); declared:
        # the tiles a causal sequence needs, on average over its query chunks (n_s + 1) / (2 n_s) of them,
        # as flash_attention declares its block pairs (a zig-zag context shard needs the same on average)
        cost_estimate=pl.CostEstimate(
            flops=(2 * D + 3) * H * B * T_pad * S_pad * (n_s + 1) // (2 * n_s), transcendentals=0,
            bytes_accessed=q_BHTD.size * q_BHTD.dtype.itemsize + n_t * k_BSD.size * k_BSD.dtype.itemsize
            + (8 if keys_major else 4) * B * T_pad * S_pad),
    )(q_max_pos, kv_min_pos, q_BHTD, k_BSD, w_BHT,
      q_pos[:, None, :], q_seg[:, None, :], kv_pos[:, :, None], kv_seg[:, :, None])
    if keys_major:
        return scores
    return scores if (T, S) == (T_pad, S_pad) else scores[:, :T, :S]


def _first_rows_kernel(idx_ref, neg_ref, idx_out_ref, valid_out_ref):
    # idx_ref / neg_ref [1, bk, T] (sorted key-major rows); outputs [1, T, bk]: the same rows transposed.
    idx_out_ref[0] = idx_ref[0].T
    valid_out_ref[0] = (neg_ref[0] < jnp.inf).astype(jnp.int32).T


def _first_rows_transposed(idx_BST, neg_sorted_BST, k, interpret):
    """(idx [B, T, k_pad] int32, valid [B, T, k_pad] int32) from the first k_pad = round_up(k, 128) rows of the
    sorted arrays [B, S_pad, T]. A kernel and not ``idx[:, :k].swapaxes(1, 2)``: XLA's layout assignment
    makes that transpose free by laying the whole sorted [S, T] array out transposed, a relayout copy of
    both sorted arrays per chunk; a kernel's operands keep the row-major layout, so only k rows are read."""
    B, S_pad, T = idx_BST.shape
    k_pad = round_up(k, LANES)
    block_k = next(b for b in (512, 256, 128) if k_pad % b == 0)
    in_spec = pl.BlockSpec((1, block_k, T), lambda b, j: (b, j, 0))
    out_spec = pl.BlockSpec((1, T, block_k), lambda b, j: (b, 0, j))
    out = jax.ShapeDtypeStruct((B, T, k_pad), jnp.int32)
    return pl.pallas_call(
        _first_rows_kernel, grid=(B, k_pad // block_k), in_specs=[in_spec, in_spec], out_specs=[out_spec, out_spec],
        out_shape=[out, out], interpret=interpret, name="indexer_first_rows",
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * 4 * B * k_pad * T),
    )(idx_BST, neg_sorted_BST)


def select_top_k(neg_scores_BST, key_index_BST, k, T, interpret=False):
    """(idx [B, T, k] int32, valid [B, T, k] bool) from `index_scores(..., keys_major=True)`: what
    ``lax.top_k`` of the scores [B, T, S] returns, as one ascending sort along keys by (negated score, key
    index): ties keep the lower key first, as top_k does, and padded keys sort after every real one. The
    index as a second sort key instead of ``is_stable``, for which XLA:TPU adds an iota operand of its own.

    Why not ``lax.top_k``: for k in the thousands XLA:TPU lowers it to a full sort along the last axis,
    which it runs with the [T, S] array laid out keys-major, so the [T, S] scores and both sorted outputs
    each took a relayout copy of the whole array. Here the kernel writes that layout directly and only the
    first k sorted rows are read back."""
    neg_sorted, idx = jax.lax.sort((neg_scores_BST, key_index_BST), dimension=1, is_stable=False, num_keys=2)
    idx_BTK, valid_BTK = _first_rows_transposed(idx, neg_sorted, k, interpret)
    return idx_BTK[:, :T, :k], valid_BTK[:, :T, :k] != 0


def _scores_and_selection(q, k_BSD, w, q_pos, kv_pos, q_seg, kv_seg, *, k, block_t, block_s, interpret):
    neg_scores, key_index = index_scores(q, k_BSD, w, q_pos, kv_pos, q_seg, kv_seg, block_t=block_t,
                                         block_s=block_s, keys_major=True, interpret=interpret)
    return select_top_k(neg_scores, key_index, k, q.shape[1], interpret)


def _masked_selection(q, k_BSD, w, q_pos, kv_pos_BS, q_seg, kv_seg_BS, *, k, block_t, block_s, interpret,
                      with_lse=False):
    """(idx, valid, mask int8 [B, T, S][, lse [B, T]]) of one query chunk: `lax.top_k` of the scores and the
    same selection as a mask, made from the scores while they are at hand; with ``with_lse`` also the
    log-sum-exp of the selected scores (-inf with none), the indexer KL's normaliser over the selection."""
    scores = index_scores(q, k_BSD, w, q_pos, kv_pos_BS, q_seg, kv_seg_BS,
                          block_t=block_t, block_s=block_s, interpret=interpret)
    top_scores, idx = jax.lax.top_k(scores, k)
    picked = (idx.astype(jnp.int32), top_scores > -jnp.inf, top_k_mask(scores, top_scores, idx).astype(jnp.int8))
    return picked + (jax.nn.logsumexp(top_scores, axis=-1),) if with_lse else picked


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk,
                 q_chunk=512, block_t=256, block_s=512, with_mask=False, with_lse=False, interpret=False):
    """Same contract as reference.indexer_topk: (idx [B, T, k] int32, valid [B, T, k] bool); with
    ``with_mask`` also the selection as a mask [B, T, S] int8 (1 = selected), made from each chunk's scores
    while they are at hand (masking.top_k_mask); int8 is what the masked kernels read. ``with_lse`` (with the
    mask): also the log-sum-exp of each query's selected scores [B, T] fp32."""
    k = min(topk, k_BSD.shape[1])
    if with_lse and not with_mask:
        raise ValueError("indexer_topk: with_lse comes with the selection mask (with_mask=True)")
    extra = dict(with_lse=True) if with_lse else {}

    def select(q, w, q_pos, q_seg):
        # one removable call: under a remat policy that saves the selection, the backward drops all of it
        return removable_when_unused(_masked_selection if with_mask else _scores_and_selection, q, k_BSD, w, q_pos,
                                     kv_pos_BS, q_seg, kv_seg_BS, k=k, block_t=block_t, block_s=block_s,
                                     interpret=interpret, **extra)

    return chunked_over_queries(select, q_chunk, q_BTHD.shape[1], q_BTHD, w_BTH, q_pos_BT, q_seg_BT)
