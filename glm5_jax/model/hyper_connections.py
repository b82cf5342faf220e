"""Manifold-constrained hyper-connections (mHC; Xie et al., 2026, "mHC: Manifold-Constrained
Hyper-Connections"), as GLM-5.3-Flash runs them (transformers' ``Glm5NextTextHyperConnection``).

The residual stream is ``hc_mult`` = N streams h [B, T, N, D]. Around each block (attention, FFN):

    x     = RMS(flatten(h)) @ fn                     -> pre [N], post [N], comb [N, N] (learned mixers)
    pre   = sigmoid(scale_0 x_pre + b_pre) + eps;    post = 2 sigmoid(scale_1 x_post + b_post)
    comb  = Sinkhorn(softmax(scale_2 x_comb + b_comb) + eps)   (rows and columns summing to 1)
    in    = sum_i pre_i h_i                          -> the block's input [B, T, D]
    h'_i  = post_i block(in) + sum_j comb_ji h_j     -> the next streams

The embedding enters as N copies and the model ends with the streams' mean (the "hyper head").
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layers import logical_param, normal_init
from glm5_jax.parallel.axes import ACT_EMBED, BATCH, HC_EMBED, SEQ

ACT_BTND = (BATCH, SEQ, None, ACT_EMBED)   # the streams' logical axes


def sinkhorn(comb_BTNN, iters: int, eps: float, unroll: bool = False):
    """Alternating column / row normalisation, columns first and last (transformers' order). ``unroll``: the
    iterations as straight-line ops (XLA fuses them into a few passes) instead of a loop (one body to compile,
    but each iteration its own ops at run time, forward and backward; `RuntimeConfig.hc_sinkhorn_unroll`)."""
    def rows_then_columns(_, comb):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        return comb / (comb.sum(-2, keepdims=True) + eps)

    comb = comb_BTNN / (comb_BTNN.sum(-2, keepdims=True) + eps)
    if not unroll:
        return jax.lax.fori_loop(0, iters - 1, rows_then_columns, comb)
    for i in range(iters - 1):
        comb = rows_then_columns(i, comb)
    return comb


class HyperConnection(nn.Module):
    """The mixers of one block: streams [B, T, N, D] -> (post [B, T, N], comb [B, T, N, N] fp32, the block's
    input [B, T, D])."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_BTND):
        cfg = self.cfg
        B, T, N, D = h_BTND.shape
        f32 = jnp.float32
        n_mix = (2 + N) * N
        fn = logical_param(self, "fn", (N * D, n_mix), (HC_EMBED, None), normal_init(cfg), cfg.jnp_param_dtype)
        base = logical_param(self, "base", (n_mix,), (None,), nn.initializers.zeros, f32)
        scale = logical_param(self, "scale", (3,), (None,), nn.initializers.ones, f32)
        # The projection of the RMS-normed flattened streams, RMS(flat(h)) @ fn, as rsqrt(mean h^2) * (h @ fn):
        # the per-token scale applied after the product, and the product contracted over (stream, d) without
        # flattening [B, T, N, D]. On TPU the streams are laid out with N in the tile's rows: a [B, T, N * D] view
        # is a relayout copy of the fp32 streams, and a normed fp32 copy feeding the product is another pass (and
        # each has its gradient's twin); this way the product reads the bf16 streams.
        h32 = h_BTND.astype(f32)
        rms_scale = jax.lax.rsqrt(jnp.mean(h32 * h32, axis=(2, 3)) + cfg.rms_norm_eps)
        x = rms_scale[..., None] * jnp.einsum("btnd,ndm->btm", h32, fn.astype(f32).reshape(N, D, n_mix),
                                              precision=jax.lax.Precision.HIGHEST)
        base, scale = base.astype(f32), scale.astype(f32)
        pre = jax.nn.sigmoid(x[..., :N] * scale[0] + base[:N]) + cfg.hc_eps
        post = 2.0 * jax.nn.sigmoid(x[..., N:2 * N] * scale[1] + base[N:2 * N])
        comb = jax.nn.softmax((x[..., 2 * N:] * scale[2] + base[2 * N:]).reshape(B, T, N, N), axis=-1) + cfg.hc_eps
        comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.runtime.hc_sinkhorn_unroll)
        block_in = jnp.sum(pre[..., None] * h32, axis=2).astype(h_BTND.dtype)
        return post, comb, block_in


def merge(post_BTN, comb_BTNN, block_out_BTD, residual_BTND):
    """The next streams: post_i * block output + sum_j comb_ji * residual_j -> [B, T, N, D]."""
    dt = residual_BTND.dtype
    mixed = jnp.einsum("btji,btjd->btid", comb_BTNN.astype(dt), residual_BTND,
                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (post_BTN.astype(dt)[..., None] * block_out_BTD[:, :, None, :].astype(dt) + mixed).astype(dt)


def expand(x_BTD, n: int):
    """The embedding as the first layer's N streams."""
    return jnp.broadcast_to(x_BTD[:, :, None, :], x_BTD.shape[:2] + (n,) + x_BTD.shape[2:])


def hyper_head(h_BTND):
    """The final collapse: the streams' mean (GLM-5.3-Flash's unweighted hyper head)."""
    return jnp.mean(h_BTND, axis=2)
