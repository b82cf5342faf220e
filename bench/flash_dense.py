"""Causal dense absorbed MLA in flash form: the dense baseline of bench/dsa.py.

Query block i attends to key blocks 0..i only (the blocks past the diagonal are fully masked and never
scored), with an online softmax, so no [T, S] logits or mask exist: the diagonal block uses a [block,
block] causal mask, the others none. The backward (FlashAttention-2, Dao 2023, Algorithm 2) recomputes
each visible block's probabilities from the saved log-sum-exp. Same math as
`pallas_kernels.sparse_mla.reference.dense_mla` with a causal mask on one unpacked sequence per row
(positions 0..T-1, one segment): q [B, T, H, C] against the shared latent kv [B, T, C], values the first
``v_dim`` channels of kv.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _block_logits(q_BQHC, k_BKC, scale, diagonal):
    """Scaled logits [B, Q, H, K] of one (query block, key block) pair; the diagonal pair causal."""
    s = jnp.einsum("bqhc,bkc->bqhk", q_BQHC, k_BKC, preferred_element_type=jnp.float32) * scale
    n = q_BQHC.shape[1]
    causal_QK = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    return jnp.where(diagonal & ~causal_QK[None, :, None, :], -jnp.inf, s)


def _blocks(x, i, block):
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)


def _forward(q, kv, scale, v_dim, block):
    B, T, H, _ = q.shape

    def query_block(i):
        q_i = _blocks(q, i, block)

        def key_block(j, carry):
            m, l, acc = carry
            kv_j = _blocks(kv, j, block)
            s = _block_logits(q_i, kv_j, scale, j == i)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            acc = acc * corr[..., None] + jnp.einsum("bqhk,bkv->bqhv", p.astype(kv.dtype), kv_j[..., :v_dim],
                                                     preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc

        init = (jnp.full((B, block, H), -jnp.inf, jnp.float32), jnp.zeros((B, block, H), jnp.float32),
                jnp.zeros((B, block, H, v_dim), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)     # key blocks past i: fully masked
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(T // block))     # [n, B, block, ...]
    merge = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, T, *x.shape[3:])  # noqa: E731
    return merge(out), merge(lse)


def _backward(q, kv, out, lse, dout, dlse, scale, v_dim, block):
    B, T, H, C = q.shape
    delta_BTH = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)

    def query_block(i, carry):
        dq, dkv = carry
        q_i, dout_i = _blocks(q, i, block), _blocks(dout, i, block).astype(jnp.float32)
        lse_i, delta_i, dlse_i = _blocks(lse, i, block), _blocks(delta_BTH, i, block), _blocks(dlse, i, block)

        def key_block(j, carry):
            dq_i, dkv = carry
            kv_j = _blocks(kv, j, block)
            p = jnp.exp(_block_logits(q_i, kv_j, scale, j == i) - lse_i[..., None])       # [B, Q, H, K]
            dp = jnp.einsum("bqhv,bkv->bqhk", dout_i, kv_j[..., :v_dim].astype(jnp.float32))
            ds = p * (dp - delta_i[..., None] + dlse_i[..., None]) * scale     # d lse / d logits = p
            dq_i = dq_i + jnp.einsum("bqhk,bkc->bqhc", ds, kv_j.astype(jnp.float32))
            dk = jnp.einsum("bqhk,bqhc->bkc", ds, q_i.astype(jnp.float32))
            dv = jnp.einsum("bqhk,bqhv->bkv", p, dout_i)
            dkv_j = _blocks(dkv, j, block) + dk.at[..., :v_dim].add(dv)
            return dq_i, jax.lax.dynamic_update_slice_in_dim(dkv, dkv_j, j * block, axis=1)

        dq_i, dkv = jax.lax.fori_loop(0, i + 1, key_block, (jnp.zeros((B, block, H, C), jnp.float32), dkv))
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1), dkv

    dq, dkv = jax.lax.fori_loop(0, T // block, query_block,
                                (jnp.zeros((B, T, H, C), jnp.float32), jnp.zeros((B, T, C), jnp.float32)))
    return dq.astype(q.dtype), dkv.astype(kv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def causal_dense_mla(q_BTHC, kv_BTC, scale: float, v_dim: int, block: int = 256):
    """(out [B, T, H, v_dim], lse [B, T, H] fp32) of causal dense absorbed attention; T % block == 0."""
    if q_BTHC.shape[1] % block:
        raise ValueError(f"causal_dense_mla: T={q_BTHC.shape[1]} is not a multiple of block={block}")
    return _forward(q_BTHC, kv_BTC, scale, v_dim, block)


def _fwd(q, kv, scale, v_dim, block):
    out, lse = causal_dense_mla(q, kv, scale, v_dim, block)
    return (out, lse), (q, kv, out, lse)


def _bwd(scale, v_dim, block, residuals, cotangents):
    q, kv, out, lse = residuals
    dout, dlse = cotangents
    return _backward(q, kv, out, lse, dout, dlse.astype(jnp.float32), scale, v_dim, block)


causal_dense_mla.defvjp(_fwd, _bwd)
