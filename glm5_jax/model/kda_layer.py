"""GLM-5.3-Flash's KDA linear-attention layer (Kimi Delta Attention; Kimi Linear report, arXiv:2510.26692;
transformers' ``Glm5NextTextLinearAttention``), read top to bottom:

    project   q, k, v = x W_q, x W_k, x W_v                       (flat heads x head width, head-major)
    conv      a depthwise causal conv (``linear_conv_kernel_dim`` taps, fp32) over [q; k; v], then SiLU
    gates     g = lower_bound * sigmoid(exp(A_log) (x F_a F_b + dt_bias))   (log-space decay per key channel)
              beta = sigmoid(x W_b)                                        (per head)
    core      o = KDA(L2(q), L2(k), v, g, beta)                   (pallas_kernels/kda)
    output    RMSNorm_head(o) * sigmoid(x G_a G_b), then W_o

Padding tokens (segment id 0) enter as zeros, as transformers masks them. The conv and the recurrent
state never cross a document boundary (segment ids).

With a decode cache ({"kda_conv": [B, W-1, 3HK] the last W-1 conv inputs, "kda_state": [B, H, K, V] fp32,
"kda_seen": [B] positions absorbed}, see `glm5_jax.model.kv_cache`) a token updates the state only if it
is a real token at a position not absorbed yet: generate's last prefill chunk may overlap the one before.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layers import einsum, logical_param, normal_init
from glm5_jax.parallel.axes import ACT_HEADS, BATCH, EMBED, KDA_QKV, KV
from glm5_jax.parallel.shard_map import logical_shard_map
from pallas_kernels.kda.ops import chunk_kda_flat, kda_decode_step


def _head_blocks(channels: int, heads: int):
    """The 0/1 [H * K, H] matrix of which head each flat channel belongs to (head h: channels h * K ...)."""
    return (jnp.arange(channels)[:, None] // (channels // heads) == jnp.arange(heads)[None, :]).astype(jnp.float32)


def head_sums(x_BTC, heads: int):
    """[B, T, H * K] -> [B, T, H] fp32: each head's channels summed. A product with `_head_blocks` rather than a sum
    over a [B, T, H, K] view: on TPU that view is tiled over (H, K) and the flat array over (T, H * K), so the view
    is a copy there and back; the product reads the channels as they lie (full fp32 precision)."""
    return jnp.einsum("btc,ch->bth", x_BTC.astype(jnp.float32), _head_blocks(x_BTC.shape[-1], heads),
                      precision=jax.lax.Precision.HIGHEST)


def per_head(x_BTH, channels: int):
    """[B, T, H] -> [B, T, channels]: each head's value on its channels (the transpose of `head_sums`)."""
    return jnp.einsum("bth,ch->btc", x_BTH, _head_blocks(channels, x_BTH.shape[-1]),
                      precision=jax.lax.Precision.HIGHEST)


def l2_normalize(x_BTC, heads: int, eps=1e-6):
    """Per head of flat channels: x / sqrt(sum x^2 + eps) in fp32 (transformers' / FLA's l2norm: eps inside the
    root)."""
    x = x_BTC.astype(jnp.float32)
    return x * per_head(jax.lax.rsqrt(head_sums(x * x, heads) + eps), x.shape[-1])


def causal_conv(x_BTC, w_CW, segment_ids_BT):
    """Depthwise causal conv, out[t] = sum_j w[:, W-1-j] x[t-j] over the taps in t's own segment (fp32)."""
    W = w_CW.shape[-1]
    x = x_BTC.astype(jnp.float32)
    out = jnp.zeros_like(x)
    for j in range(W):
        shifted = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, :x.shape[1]]
        same = jnp.pad(segment_ids_BT, ((0, 0), (j, 0)), constant_values=-1)[:, :x.shape[1]] == segment_ids_BT
        out = out + jnp.where(same[..., None], shifted, 0.0) * w_CW[:, W - 1 - j].astype(jnp.float32)
    return out


