"""Sparse MLA attention behind an ``impl`` switch.

"xla" is the reference (differentiated by JAX); "xla_masked_dense" the same function as one matmul per
causal query block over a selection mask, with a hand-written VJP (masked_dense.py: faster on XLA:CPU
while T/2 is within a few times k; training rows only); "pallas" / "pallas_interpret" run the kernels of
kernel.py (TPU / Pallas interpreter) under a ``jax.custom_vjp``, since JAX cannot differentiate through
``pallas_call``. The backward kernel returns dq and per-slot row gradients; d(kv) is their XLA
scatter-add, done one query chunk at a time (memory O(B * T_chunk * k * C)).
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.chunking import merge_queries, split_queries
from pallas_kernels.sparse_mla import kernel, masked_dense, reference

IMPLS = ("xla", "xla_masked_dense", "pallas", "pallas_interpret")
BWD_Q_CHUNK = 64  # queries per backward kernel call; the row gradients of one chunk live in HBM


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, impl="xla", with_target=False):
    """(out, lse), or with ``with_target`` (XLA impls) also the indexer KL target (reference.sparse_mla)."""
    if impl in ("xla", "xla_masked_dense"):
        fn = reference.sparse_mla if impl == "xla" else masked_dense.sparse_mla
        return fn(q_BTHC, kv_BSC, idx_BTK, valid_BTK, scale=scale, v_dim=v_dim, with_target=with_target)
    if with_target:
        raise ValueError(f"sparse_mla: with_target is only computed by the XLA impls, not {impl!r}")
    if impl in ("pallas", "pallas_interpret"):
        return _sparse_mla_pallas(q_BTHC, kv_BSC, idx_BTK, valid_BTK, float(scale), v_dim,
                                  impl == "pallas_interpret")
    raise ValueError(f"sparse_mla: unknown impl {impl!r}; choose one of {IMPLS}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _sparse_mla_pallas(q, kv, idx, valid, scale, v_dim, interpret):
    return kernel.sparse_mla_fwd(q, kv, idx, valid, scale=scale, v_dim=v_dim, interpret=interpret)


def _fwd(q, kv, idx, valid, scale, v_dim, interpret):
    out, lse = kernel.sparse_mla_fwd(q, kv, idx, valid, scale=scale, v_dim=v_dim, interpret=interpret)
    return (out, lse), (q, kv, idx, valid, out, lse)


def _bwd(scale, v_dim, interpret, residuals, cotangents):
    q, kv, idx, valid, out, lse = residuals
    dout, dlse = cotangents
    # d lse / d s = p, so an lse cotangent enters exactly like -delta (see kernel.py docstring).
    # A query without valid slots has lse = -inf and no dependence on q/kv: ignore its lse cotangent.
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
    dq, dkv = sparse_mla_grads(q, kv, idx, valid, dout, lse, delta, scale=scale, v_dim=v_dim,
                               interpret=interpret)
    return dq.astype(q.dtype), dkv.astype(kv.dtype), None, None


_sparse_mla_pallas.defvjp(_fwd, _bwd)


def sparse_mla_grads(q_BTHC, kv_BSC, idx_BTK, valid_BTK, dout_BTHV, lse_BTH, delta_BTH, *,
                     scale, v_dim, interpret, q_chunk=BWD_Q_CHUNK):
    """(dq [B,T,H,C] fp32, dkv [B,S,C] fp32): backward kernel per query chunk + scatter-add of rows."""
    B, S, C = kv_BSC.shape
    split = functools.partial(split_queries, q_chunk=q_chunk)

    def step(dkv, chunk):
        q, idx, valid, dout, lse, delta = chunk
        dq, rows = kernel.sparse_mla_bwd_rows(q, kv_BSC, idx, valid, dout, lse, delta, scale=scale,
                                              v_dim=v_dim, interpret=interpret)
        return reference.scatter_add_rows(dkv, idx, rows, valid), dq

    chunks = (split(q_BTHC), split(idx_BTK), split(valid_BTK, value=False), split(dout_BTHV),
              split(lse_BTH, value=-jnp.inf), split(delta_BTH))
    dkv, dq = jax.lax.scan(step, jnp.zeros((B, S, C), jnp.float32), chunks)
    return merge_queries(dq, q_BTHC.shape[1]), dkv


