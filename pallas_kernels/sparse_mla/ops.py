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

from pallas_kernels.chunking import merge_queries, split_queries
from pallas_kernels.impls import PALLAS, PALLAS_IMPLS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.masking import selection_mask
from pallas_kernels.sparse_mla import gather_saved, kernel, masked_dense, reference
from pallas_kernels.sparse_mla.attention_vjp import attention_vjp
from pallas_kernels.tpu_utils import LANES, round_up

IMPLS = (REFERENCE, XLA, PALLAS, PALLAS_INTERPRET)
BWD_Q_CHUNK = 64  # queries per backward kernel call; the row gradients of one chunk live in HBM
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
    results = kernel.sparse_mla_fwd(sg(q), sg(kv), idx, valid, scale=scale, v_dim=v_dim, interpret=interpret,
                                    with_target=with_target)
    out, lse = (checkpoint_name(x, name) for x, name in zip(results[:2], PALLAS_SAVED_NAMES))
    return (*_with_grads(q, kv, idx, valid, out, lse, (scale, v_dim, interpret)), results[2] if with_target else None)


def _kernel_grads(q, kv, idx, valid, dout, lse, delta, scale, v_dim, interpret):
    return sparse_mla_grads(q, kv, idx, valid, dout, lse, delta, scale=scale, v_dim=v_dim, interpret=interpret)


_with_grads = attention_vjp(_kernel_grads)   # identity on (out, lse); its VJP runs the backward kernel


def sparse_mla_grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, dout_BTHV, lse_BTH, delta_BTH, *,
                     scale, v_dim, interpret, q_chunk=BWD_Q_CHUNK):
    """(dq [B,T,H,C] fp32, dkv [B,S,C] fp32): backward kernel per query chunk + scatter-add of rows
    (memory O(B * T_chunk * k * C))."""
    B, S, C = kv_BSC.shape
    split = functools.partial(split_queries, q_chunk=q_chunk)
    Cp = round_up(C, LANES)

    # The scatter-add runs in the tile-row view: in [S, C] fp32 a TPU tile spans 8 rows, so adding one row
    # reads and writes 7 others; in [S, C/128, 128] (C padded to 640) each row owns its tiles (v5p:2x2x1,
    # one 64-query chunk at GLM-5's widths: 6.4 -> 3.2 GB by our count and by XLA's). Same sums. The kernel
    # writes the row gradients in that view and the loop carries d(kv) in it, so nothing is padded,
    # relaid out or sliced per chunk (v5p:2x2x1, 1024 queries per chip, forward + backward: 63.7 -> 41 GB).
    def step(d3, chunk):
        q, idx, valid, dout, lse, delta = chunk
        dq, rows = kernel.sparse_mla_bwd_rows(q, kv_BSC, idx, valid, dout, lse, delta, scale=scale,
                                              v_dim=v_dim, tile_rows=True, interpret=interpret)
        return reference.scatter_add_rows(d3, idx, rows, valid), dq

    chunks = (split(q_BTHC), split(idx_BTK), split(valid_BTK, value=False), split(dout_BTHV),
              split(lse_BTH, value=-jnp.inf), split(delta_BTH))
    d3, dq = jax.lax.scan(step, jnp.zeros((B, S, Cp // LANES, LANES), jnp.float32), chunks)
    return merge_queries(dq, q_BTHC.shape[1]), d3.reshape(B, S, Cp)[..., :C]
