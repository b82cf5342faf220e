"""Slot-level operations on a batched decoder cache ({segment: {layer_i: {name: [repeats, B, S, X]}}}).

A serving slot is one batch row of the cache; these read, write and copy whole rows.
"""
from __future__ import annotations

import jax

BATCH_AXIS = 1   # decoder cache leaves are stacked over a segment's repeats first


def read_row(cache, slot):
    """The slot's row as a batch-of-one cache."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=BATCH_AXIS), cache)


def write_row(cache, row, slot):
    """`cache` with slot `slot` replaced by the batch-of-one cache `row`."""
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=BATCH_AXIS), cache, row)


def copy_row(cache, src, dst):
    """`cache` with row `dst` a copy of row `src` (every layer's latent and indexer-key slots)."""
    return write_row(cache, read_row(cache, src), dst)
