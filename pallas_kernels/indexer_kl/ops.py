"""DSA indexer KL loss: the one place that picks how it runs.

* The XLA implementation (reference.py) for the ``"reference"`` / ``"xla"`` impls, the warm-up stage on the
  absorbed form and the sparse stage without a given target: chunked over queries, so memory is
  O(B * T_chunk * H * S) in the warm-up stage and O(B * T_chunk * k) in the sparse stage. In the sparse stage
  every attention impl hands it the target it computed while attending (the Pallas forward kernel's second
  sweep included), so the KL only scores the indexer at the selected slots; without a target it recomputes
  one from the same selection.
* Sparse stage with a given target and ``"pallas"`` / ``"pallas_interpret"`` (`sparse_kl_per_token`): the
  kernels of sparse_kernel.py, which gather the selected indexer keys into VMEM per query and never write a
  [tokens, k, ...] array in the forward; the backward accumulates the key gradient in VMEM up to 32K keys
  per shard, past that it writes each slot's row gradient, one query chunk at a time, for the row
  scatter-add kernel (pallas_kernels/row_scatter) to add.
* Warm-up stage from the flash attention's lse with ``"pallas"`` / ``"pallas_interpret"``
  (`warmup_kl_sums`): the kernels of kernel.py, which recompute the attention logits blockwise in VMEM and
  never write a [T, S] array. The main model is frozen in this stage, so the kernel computes the loss and
  its gradients with respect to the indexer's q, k, w in one forward; the op returns per-batch-row sums
  (sum_t KL_t, number of tokens with a non-empty key set) and its custom VJP scales the saved gradients by
  each row's cotangent -- exact for any cotangent. Without differentiation a loss-only kernel runs.
  With a selection mask (``allowed_BTS``, e.g. `masking.selection_mask` of DSA's top-k) the same op is the
  sparse stage's KL computed densely, for when the sparse attention runs as masked dense blocks (short
  context, where the selection covers most visible keys) and hands over its lse over the selected keys.
"""
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET
from pallas_kernels.indexer_kl import kernel, sparse_pallas
# the public entry points: the loss, and its per-token parts for callers holding a share of the queries
from pallas_kernels.indexer_kl.reference import indexer_kl_loss, indexer_kl_per_token, mean_over_tokens  # noqa: F401
from pallas_kernels.tpu_utils import pad_axis, removable_when_unused, round_up

# queries / keys per kernel block: a [bq, H*D] and a [bk, H*D] block of 8 and 4 MiB at GLM-5's 64 x 256
# in bf16, double-buffered, with the fp32 gradient blocks and the dots scratch fit the scoped VMEM (a Mosaic
# compile at 256 x 256 runs out of v5p's 64 MiB). The larger query block halves the key blocks' re-reads.
BLOCK_Q, BLOCK_K = 256, 128
# the warm-up kernel's gradients with respect to the indexer's q, k, w (its VJP residuals, the size of the
# indexer's q + k + w) and its per-row sums: a remat policy keeping them runs the kernel once, in the forward
# pass; otherwise the backward pass reruns it
SAVED_NAMES = ("indexer_kl_warmup_grads",)


def mean_of_sums(kl_sum, count):
    """The loss from `warmup_kl_sums`' per-row sums (any shape): mean over tokens with a non-empty set."""
    return jnp.sum(kl_sum) / jnp.maximum(jnp.sum(count), 1.0)


def warmup_kl_sums(q_BTHD, k_BSHD, lse_BTH, index_q_BTHD, index_k_BSD, index_w_BTH, q_pos_BT, kv_pos_BS,
                   q_seg_BT, kv_seg_BS, allowed_BTS=None, *, scale, impl, block_q=BLOCK_Q, block_k=BLOCK_K,
                   q_chunk=128, index_lse_BT=None):
    """Warm-up indexer KL from the MHA attention (q [B,T,H,D], per-head keys k [B,S,H,D], fp32 lse [B,T,H])
    -> (sum over each batch row's tokens of KL_t [B], count of tokens with a non-empty set [B]), fp32.
    Each query's key set is its visible keys, with ``allowed_BTS`` (bool or int8 [B, T, S]) only those with
    allowed != 0 -- lse must be the attention's over the same set. Gradients reach only index_q / index_k /
    index_w (none reach the mask). ``block_q`` / ``block_k``: the kernels' blocks (a sequence shorter than a
    block uses one block of its length rounded up to 128); ``q_chunk``: the XLA impls' query chunk.
    ``index_lse_BT`` (fp32 [B, T], no gradient; used by the kernels): the log-sum-exp of the indexer's scores
    over each query's key set when the caller has it (the top-k that chose the selection), so the kernels'
    lse pass does not run. It must be that function of index_q / k / w: the kernels' gradients assume it."""
    sg = jax.lax.stop_gradient
    q_BTHD, k_BSHD, lse_BTH = sg(q_BTHD), sg(k_BSHD), sg(lse_BTH)
    if impl not in PALLAS_IMPLS:
        kl, has_set = indexer_kl_per_token(q_BTHD, k_BSHD, index_q_BTHD, index_k_BSD, index_w_BTH, q_pos_BT,
                                           kv_pos_BS, q_seg_BT, kv_seg_BS, scale=scale, stage="warmup",
                                           lse_BTH=lse_BTH, allowed_BTS=allowed_BTS, q_chunk=q_chunk)
        return jnp.sum(kl, axis=1), jnp.sum(has_set.astype(jnp.float32), axis=1)
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    static = (float(scale), min(block_q, round_up(T, kernel.LANES)), min(block_k, round_up(S, kernel.LANES)),
              impl == PALLAS_INTERPRET)
    index_lse = None if index_lse_BT is None else sg(index_lse_BT)
    return _kernel_sums(q_BTHD, k_BSHD, lse_BTH, index_q_BTHD, index_k_BSD, index_w_BTH, q_pos_BT, kv_pos_BS,
                        q_seg_BT, kv_seg_BS, allowed_BTS, index_lse, static)


