"""Work on only the keys a query chunk can see: a window of static width over the key axis.

A chunk of queries sees no key outside ``[lo, hi)`` (``visible_key_range``: a superset bound from the
chunk's largest position and its segment ids, exact for any positions/segments, packed documents and
padding included). ``over_key_window`` slices that window out of [B, S, ...] key arrays at the narrowest
of a few static widths that holds it (``lax.switch`` over one compiled branch per width) and runs ``fn``
on it. Keys outside the window are invisible to every query of the chunk, so anything that treats
invisible keys as -inf (scores, top-k) gets the same answer on the window, with indices offset by the
window's start. For a causal sequence chunk c of n sees about c/n of the keys, so summed over chunks
this does about half the work of scoring every key.
"""
import functools

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


def visible_key_range(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS):
    """(lo [B], hi [B]) int32: every key visible (masking.visible_mask) from any query lies in [lo, hi).

    Nothing visible gives lo = S, hi = 0.
    """
    live = q_seg_BT != 0
    q_max_pos = jnp.max(jnp.where(live, q_pos_BT, -_BIG), axis=1, keepdims=True)
    seg_lo = jnp.min(jnp.where(live, q_seg_BT, _BIG), axis=1, keepdims=True)
    seg_hi = jnp.max(jnp.where(live, q_seg_BT, -_BIG), axis=1, keepdims=True)
    maybe_visible = ((kv_seg_BS != 0) & (kv_seg_BS >= seg_lo) & (kv_seg_BS <= seg_hi)
                     & (kv_pos_BS <= q_max_pos))
    S = kv_pos_BS.shape[1]
    s = jnp.arange(S, dtype=jnp.int32)
    lo = jnp.min(jnp.where(maybe_visible, s, S), axis=1)
    hi = jnp.max(jnp.where(maybe_visible, s + 1, 0), axis=1)
    return lo, hi


def window_widths(S, min_width, n_widths):
    """Static window widths: n_widths steps of S / n_widths, none under min_width, the last = S."""
    return tuple(sorted({min(S, max(min_width, -(-S * i // n_widths))) for i in range(1, n_widths + 1)}))


def over_key_window(fn, widths, lo_B, hi_B, *arrays_BS):
    """``fn(start_B, *windows)`` with each [B, S, ...] array cut to [B, W, ...] from start_B per batch row.

    W is the narrowest of ``widths`` (ascending, the last = S) that holds every row's [lo, hi);
    start = min(lo, S - W), so [start, start + W) covers [lo, hi) and stays in range.
    """
    S = arrays_BS[0].shape[1]

    def run(W, lo_B):
        start_B = jnp.clip(lo_B, 0, S - W).astype(jnp.int32)
        cut = jax.vmap(lambda x, s0: jax.lax.dynamic_slice_in_dim(x, s0, W, axis=0))
        return fn(start_B, *(cut(x, start_B) for x in arrays_BS))

    if len(widths) == 1:
        return run(widths[0], lo_B)
    need = jnp.max(hi_B - lo_B)
    branch = jnp.minimum(jnp.searchsorted(jnp.asarray(widths, jnp.int32), need), len(widths) - 1)
    return jax.lax.switch(branch, [functools.partial(run, W) for W in widths], lo_B)