def cached_conv(x_BTC, w_CW, history_BWC, positions_BT, seen_B):
    """The causal conv of a chunk of contiguous positions continuing a cache: inputs at positions below
    ``seen`` come from the history (the last W-1 absorbed inputs), the rest from the chunk.
    -> (out [B, T, C] fp32, the new history for ``seen`` = the last absorbed position + 1)."""
    W = w_CW.shape[-1]
    ext = jnp.concatenate([history_BWC.astype(jnp.float32), x_BTC.astype(jnp.float32)], axis=1)  # [B, W-1+T, C]
    start = positions_BT[:, :1]

    def gather(q_BN):   # inputs at positions q -> [B, N, C] (zero before position 0 / the history)
        seen = seen_B[:, None]
        index = jnp.where(q_BN >= seen, W - 1 + q_BN - start, W - 1 + q_BN - seen)
        ok = (q_BN >= 0) & (index >= 0)
        rows = jnp.take_along_axis(ext, jnp.clip(index, 0, ext.shape[1] - 1)[..., None], axis=1)
        return jnp.where(ok[..., None], rows, 0.0)

    out = sum(gather(positions_BT - j) * w_CW[:, W - 1 - j].astype(jnp.float32) for j in range(W))
    return out, gather   # gather(positions) also gives the new history


def sharded_chunk_kda(q, k, v, g, beta, *, segment_ids_BT=None, initial_state_BHKV=None, impl, chunk_size=64):
    """`chunk_kda_flat` (q, k, g [B, T, H * K], v [B, T, H * V]) per (batch, head) shard under a multi-device mesh
    (its Pallas kernels cannot be partitioned automatically; rows and heads are independent recurrences), else
    `chunk_kda_flat` itself. Rows split over the batch axes, the flat channels over the heads axes (whole heads:
    head-major channels); the sequence is whole on every shard."""
    heads, state = (BATCH, None, ACT_HEADS), (BATCH, ACT_HEADS, None, None)
    extra, extra_axes = [], []
    if segment_ids_BT is not None:
        extra.append(segment_ids_BT), extra_axes.append((BATCH, None))
    if initial_state_BHKV is not None:
        extra.append(initial_state_BHKV), extra_axes.append(state)

    def core(q, k, v, g, beta, *rest):
        rest = list(rest)
        seg = rest.pop(0) if segment_ids_BT is not None else None
        init = rest.pop(0) if initial_state_BHKV is not None else None
        return chunk_kda_flat(q, k, v, g, beta, segment_ids_BT=seg, initial_state_BHKV=init, chunk_size=chunk_size,
                              impl=impl)

    return logical_shard_map(core, in_axes=(heads,) * 5 + tuple(extra_axes),
                             out_axes=(heads, state))(q, k, v, g, beta, *extra)


