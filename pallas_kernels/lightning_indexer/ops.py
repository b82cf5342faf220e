"""Lightning indexer + top-k behind an ``impl`` switch.

"reference" and "xla" are the XLA reference (reference.py: query chunks scoring only the key window
they can see); "pallas" runs the TPU score kernel (kernel.py) and "pallas_interpret" the same kernel
through the Pallas interpreter (CPU tests).

The selection carries no gradient: top-k indices are integers, and the indexer learns only from its KL
loss (pallas_kernels/indexer_kl). The inputs are detached here, before any kernel runs, so automatic
differentiation of a model that uses the indexer never asks ``pallas_call`` for a derivative.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.impls import PALLAS, PALLAS_INTERPRET, REFERENCE, XLA
from pallas_kernels.lightning_indexer import kernel, reference
from pallas_kernels.masking import selection_mask

IMPLS = (REFERENCE, XLA, PALLAS, PALLAS_INTERPRET)


def check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"indexer_topk: unknown impl {impl!r}; choose one of {IMPLS}")


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk, impl="xla",
                 with_mask=False, with_lse=False):
    """(idx [B, T, k] int32, valid [B, T, k] bool), k = min(topk, S): the top-k visible keys per query; with
    ``with_mask`` also the same selection as a mask [B, T, S] int8, 1 = selected (for attending densely over it),
    and with ``with_lse`` (with the mask) the log-sum-exp of each query's selected scores [B, T] fp32 (-inf
    with none): the normaliser of the indexer's distribution in the sparse stage's KL, which the Pallas top-k
    has at hand."""
    check_impl(impl)
    if with_lse and not with_mask:
        raise ValueError("indexer_topk: with_lse comes with the selection mask (with_mask=True)")
    q_BTHD, k_BSD, w_BTH = (jax.lax.stop_gradient(x) for x in (q_BTHD, k_BSD, w_BTH))
    args = (q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS)
    if impl in ("reference", "xla"):
        idx, valid = reference.indexer_topk(*args, topk=topk)
        if not with_mask:
            return idx, valid
        mask = selection_mask(idx, valid, k_BSD.shape[1])
        if not with_lse:
            return idx, valid, mask.astype(jnp.int8)
        scores = reference.index_scores(q_BTHD, k_BSD, w_BTH, mask)   # -inf off the selection
        return idx, valid, mask.astype(jnp.int8), jax.nn.logsumexp(scores, axis=-1)
    return kernel.indexer_topk(*args, topk=topk, with_mask=with_mask, with_lse=with_lse,
                               interpret=impl == PALLAS_INTERPRET)
