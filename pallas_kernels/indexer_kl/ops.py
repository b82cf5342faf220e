"""DSA indexer KL loss. The XLA implementation (reference.py) serves every stage: it is chunked over
queries, so memory is O(B * T_chunk * H * S) in the warm-up stage and O(B * T_chunk * k) in the sparse
stage. In the sparse stage every attention impl hands it the target it computed while attending (the
Pallas forward kernel's second sweep included), so the KL only scores the indexer at the selected slots;
without a target it recomputes one from the same selection. The sparse stage's KL with a given target
also runs on Pallas TPU kernels (sparse_kernel.py) under the ``pallas`` / ``pallas_interpret`` impls."""
from pallas_kernels.impls import PALLAS_IMPLS, PALLAS_INTERPRET
from pallas_kernels.indexer_kl import sparse_kernel, sparse_pallas
# the public entry points: the loss, and its per-token parts for callers holding a share of the queries
from pallas_kernels.indexer_kl.reference import indexer_kl_loss, indexer_kl_per_token, mean_over_tokens  # noqa: F401


def sparse_kl_per_token(index_q_BTHD, index_k_BSD, index_w_BTH, idx_BTK, valid_BTK, target_BTK, *, impl):
    """Sparse stage, given target: (kl [B, T] fp32, has_set [B, T] bool). ``reference`` / ``xla``: the XLA
    form (reference.py); ``pallas`` / ``pallas_interpret``: the kernels, which run on one device (call them
    per shard on a mesh), while the backward's resident key gradient fits VMEM (sparse_kernel.fits_vmem:
    up to 32K keys), else the XLA form."""
    if impl in PALLAS_IMPLS and sparse_kernel.fits_vmem(*index_k_BSD.shape[1:]):
        return sparse_pallas.sparse_kl_per_token(index_q_BTHD, index_k_BSD, index_w_BTH, idx_BTK, valid_BTK,
                                                 target_BTK, interpret=impl == PALLAS_INTERPRET)
    return indexer_kl_per_token(None, None, index_q_BTHD, index_k_BSD, index_w_BTH, None, None, None, None,
                                scale=None, stage="sparse", idx_BTK=idx_BTK, valid_BTK=valid_BTK,
                                target_BTK=target_BTK)