class KDAttention(nn.Module):
    """One KDA layer: (a [B, T, D], segment ids, [positions, cache]) -> (out [B, T, D], cache or None)."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, a_BTD, segment_ids_BT, positions_BT=None, cache=None):
        cfg = self.cfg
        init, pdt, dt = normal_init(cfg), cfg.jnp_param_dtype, cfg.jnp_dtype
        proj = dict(impl=cfg.runtime.projection_impl, grad_dtype=cfg.runtime.grad_reduce_dtype)
        d, H, K, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        f32 = jnp.float32
        B, T, _ = a_BTD.shape

        def proj_param(name, shape, axes):
            return logical_param(self, name, shape, axes, init, pdt)

        w_q, w_k, w_v = (proj_param(n, (d, H * K), (EMBED, KDA_QKV)) for n in ("q_proj", "k_proj", "v_proj"))
        # depthwise conv taps as transformers stores them ([channels, 1, taps]), kept fp32
        convs = [logical_param(self, n, (H * K, 1, W), (KDA_QKV, None, None), init, f32)
                 for n in ("q_conv", "k_conv", "v_conv")]
        w_fa, w_fb = proj_param("f_a_proj", (d, K), (EMBED, KV)), proj_param("f_b_proj", (K, H * K), (KV, KDA_QKV))
        dt_bias = logical_param(self, "dt_bias", (H * K,), (KDA_QKV,), nn.initializers.zeros, f32)
        a_log = logical_param(self, "A_log", (H,), (None,), nn.initializers.zeros, f32)
        w_b = proj_param("b_proj", (d, H), (EMBED, None))
        w_ga, w_gb = proj_param("g_a_proj", (d, K), (EMBED, KV)), proj_param("g_b_proj", (K, H * K), (KV, KDA_QKV))
        o_norm = logical_param(self, "o_norm", (K,), (KV,), nn.initializers.ones, pdt)
        w_o = proj_param("o_proj", (H * K, d), (KDA_QKV, EMBED))

        x = jnp.where((segment_ids_BT > 0)[..., None], a_BTD, 0).astype(dt)
        mixed = jnp.concatenate([einsum("btd,dc->btc", x, w, dt, **proj) for w in (w_q, w_k, w_v)], axis=-1)
        w_CW = jnp.concatenate([c[:, 0, :] for c in convs], axis=0)
        if cache is None:
            mixed_conv = causal_conv(mixed, w_CW, segment_ids_BT)
        else:
            active = (segment_ids_BT > 0) & (positions_BT >= cache["kda_seen"][:, None])
            mixed_conv, gather = cached_conv(mixed, w_CW, cache["kda_conv"], positions_BT, cache["kda_seen"])
            seen = jnp.maximum(cache["kda_seen"], jnp.max(jnp.where(active, positions_BT + 1, 0), axis=1))
            history = gather(seen[:, None] - (W - 1) + jnp.arange(W - 1))
        mixed_conv = jax.nn.silu(mixed_conv).astype(dt)
        # the heads' channels stay flat [B, T, H * K] (head h at h * K ...) through to the output projection:
        # the kernels' layout, with per-head sums as products (`head_sums`), no [B, T, H, K] view
        q, k, v = (mixed_conv[..., i * H * K:(i + 1) * H * K] for i in range(3))
        q, k = l2_normalize(q, H).astype(dt), l2_normalize(k, H).astype(dt)    # normed in fp32, read in dt

        f = einsum("btk,kc->btc", einsum("btd,dk->btk", x, w_fa, dt, **proj), w_fb, dt, f32, **proj)
        f = f + dt_bias.astype(f32)
        decay = jnp.repeat(jnp.exp(a_log.astype(f32)), K)                   # each head's rate on its channels
        if cfg.linear_lower_bound is not None:
            g = cfg.linear_lower_bound * jax.nn.sigmoid(decay * f)
        else:
            g = -decay * jax.nn.softplus(f)
        beta = jax.nn.sigmoid(einsum("btd,dh->bth", x, w_b, dt, **proj)).astype(f32)

        if cache is None:
            with jax.named_scope("attention_core"):   # the compile report's category of the recurrence
                o, _ = sharded_chunk_kda(q, k, v, g, beta, segment_ids_BT=segment_ids_BT,
                                         impl=cfg.runtime.kda_impl, chunk_size=cfg.runtime.kda_chunk)
        else:   # inactive tokens: no decay (g = 0), no write (beta = 0) leave the state exactly as it is
            g, beta = jnp.where(active[..., None], g, 0.0), jnp.where(active[..., None], beta, 0.0)
            if T == 1:
                o, state = kda_decode_step(*(x[:, 0].reshape(B, H, K) for x in (q, k, v, g)), beta[:, 0],
                                           cache["kda_state"])
                o = o.reshape(B, 1, H * K)
            else:
                o, state = sharded_chunk_kda(q, k, v, g, beta, initial_state_BHKV=cache["kda_state"],
                                             impl=cfg.runtime.kda_impl, chunk_size=cfg.runtime.kda_chunk)
            cache = dict(cache, kda_conv=history.astype(cache["kda_conv"].dtype), kda_state=state, kda_seen=seen)

        gate = einsum("btk,kc->btc", einsum("btd,dk->btk", x, w_ga, dt, **proj), w_gb, dt, f32, **proj)
        o = o.astype(f32)       # each head's RMSNorm (weight o_norm [K], shared by the heads), then the gate
        rms = per_head(jax.lax.rsqrt(head_sums(o * o, H) / K + cfg.rms_norm_eps), H * K)
        o = o * rms * jnp.tile(o_norm.astype(f32), H)
        o = (o * jax.nn.sigmoid(gate)).astype(dt)
        return einsum("btc,cd->btd", o, w_o, dt, **proj), cache
