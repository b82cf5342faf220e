"""MLA in the MHA form for the dense attention core on TPU (the flash kernel, pallas_kernels/flash_attention).

Training attends in the MHA form: each head's key is [k_nope; k_rot] (d_nope + d_rope, 192 + 64 = 256 for
GLM-5; k_rot is shared by the heads) and its value v (256), both up-projected from the latent c by W_UK /
W_UV. Per (query, key, head) pair that costs 2 (d_nope + d_rope) + 2 d_v FLOPs (1024 for GLM-5) against
2 (d_c + d_rope) + 2 d_c (2176) in the absorbed form, which is cheaper only when keys are few per query
(DSA's top-k, decoding) because it never expands the latent per head.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layers import einsum
from pallas_kernels.flash_attention import ops as flash_ops


# the MHA query, named for remat policies (decoder.REMAT_POLICIES "moe_attention_saveable"): kept, the backward
# does not rerun the query's up-projection and rope
QUERY_NAME = "attention_mha_query"


def mha_query(q_nope_BTHn, q_rot_BTHr, dt):
    """[q_nope; q_rot] per head [B, T, H, d_nope + d_rope]."""
    return checkpoint_name(jnp.concatenate([q_nope_BTHn.astype(dt), q_rot_BTHr.astype(dt)], axis=-1), QUERY_NAME)


def mha_keys_values(cfg: ModelConfig, c_BSR, k_rot_BSr, w_kvb_RHK):
    """(k [B, S, H, d_nope + d_rope], v [B, S, H, d_v]) per head from the latent rows."""
    dt, dn = cfg.jnp_dtype, cfg.qk_nope_head_dim
    (B, S, R), H = c_BSR.shape, w_kvb_RHK.shape[1]
    # two plain matmuls against [R, H * width] weights: each result [B, S, H * width] is already the row
    # layout the flash kernel reads (one product against [R, H, d_nope + d_v] and two slices of it cost the
    # TPU compiler a relayout of each slice)
    gdt = cfg.runtime.grad_reduce_dtype
    k_nope, v = (einsum("bsr,rn->bsn", c_BSR, w.reshape(R, -1), dt, grad_dtype=gdt).reshape(B, S, H, -1)
                 for w in (w_kvb_RHK[..., :dn], w_kvb_RHK[..., dn:]))
    k_rot = jnp.broadcast_to(k_rot_BSr.astype(dt)[:, :, None, :], k_nope.shape[:3] + k_rot_BSr.shape[-1:])
    return jnp.concatenate([k_nope, k_rot], axis=-1), v


def flash_core(cfg: ModelConfig, q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS,
               block=None, allowed_BTS=None):
    """(out [B, T, H, d_v], lse [B, T, H] fp32): causal attention over the visible keys (and only the
    allowed ones: the sparse stage's top-k selection as a mask) by ``cfg.attention_impl`` (called per shard
    by the caller when the impl is a Pallas kernel); ``block``: the kernel's, by default the config's."""
    r = flash_ops.flash_attention(q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS,
                                  scale=cfg.softmax_scale, impl=cfg.runtime.attention_impl,
                                  block=block or cfg.runtime.attention_block, allowed_BTS=allowed_BTS)
    return r.out, r.lse


def chunk_block(chunk, block=flash_ops.BLOCK):
    """The kernel block for a context shard whose queries are two zig-zag chunks of ``chunk`` tokens: the
    largest power-of-two block (128 to ``block``) dividing the chunk, so no query block mixes the two
    chunks' positions (which would make it need the key blocks of both)."""
    while block > 128 and chunk % block:
        block //= 2
    return block
