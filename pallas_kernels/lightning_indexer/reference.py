"""DSA lightning indexer and top-k selection in plain XLA (spec §4.3, §4.4).

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])        (fp32)

``w`` arrives with every positive scale already folded in (H_I^-0.5 * d_I^-0.5; ReLU(c x) = c ReLU(x)
for c > 0). Invisible keys score -inf; top-k keeps a static ``k = min(topk, S)`` and reports which
slots hold a visible key, because top-k over fewer than k visible keys also returns masked ones
(spec P9). Queries are processed in chunks so at most [B, T_chunk, H_I, S] scores exist at once.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.chunking import chunked_over_queries
from pallas_kernels.masking import visible_mask


def index_scores(q_BTHD, k_BSD, w_BTH, visible_BTS):
    """Masked indexer scores [B, T, S] in fp32 (-inf where not visible)."""
    dots_BTHS = jnp.einsum("bthd,bsd->bths", q_BTHD.astype(jnp.float32), k_BSD.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
    scores_BTS = jnp.einsum("bth,bths->bts", w_BTH.astype(jnp.float32), jax.nn.relu(dots_BTHS),
                            precision=jax.lax.Precision.HIGHEST)
    return jnp.where(visible_BTS, scores_BTS, -jnp.inf)


def indexer_topk(q_BTHD, k_BSD, w_BTH, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, topk, q_chunk=512):
    """Top-k key indices per query: (idx [B, T, k] int32, valid [B, T, k] bool), k = min(topk, S)."""
    k = min(topk, k_BSD.shape[1])

    def select(q, w, q_pos, q_seg):
        visible = visible_mask(q_pos, kv_pos_BS, q_seg, kv_seg_BS)
        scores = index_scores(q, k_BSD, w, visible)
        top_scores, idx = jax.lax.top_k(scores, k)
        return idx.astype(jnp.int32), top_scores > -jnp.inf

    return chunked_over_queries(select, q_chunk, q_BTHD.shape[1], q_BTHD, w_BTH, q_pos_BT, q_seg_BT)
