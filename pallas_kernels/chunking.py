"""Query chunking shared by the XLA references and the kernels' wrappers.

Attention-like ops over [B, T, ...] queries and [B, S, ...] keys hold [B, T_chunk, ..., S] intermediates
at a time by running ``fn`` over fixed-size query chunks under ``lax.map`` (a sequential loop, so only
one chunk's intermediates are live).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.tpu_utils import round_up


def chunked_over_queries(fn, q_chunk, T, *arrays_BT):
    """Apply ``fn`` to query chunks of every [B, T, ...] array and concatenate its outputs along T.

    T is padded up to a multiple of ``q_chunk`` with zeros (so padded queries carry segment 0 and see
    nothing, where a segment array is among the inputs); the padding is cut from the outputs.
    """
    if T <= q_chunk:
        return fn(*arrays_BT)
    outs = jax.lax.map(lambda xs: fn(*xs), tuple(split_queries(a, q_chunk) for a in arrays_BT))
    return jax.tree.map(lambda y: merge_queries(y, T), outs)


def split_queries(x_BT, q_chunk, value=0):
    """[B, T, ...] -> [n_chunks, B, q_chunk, ...], T padded with ``value`` up to a multiple of q_chunk."""
    B, T = x_BT.shape[:2]
    n_chunks = -(-T // q_chunk)
    x = jnp.pad(x_BT, [(0, 0), (0, n_chunks * q_chunk - T)] + [(0, 0)] * (x_BT.ndim - 2), constant_values=value)
    return jnp.moveaxis(x.reshape(B, n_chunks, q_chunk, *x.shape[2:]), 1, 0)


def merge_queries(y, T):
    """Inverse of `split_queries`: [n_chunks, B, q_chunk, ...] -> [B, T, ...] (padding cut)."""
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], y.shape[1] * y.shape[2], *y.shape[3:])[:, :T]


def equal_chunk(T, max_chunk, multiple=8):
    """Queries per chunk when T is split into the fewest equal chunks of at most ``max_chunk``, rounded up to a
    multiple of ``multiple`` (`split_queries` pads the last one): 3,168 queries at most 1,024 -> 4 x 792."""
    n_chunks = -(-T // max_chunk)
    return round_up(-(-T // n_chunks), multiple)
