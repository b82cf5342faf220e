"""Causal (position-masked) multi-head attention in plain XLA: the oracle of the flash kernels.

MHA form: every head has its own key and value rows (for MLA, up-projected from the latent row; the rope
part of the key is shared by the heads). Visibility is the project's one rule (pallas_kernels/masking.py):
same non-zero segment and key position <= query position. Softmax in fp32; a query that sees no key
returns zeros and lse = -inf.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.chunking import chunked_over_queries
from pallas_kernels.masking import visible_mask


def attend(q_BTHD, k_BSHD, v_BSHV, visible_BTS, *, scale):
    """(out [B,T,H,Dv] in q's dtype, lse [B,T,H] fp32) over the ``visible`` keys."""
    logits = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible_BTS[:, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("bhts,bshv->bthv", probs.astype(v_BSHV.dtype), v_BSHV, preferred_element_type=jnp.float32)
    return out.astype(q_BTHD.dtype), jnp.swapaxes(lse, 1, 2)


def flash_attention(q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, scale, q_chunk=None,
                    allowed_BTS=None):
    """(out, lse) of every query over its visible keys (and, given ``allowed_BTS`` [B, T, S] bool, only the
    allowed ones). ``q_chunk``: queries per chunk (None: all at once); chunks are rematerialised in the
    backward pass, so at most [B, H, q_chunk, S] logits are live."""
    def chunk(q, q_pos, q_seg, *allowed):
        visible = visible_mask(q_pos, kv_pos_BS, q_seg, kv_seg_BS)
        return attend(q, k_BSHD, v_BSHV, visible & allowed[0] if allowed else visible, scale=scale)

    extra = () if allowed_BTS is None else (allowed_BTS.astype(bool),)
    if q_chunk is None:
        return chunk(q_BTHD, q_pos_BT, q_seg_BT, *extra)
    return chunked_over_queries(jax.checkpoint(chunk), q_chunk, q_BTHD.shape[1], q_BTHD, q_pos_BT, q_seg_BT,
                                *extra)
