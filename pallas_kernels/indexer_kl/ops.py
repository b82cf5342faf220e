"""DSA indexer KL loss. One XLA implementation serves every attention impl (no Pallas kernel): it is
chunked over queries, so memory is O(B * T_chunk * H * S) in the warm-up stage and O(B * T_chunk * k)
in the sparse stage (reference.py). With the Pallas attention, the sparse-stage target is computed
here from the same selection the kernel attended to."""
from pallas_kernels.indexer_kl.reference import indexer_kl_loss  # noqa: F401  (the public entry point)
