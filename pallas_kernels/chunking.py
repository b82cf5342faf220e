"""Query chunking shared by the XLA references and the kernels' wrappers.

Attention-like ops over [B, T, ...] queries and [B, S, ...] keys hold [B, T_chunk, ..., S] intermediates
at a time by running ``fn`` over fixed-size query chunks under ``lax.map`` (a sequential loop, so only
one chunk's intermediates are live).
"""
import jax
import jax.numpy as jnp


def chunked_over_queries(fn, q_chunk, T, *arrays_BT):
    """Apply ``fn`` to query chunks of every [B, T, ...] array and concatenate its outputs along T.

    T is padded up to a multiple of ``q_chunk`` with zeros (so padded queries carry segment 0 and see
    nothing, where a segment array is among the inputs); the padding is cut from the outputs.
    """
    if T <= q_chunk:
        return fn(*arrays_BT)
    n_chunks = -(-T // q_chunk)
    pad = n_chunks * q_chunk - T

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], n_chunks, q_chunk, *x.shape[2:]), 1, 0)

    outs = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in arrays_BT))

    def merge(y):
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], n_chunks * q_chunk, *y.shape[3:])[:, :T]

    return jax.tree.map(merge, outs)
