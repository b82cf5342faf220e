"""Lightning indexer + top-k behind an ``impl`` switch.

"xla" is the reference; "pallas" runs the TPU score kernel (kernel.py) and "pallas_interpret" the same
kernel through the Pallas interpreter (CPU tests). Indices are not differentiable; the indexer learns
from the KL loss (pallas_kernels/indexer_kl), so no custom_vjp is needed here.
"""
from pallas_kernels.lightning_indexer import kernel, reference

IMPLS = ("xla", "pallas", "pallas_interpret")


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk, impl="xla"):
    args = (q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS)
    if impl == "xla":
        return reference.indexer_topk(*args, topk=topk)
    if impl in ("pallas", "pallas_interpret"):
        return kernel.indexer_topk(*args, topk=topk, interpret=impl == "pallas_interpret")
    raise ValueError(f"indexer_topk: unknown impl {impl!r}; choose one of {IMPLS}")
