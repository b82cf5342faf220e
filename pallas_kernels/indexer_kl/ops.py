"""DSA indexer KL loss behind an ``impl`` switch (only the XLA reference exists: it is chunked over
queries and rematerialised, so memory is O(B * T_chunk * H * S); see reference.py)."""
from pallas_kernels.indexer_kl import reference

IMPLS = ("xla",)


def indexer_kl_loss(q_BTHC, kv_BSC, index_q_BTHD, index_k_BSD, index_w_BTH, q_pos_BT, kv_pos_BS,
                    q_seg_BT, kv_seg_BS, *, scale, stage, idx_BTK=None, valid_BTK=None, target_BTK=None,
                    impl="xla"):
    if impl == "xla":
        return reference.indexer_kl_loss(q_BTHC, kv_BSC, index_q_BTHD, index_k_BSD, index_w_BTH,
                                         q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale=scale,
                                         stage=stage, idx_BTK=idx_BTK, valid_BTK=valid_BTK,
                                         target_BTK=target_BTK)
    raise ValueError(f"indexer_kl_loss: unknown impl {impl!r}; choose one of {IMPLS}")
