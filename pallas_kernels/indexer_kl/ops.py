"""DSA indexer KL loss. One XLA implementation serves every attention impl (no Pallas kernel): it is
chunked over queries, so memory is O(B * T_chunk * H * S) in the warm-up stage and O(B * T_chunk * k)
in the sparse stage (reference.py). In the sparse stage every attention impl hands it the target it
computed while attending (the Pallas forward kernel's second sweep included), so the KL only scores the
indexer at the selected slots; without a target it recomputes one from the same selection."""
# the public entry points: the loss, and its per-token parts for callers holding a share of the queries
from pallas_kernels.indexer_kl.reference import indexer_kl_loss, indexer_kl_per_token, mean_over_tokens  # noqa: F401
