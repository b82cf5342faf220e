"""DSA lightning indexer and top-k selection in plain XLA.

Background: docs/architecture.md#lightning-indexer, #top-k-selection-and-validity.

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])        (fp32)

``w`` arrives with every positive scale already folded in (H_I^-0.5 * d_I^-0.5; ReLU(c x) = c ReLU(x)
for c > 0). Invisible keys score -inf; top-k keeps a static ``k = min(topk, S)`` and reports which
slots hold a visible key, because top-k over fewer than k visible keys also returns masked ones
(docs/architecture.md#top-k-over-fewer-than-k-visible-keys). Queries are processed in chunks so at most [B, T_chunk,
S] scores exist at once, and each
chunk scores only the window of keys it can see (pallas_kernels/key_window.py: about half the keys of
a causal sequence; the selection is the same as over all S keys).

Selection stays ``lax.top_k``: on XLA:CPU it is a per-row heap (partial sort) whose cost is mostly the
~k ln(S/k) insertions, not S, and an exact threshold select (32-step bisection on the scores' int32
image, then cumsum compaction) was no faster at S = 2K and 2-8x slower at S = 8K..32K (k = 512).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.chunking import chunked_over_queries
from pallas_kernels.key_window import over_key_window, visible_key_range, window_widths
from pallas_kernels.masking import visible_mask


def index_scores(q_BTHD, k_BSD, w_BTH, visible_BTS):
    """Masked indexer scores [B, T, S] in fp32 (-inf where not visible)."""
    q_BTHD, k_BSD, w_BTH = (x.astype(jnp.float32) for x in (q_BTHD, k_BSD, w_BTH))
    scores_BTS = jnp.zeros(visible_BTS.shape, jnp.float32)
    for h in range(q_BTHD.shape[2]):  # one [T, D] @ [D, S] product per head: no [T, H, S] intermediate
        dots_BTS = jnp.einsum("btd,bsd->bts", q_BTHD[:, :, h], k_BSD, precision=jax.lax.Precision.HIGHEST)
        scores_BTS = scores_BTS + w_BTH[:, :, h, None] * jax.nn.relu(dots_BTS)
    return jnp.where(visible_BTS, scores_BTS, -jnp.inf)


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk, q_chunk=256,
                 key_windows=16, min_window=1024):
    """Top-k key indices per query: (idx [B, T, k] int32, valid [B, T, k] bool), k = min(topk, S).

    ``key_windows``: how many static key-window widths (steps of S / key_windows, none narrower than
    max(k, min_window)) a query chunk may pick from; 1 scores all S keys.
    """
    S = k_BSD.shape[1]
    k = min(topk, S)
    widths = window_widths(S, max(k, min_window), key_windows)

    def select(q, w, q_pos, q_seg):
        def on_window(start_B, k_BWD, kv_pos_BW, kv_seg_BW):
            visible = visible_mask(q_pos, kv_pos_BW, q_seg, kv_seg_BW)
            top_scores, idx = jax.lax.top_k(index_scores(q, k_BWD, w, visible), k)
            return idx.astype(jnp.int32) + start_B[:, None, None], top_scores > -jnp.inf

        lo, hi = visible_key_range(q_pos, q_seg, kv_pos_BS, kv_seg_BS)
        return over_key_window(on_window, widths, lo, hi, k_BSD, kv_pos_BS, kv_seg_BS)

    return chunked_over_queries(select, q_chunk, q_BTHD.shape[1], q_BTHD, w_BTH, q_pos_BT, q_seg_BT)
