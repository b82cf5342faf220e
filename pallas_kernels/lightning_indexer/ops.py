"""Lightning indexer + top-k behind an ``impl`` switch ("xla" is the reference; kernels plug in here)."""
from pallas_kernels.lightning_indexer import reference

IMPLS = ("xla",)


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk, impl="xla"):
    if impl == "xla":
        return reference.indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, topk=topk)
    raise ValueError(f"indexer_topk: unknown impl {impl!r}; choose one of {IMPLS}")
