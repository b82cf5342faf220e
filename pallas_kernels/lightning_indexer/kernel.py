"""Pallas TPU kernel for the lightning-indexer scores, then XLA top-k per query chunk.

Background: docs/architecture.md#lightning-indexer.

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])     (fp32 accumulation; -inf where not visible)

The kernel tiles queries (block_t) x keys (block_s) and loops over the H_I indexer heads in VMEM, so
neither [T, S, H_I] nor [T, H_I, S] is ever written to HBM; it emits the masked score tile [block_t,
block_s]. The caller runs it on one query chunk at a time and takes ``lax.top_k`` of that chunk, so HBM
holds at most [B, T_chunk, S] scores.

Layout choice: a tile is computed transposed, scores^T [block_s, block_t] = k @ q_h^T, because then the
per-query head weight w[:, h] is a lane *row* [1, block_t] (a cheap sublane broadcast) and no [T, 1]
column of weights is needed; one 2-D transpose turns the tile back before the store.

Causal block skipping: per query block the largest visible query position and per key block the
smallest key position are scalar-prefetched; a tile whose keys all lie after all its queries is
written as -inf without touching the MXU (about half of the tiles of a causal sequence).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.chunking import chunked_over_queries
from pallas_kernels.masking import top_k_mask
from pallas_kernels.tpu_utils import mxu_precision, pad_axis, round_up

_NO_POS = jnp.iinfo(jnp.int32).max // 2  # position sentinel for padding in the block-skip bounds


def _scores_kernel(q_max_pos_ref, kv_min_pos_ref,  # scalar prefetch (SMEM): [B * n_t], [B * n_s]
                   q_ref, k_ref, w_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref,
                   out_ref, *, n_heads):
    # q_ref [1, H, bt, D]; k_ref [1, bs, D]; w_ref [1, H, bt] fp32; q_pos/q_seg [1, 1, bt];
    # kv_pos/kv_seg [1, bs, 1]; out_ref [1, bt, bs] fp32.
    b, ti, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_t, n_s = pl.num_programs(1), pl.num_programs(2)
    block_t, block_s = out_ref.shape[1], out_ref.shape[2]
    all_in_future = kv_min_pos_ref[b * n_s + si] > q_max_pos_ref[b * n_t + ti]

    @pl.when(all_in_future)
    def _skip():
        out_ref[0] = jnp.full((block_t, block_s), -jnp.inf, jnp.float32)

    @pl.when(jnp.logical_not(all_in_future))
    def _compute():
        k_SD = k_ref[0]

        def add_head(h, acc_ST):
            q_TD = q_ref[0, h]
            dots_ST = jax.lax.dot_general(k_SD, q_TD, (((1,), (1,)), ((), ())),
                                          precision=mxu_precision(k_SD, q_TD), preferred_element_type=jnp.float32)
            w_1T = w_ref[0, pl.ds(h, 1), :]
            return acc_ST + w_1T * jnp.maximum(dots_ST, 0.0)

        scores_ST = jax.lax.fori_loop(0, n_heads, add_head, jnp.zeros((block_s, block_t), jnp.float32))
        q_seg_1T, kv_seg_S1 = q_seg_ref[0], kv_seg_ref[0]
        visible_ST = ((kv_seg_S1 == q_seg_1T) & (q_seg_1T != 0)
                      & (kv_pos_ref[0] <= q_pos_ref[0]))
        scores_ST = jnp.where(visible_ST, scores_ST, -jnp.inf)
        out_ref[0] = scores_ST.T


def _block_bounds(pos_BN, seg_BN, block, reduce, empty):
    """Per-block min/max position over non-padding entries, flattened to [B * n_blocks] int32."""
    B, N = pos_BN.shape
    pos = jnp.where(seg_BN != 0, pos_BN, empty).reshape(B, N // block, block)
    return reduce(pos, axis=-1).reshape(-1).astype(jnp.int32)


def index_scores(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *,
                 block_t=256, block_s=512, interpret=False):
    """Masked indexer scores [B, T, S] fp32 from the Pallas kernel (-inf where not visible)."""
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
        out_specs=pl.BlockSpec((1, block_t, block_s), lambda b, i, j, *_: (b, i, j)),
    )
    scores = pl.pallas_call(
        functools.partial(_scores_kernel, n_heads=H),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, T_pad, S_pad), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="lightning_indexer_scores",
        # every tile's H dots of width D (causal skipping is data-dependent: about half the tiles run)
        cost_estimate=pl.CostEstimate(
            flops=2 * B * T_pad * S_pad * H * D + 3 * B * T_pad * S_pad * H, transcendentals=0,
            bytes_accessed=q_BHTD.size * q_BHTD.dtype.itemsize + n_t * k_BSD.size * k_BSD.dtype.itemsize
            + 4 * B * T_pad * S_pad),
    )(q_max_pos, kv_min_pos, q_BHTD, k_BSD, w_BHT,
      q_pos[:, None, :], q_seg[:, None, :], kv_pos[:, :, None], kv_seg[:, :, None])
    return scores if (T, S) == (T_pad, S_pad) else scores[:, :T, :S]


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk,
                 q_chunk=512, block_t=256, block_s=512, with_mask=False, interpret=False):
    """Same contract as reference.indexer_topk: (idx [B, T, k] int32, valid [B, T, k] bool); with
    ``with_mask`` also the selection as a mask [B, T, S] int8 (1 = selected), made from each chunk's scores
    while they are at hand (masking.top_k_mask); int8 is what the masked kernels read."""
    k = min(topk, k_BSD.shape[1])

    def select(q, w, q_pos, q_seg):
        scores = index_scores(q, k_BSD, w, q_pos, kv_pos_BS, q_seg, kv_seg_BS,
                              block_t=block_t, block_s=block_s, interpret=interpret)
        top_scores, idx = jax.lax.top_k(scores, k)
        picked = (idx.astype(jnp.int32), top_scores > -jnp.inf)
        return picked + (top_k_mask(scores, top_scores, picked[0]).astype(jnp.int8),) if with_mask else picked

    return chunked_over_queries(select, q_chunk, q_BTHD.shape[1], q_BTHD, w_BTH, q_pos_BT, q_seg_BT)