def _run(args, static, with_grads):
    """The kernels on operands padded to the blocks (padded tokens: segment 0, seen by nobody, seeing
    nothing; the mask padded with 0) and head dims padded to 128 with zeros (dot products unchanged); padding
    cut off again."""
    q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, allowed, index_lse = args
    scale, bq, bk, interpret = static
    T, S, DI = q.shape[1], k.shape[1], iq.shape[3]
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    D, DIp = round_up(q.shape[3], kernel.LANES), round_up(DI, kernel.LANES)
    t_pad = lambda x: pad_axis(x, 1, Tp)   # noqa: E731
    s_pad = lambda x: pad_axis(x, 1, Sp)   # noqa: E731
    r = kernel.warmup_indexer_kl(
        pad_axis(t_pad(q), 3, D), pad_axis(s_pad(k), 3, D), jnp.swapaxes(t_pad(lse.astype(jnp.float32)), 1, 2),
        pad_axis(t_pad(iq), 3, DIp), pad_axis(s_pad(ik), 2, DIp), jnp.swapaxes(t_pad(iw), 1, 2),
        t_pad(q_pos), s_pad(kv_pos), t_pad(q_seg), s_pad(kv_seg),
        None if allowed is None else pad_axis(t_pad(allowed), 2, Sp),
        None if index_lse is None else t_pad(index_lse.astype(jnp.float32)),
        scale=scale, block_q=bq, block_k=bk, with_grads=with_grads, interpret=interpret)
    sums = (jnp.sum(r.kl_BT[:, :T], axis=1), jnp.sum(r.has_set_BT[:, :T].astype(jnp.float32), axis=1))
    if not with_grads:
        return sums, None
    return sums, (r.d_iq[:, :T, :, :DI].astype(iq.dtype), r.d_ik[:, :S, :DI].astype(ik.dtype),
                  r.d_iw[:, :T].astype(iw.dtype))


def _run_behind_barrier(args, static):
    """`_run` with gradients, its results behind an optimization barrier. Kept by a remat policy, they are
    written into the layer scan's stacked residuals; without the barrier the TPU compiler fuses the kernel
    with that write (a kCustom fusion), and the fused kernel loses its own scoped-VMEM limit (the 744B
    step: 36 MiB needed, 16 MiB allowed, no compile)."""
    return jax.lax.optimization_barrier(_run(args, static, with_grads=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def _kernel_sums(q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, allowed, index_lse, static):
    """Not differentiated: the loss-only kernel. ``allowed``: bool / int8 [B, T, S] (no cotangent) or None;
    ``index_lse``: [B, T] (no cotangent) or None."""
    return _run((q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, allowed, index_lse), static,
                with_grads=False)[0]


def _kernel_sums_fwd(q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, allowed, index_lse, static):
    # a removable call: when a policy keeps the gradients, the rematerialised backward drops the kernel
    sums, grads = removable_when_unused(_run_behind_barrier, (q, k, lse, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg,
                                                              allowed, index_lse), static=static)
    # the sums are named too: the loss's backward needs the token count (the mean's denominator)
    return checkpoint_name((sums, grads), SAVED_NAMES[0])


def _kernel_sums_bwd(static, grads, cotangents):
    # the count has no dependence on any input; each row's KL sum scales its own gradients
    d_kl_B, _ = cotangents
    d_iq, d_ik, d_iw = grads
    row = lambda g: (g.astype(jnp.float32) * d_kl_B.reshape((-1,) + (1,) * (g.ndim - 1))).astype(g.dtype)  # noqa: E731
    return (None, None, None, row(d_iq), row(d_ik), row(d_iw), None, None, None, None, None, None)


_kernel_sums.defvjp(_kernel_sums_fwd, _kernel_sums_bwd)


def sparse_kl_per_token(index_q_BTHD, index_k_BSD, index_w_BTH, idx_BTK, valid_BTK, target_BTK, *, impl):
    """Sparse stage, given target: (kl [B, T] fp32, has_set [B, T] bool). ``reference`` / ``xla``: the XLA
    form (reference.py); ``pallas`` / ``pallas_interpret``: the kernels (sparse_pallas.py), which run on one
    device (call them per shard on a mesh), at any number of keys."""
    if impl in PALLAS_IMPLS:
        return sparse_pallas.sparse_kl_per_token(index_q_BTHD, index_k_BSD, index_w_BTH, idx_BTK, valid_BTK,
                                                 target_BTK, interpret=impl == PALLAS_INTERPRET)
    return indexer_kl_per_token(None, None, index_q_BTHD, index_k_BSD, index_w_BTH, None, None, None, None,
                                scale=None, stage="sparse", idx_BTK=idx_BTK, valid_BTK=valid_BTK,
                                target_BTK=target_BTK)
