"""Sparse MLA attention: the one place that picks how the attention core runs, by ``impl``.

All impls compute the same function (reference.py): every query head attends, in the absorbed form,
to the latent rows [c; k_rot] of its query's selected keys; the value is the first ``v_dim`` columns.

* ``"reference"``: `reference.sparse_mla`, differentiated by JAX (the readable oracle).
* ``"xla"``: plain XLA tuned for training rows (queries and keys are the same tokens). The leading
  causal query blocks, which can see few keys, attend densely through the selection mask
  (`masked_dense`, one matmul per block); the rest gather their k rows with a hand-written VJP that
  keeps the probabilities while they fit a memory budget (`gather_saved`), else the reference.
  Over a decode cache it attends through the selection mask while the cache holds at most
  ``DENSE_DECODE_FACTOR * k`` slots, else it gathers.
* ``"pallas"`` / ``"pallas_interpret"``: the TPU kernels of kernel.py (real Mosaic / the Pallas
  interpreter on CPU). JAX cannot differentiate ``pallas_call``, so the forward runs on detached inputs
  and `_with_grads`, an identity with a custom VJP, attaches the backward kernel. The forward's results
  are named (``SAVED_NAMES``) so a remat policy keeping them never reruns the kernel.

The indexer KL target (head-mean attention probabilities at the selected slots, no gradient) comes
with ``with_target`` from every impl: the XLA impls keep it from their own probabilities, the Pallas
forward kernel emits it from a second sweep over the selected rows (kernel.py).

Shapes: q [B,T,H,C], kv [B,S,C], idx / valid [B,T,k] -> out [B,T,H,v_dim], lse [B,T,H] (fp32).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.chunking import equal_chunk, merge_queries, split_queries
from pallas_kernels.impls import PALLAS, PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.masking import selection_mask
from pallas_kernels.row_scatter.ops import row_scatter_add
from pallas_kernels.sparse_mla import gather_saved, kernel, masked_dense, reference
from pallas_kernels.sparse_mla.attention_vjp import attention_vjp
from pallas_kernels.tpu_utils import LANES, removable_when_unused, round_up

IMPLS = (REFERENCE, XLA, PALLAS, PALLAS_INTERPRET)
BWD_Q_CHUNK = 64  # fewest queries per backward kernel call (bwd_q_chunk); a chunk's row gradients live in HBM
# A decode cache of at most this many times k slots attends through the selection mask (one matmul over
# every slot) instead of gathering k rows per query: the same result for a few times the FLOPs.
DENSE_DECODE_FACTOR = 4
PALLAS_SAVED_NAMES = ("sparse_mla_kernel_out", "sparse_mla_kernel_lse")
# every residual an impl names for remat policies (decoder.REMAT_POLICIES keeps them)
SAVED_NAMES = masked_dense.SAVED_NAMES + gather_saved.SAVED_NAMES + PALLAS_SAVED_NAMES


def check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"sparse_mla: unknown impl {impl!r}; choose one of {IMPLS}")


class SparseAttention(NamedTuple):
    out: jax.Array              # [B, T, H, v_dim]
    lse: jax.Array              # [B, T, H] fp32 log-sum-exp of the scores (-inf: a query without valid slots)
    target: jax.Array | None    # [B, T, k] fp32 indexer-KL target (head-mean probabilities), no gradient


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, impl=XLA, training_rows=True,
               with_target=False) -> SparseAttention:
    """Sparse attention of each query over its k selected latent rows. ``target`` is the indexer KL target
    with ``with_target`` (None over a decode cache attended through the selection mask), else None.

    ``training_rows``: the keys are the queries' own tokens (kv row t is query t), so causal blocks of
    queries see only a prefix of the keys; False for a decode cache, whose slots may run ahead.
    """
    check_impl(impl)
    out, lse, target = _sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, scale=scale, v_dim=v_dim, impl=impl,
                                   training_rows=training_rows, with_target=with_target)
    return SparseAttention(out, lse, target if with_target else None)


def _sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, impl, training_rows, with_target):
    """(out, lse, target or None)."""
    if impl in PALLAS_IMPLS:
        return _pallas(q_BTHC, kv_BSC, idx_BTK, valid_BTK, float(scale), v_dim, impl == PALLAS_INTERPRET,
                       with_target)
    args = (q_BTHC, kv_BSC, idx_BTK, valid_BTK)
    if impl == REFERENCE:
        return _with_optional_target(reference.sparse_mla, args, scale, v_dim, with_target)
    if training_rows:
        return _xla_training(*args, scale=scale, v_dim=v_dim, with_target=with_target)
    S, k = kv_BSC.shape[1], idx_BTK.shape[-1]
    if S <= DENSE_DECODE_FACTOR * k:
        allowed = selection_mask(idx_BTK, valid_BTK, S)
        out, lse = reference.dense_mla(q_BTHC, kv_BSC, allowed, scale=scale, v_dim=v_dim)
        return out, lse, None
    return _with_optional_target(reference.sparse_mla, args, scale, v_dim, with_target)


def _with_optional_target(fn, args, scale, v_dim, with_target):
    results = fn(*args, scale=scale, v_dim=v_dim, with_target=with_target)
    return results if with_target else (*results, None)


def _xla_training(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, with_target):
    """Queries [0, n) through the selection mask over keys [0, n) (top-k picks visible keys, so a query
    before n selects keys before n); queries [n, T) over their gathered rows."""
    T, k = q_BTHC.shape[1], idx_BTK.shape[-1]
    B, H = q_BTHC.shape[0], q_BTHC.shape[2]
    n = masked_dense.dense_prefix(T, k, masked_dense.Q_CHUNK, masked_dense.DENSE_BLOCK_FACTOR)
    parts = []
    if n:
        dense = functools.partial(masked_dense.sparse_mla, q_chunk=masked_dense.Q_CHUNK)
        parts.append(_with_optional_target(dense, (q_BTHC[:, :n], kv_BSC[:, :n], idx_BTK[:, :n], valid_BTK[:, :n]),
                                           scale, v_dim, with_target))
    if n < T:
        gather = gather_saved if gather_saved.fits(B, T - n, k, H) else reference
        parts.append(_with_optional_target(gather.sparse_mla, (q_BTHC[:, n:], kv_BSC, idx_BTK[:, n:], valid_BTK[:, n:]),
                                           scale, v_dim, with_target))
    if len(parts) == 1:
        return parts[0]
    return tuple(None if x[0] is None else jnp.concatenate(x, axis=1) for x in zip(*parts))


def dense_mla(q_BTHC, kv_BSC, visible_BTS, *, scale, v_dim, q_chunk=256):
    """Absorbed attention over every visible key (DSA's dense stage, or a sequence no longer than k):
    (out, lse). One XLA implementation serves every impl."""
    return reference.dense_mla(q_BTHC, kv_BSC, visible_BTS, scale=scale, v_dim=v_dim, q_chunk=q_chunk)


# ----------------------------------------------------------------------------------------- Pallas path
def _pallas(q, kv, idx, valid, scale, v_dim, interpret, with_target):
    """(out, lse, target or None); the target is computed on detached inputs (it carries no gradient)."""
    sg = jax.lax.stop_gradient
    results = removable_when_unused(kernel.sparse_mla_fwd, sg(q), sg(kv), idx, valid, scale=scale, v_dim=v_dim,
                                    interpret=interpret, with_target=with_target)
    out, lse = (checkpoint_name(x, name) for x, name in zip(results[:2], PALLAS_SAVED_NAMES))
    return (*_with_grads(q, kv, idx, valid, out, lse, (scale, v_dim, interpret)), results[2] if with_target else None)


def _kernel_grads(q, kv, idx, valid, dout, lse, delta, scale, v_dim, interpret):
    return sparse_mla_grads(q, kv, idx, valid, dout, lse, delta, scale=scale, v_dim=v_dim, interpret=interpret)


_with_grads = attention_vjp(_kernel_grads)   # identity on (out, lse); its VJP runs the backward kernel


def sparse_mla_grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, dout_BTHV, lse_BTH, delta_BTH, *,
                     scale, v_dim, interpret, q_chunk=None):
    """(dq [B,T,H,C] fp32, dkv [B,S,C] fp32): the backward kernel per query chunk, each chunk's row
    gradients added into d(kv) by the row scatter-add kernel (pallas_kernels/row_scatter; memory
    O(B * T_chunk * k * C)). ``q_chunk`` (default `bwd_q_chunk`) is rounded to equal chunks.

    With bf16 kv (the model's compute dtype) each row gradient travels through HBM rounded to bf16, two per
    uint32 lane (row_scatter/packing.py: 384 lanes instead of 640 at C = 576), and is added into the fp32
    d(kv) in fp32: the precision of kv's own (bf16) cotangent, at 60% of the row traffic."""
    B, T = q_BTHC.shape[:2]
    S, C = kv_BSC.shape[1:]
    K = idx_BTK.shape[2]
    W = round_up(C, LANES)
    packed = kv_BSC.dtype == jnp.bfloat16
    split = functools.partial(split_queries, q_chunk=equal_chunk(T, q_chunk or bwd_q_chunk(S, K)))
    kv_rows = kernel.kv_row_view(kv_BSC)      # the kernel's row view, made once for every chunk
    scatter_impl = PALLAS_INTERPRET if interpret else PALLAS

    # XLA's scatter-add would read and write back a whole (8, 128) fp32 tile per selected row, each row
    # padded to 8 sublanes (4 KiB for GLM-5's 576 columns); the row scatter-add reads each row's 640 lanes
    # once and d(kv) once per chunk.
    def step(dkv, chunk):
        q, idx, valid, dout, lse, delta = chunk
        dq, rows = kernel.sparse_mla_bwd_rows(q, kv_rows, idx, valid, dout, lse, delta, scale=scale,
                                              v_dim=v_dim, dma_rows=True, packed_rows=packed, interpret=interpret)
        Tc = idx.shape[1]
        dkv = row_scatter_add(dkv, rows.reshape(B, Tc * K, rows.shape[-1]), idx.reshape(B, -1), valid.reshape(B, -1),
                              impl=scatter_impl)
        return dkv, dq

    chunks = (split(q_BTHC), split(idx_BTK), split(valid_BTK, value=False), split(dout_BTHV),
              split(lse_BTH, value=-jnp.inf), split(delta_BTH))
    dkv, dq = jax.lax.scan(step, jnp.zeros((B, S, W), jnp.float32), chunks)
    return merge_queries(dq, T), dkv[..., :C]


def bwd_q_chunk(S, K):
    """Queries per backward chunk: enough that the chunk's k row updates (each a row of d(kv)) outnumber the
    S rows of d(kv) the scatter-add reads and writes once per chunk by 16x (16 S / k), at least 64 and at most
    2048 (GLM-5 at 202,752 keys, k = 2048: 1,584 queries, 5.0 GB of packed bf16 row gradients; the 200K step
    10.77 -> 10.70 s against 8 S / k)."""
    return min(2048, max(BWD_Q_CHUNK, round_up(16 * S // K, 8)))
