"""Pallas TPU kernel: sparse MLA decode — gather a token's selected latent rows from one layer of the stacked
cache and attend over them, in one kernel (the computation: reference.py).

In two passes the decode step's attention core is pallas_kernels/row_gather writing each batch row's K selected
rows [K, C] to HBM, then XLA's attention reading them back for each of its two products (the logits and the
weighted sum) and writing and reading the [H, K] probabilities between them. Here grid step b streams batch row
b's [S, C] slice of layer ``layer`` (scalar prefetch) through VMEM as the row gather's streamed form does, picks
the K rows out of VMEM into a [K, C] scratch (the token's own new row at slot pos[b], not yet in the cache),
and runs both products and the softmax there: HBM holds only the slice read, the query and the [H, V] output.

Grid (B,), "parallel": the batch rows split over a chip's TensorCores. One batch row's slice (S x C, C padded
to whole lane tiles, double-buffered) must fit VMEM (`fits`); longer caches take the row gather's tile-group
DMAs and XLA's attention instead (glm5_jax/model/attention.py decides).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.row_gather.kernel import GROUP, STREAM_MAX_SLICE_BYTES, _row_of_slice, slice_bytes
from pallas_kernels.tpu_utils import pad_axis, round_up

NAME = "sparse_mla_decode"
VMEM_LIMIT = 48 << 20      # the double-buffered slice (<= STREAM_MAX_SLICE_BYTES), the [K, C] rows, [H, K] fp32


def fits(S: int, C: int, itemsize: int) -> bool:
    """Whether one batch row's [S, C] layer slice streams through VMEM (the row gather's bound)."""
    return slice_bytes(S, C, itemsize) <= STREAM_MAX_SLICE_BYTES


def _kernel(layer_ref, pos_ref, idx_ref, valid_ref, q_ref, new_ref, slice_ref, out_ref, rows, *, K_pad, S,
            scale, v_dim):
    # layer_ref / pos_ref (SMEM, scalar prefetch) [1] / [B]; idx_ref (SMEM) [K_pad]: batch row b's slots;
    # valid_ref [1, K_pad] int32; q_ref [H, C]; new_ref [1, C]; slice_ref [1, 1, S, C]: its layer slice;
    # out_ref [H, V]; rows (VMEM scratch) [K_pad, C] in the cache dtype
    pos = pos_ref[pl.program_id(0)]
    new_row = new_ref[...].astype(jnp.float32)

    def store_group(m, carry):
        picked = []
        for i in range(GROUP):
            slot = idx_ref[m * GROUP + i]
            picked.append(jnp.where(slot == pos, new_row, _row_of_slice(slice_ref, jnp.clip(slot, 0, S - 1))))
        rows[pl.ds(pl.multiple_of(m * GROUP, GROUP), GROUP), :] = jnp.concatenate(picked, 0).astype(rows.dtype)
        return carry
    jax.lax.fori_loop(0, K_pad // GROUP, store_group, 0)

    r = rows[...]
    # the MXU's native precision whatever jax_default_matmul_precision says (Mosaic has no fp32-contract bf16 matmul)
    logits = jax.lax.dot_general(q_ref[...].astype(r.dtype), r, (((1,), (1,)), ((), ())),
                                 precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)  # [H, K_pad]
    logits = jnp.where(valid_ref[...] != 0, logits * scale, -jnp.inf)
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.dot(probs.astype(r.dtype), r[:, :v_dim], precision=jax.lax.Precision.DEFAULT,
                  preferred_element_type=jnp.float32)
    out_ref[...] = out.astype(out_ref.dtype)


def cost(B, S, C, K_pad, H, v_dim, itemsize, q_itemsize):
    """Per call: both products' MXU FLOPs and the softmax's exps; bytes: each batch row's slice read, its
    indices and valid flags, the query and new row read, the output written."""
    return pl.CostEstimate(
        flops=B * 2 * H * K_pad * (C + v_dim), transcendentals=B * H * K_pad,
        bytes_accessed=B * (slice_bytes(S, C, itemsize) + K_pad * 8 + (H * C + H * v_dim) * q_itemsize
                            + C * itemsize))


def sparse_mla_decode(cache_LBSC, layer, idx_BK, valid_BK, q_BHC, new_BC, pos_B, *, scale, v_dim, block=128,
                      interpret=False):
    """[B, H, v_dim] in q's dtype (reference.py). ``cache`` bf16 or fp32 [L, B, S, C], S a multiple of 8 and
    its slice within `fits`; K is padded to a power of two >= ``block`` (Mosaic's 1-D SMEM index window;
    interpreted, a multiple of 16 will do), the padding invalid."""
    L, B, S, C = cache_LBSC.shape
    K = idx_BK.shape[1]
    H = q_BHC.shape[1]
    itemsize = cache_LBSC.dtype.itemsize
    if (idx_BK.shape != (B, K) or valid_BK.shape != (B, K) or q_BHC.shape != (B, H, C) or new_BC.shape != (B, C)
            or pos_B.shape != (B,) or S % 8 or cache_LBSC.dtype not in (jnp.bfloat16, jnp.float32)
            or not 0 < v_dim <= C or not fits(S, C, itemsize)):
        raise ValueError(f"sparse_mla_decode: want a bf16 or fp32 cache [L, B, S, C] (S a multiple of 8, one slice "
                         f"<= {STREAM_MAX_SLICE_BYTES} bytes), idx / valid [B, K], q [B, H, C], new [B, C], pos [B], "
                         f"0 < v_dim <= C; got cache {cache_LBSC.shape} {cache_LBSC.dtype}, idx {idx_BK.shape}, "
                         f"valid {valid_BK.shape}, q {q_BHC.shape}, new {new_BC.shape}, pos {pos_B.shape}, "
                         f"v_dim {v_dim}")
    K_pad = round_up(K, GROUP) if interpret else max(block, 1 << (K - 1).bit_length())
    idx = pad_axis(idx_BK.astype(jnp.int32), 1, K_pad).reshape(-1)
    valid = pad_axis(valid_BK.astype(jnp.int32), 1, K_pad)[:, None, :]      # padding: 0, never attended
    return pl.pallas_call(
        functools.partial(_kernel, K_pad=K_pad, S=S, scale=scale, v_dim=v_dim),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B,),
            in_specs=[pl.BlockSpec((K_pad,), lambda b, *_: (b,), memory_space=pltpu.SMEM),
                      pl.BlockSpec((None, 1, K_pad), lambda b, *_: (b, 0, 0)),
                      pl.BlockSpec((None, H, C), lambda b, *_: (b, 0, 0)),
                      pl.BlockSpec((None, 1, C), lambda b, *_: (b, 0, 0)),
                      pl.BlockSpec((1, 1, S, C), lambda b, layer_ref, pos_ref: (jnp.clip(layer_ref[0], 0, L - 1),
                                                                                b, 0, 0))],
            out_specs=pl.BlockSpec((None, H, v_dim), lambda b, *_: (b, 0, 0)),
            scratch_shapes=[pltpu.VMEM((K_pad, C), cache_LBSC.dtype)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, H, v_dim), q_BHC.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=NAME,
        cost_estimate=cost(B, S, C, K_pad, H, v_dim, itemsize, q_BHC.dtype.itemsize),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), pos_B.astype(jnp.int32), idx, valid, q_BHC,
      new_BC[:, None, :], cache_LBSC)
