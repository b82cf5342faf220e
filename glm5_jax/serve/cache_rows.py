"""Slot-level operations on a batched decoder cache ({segment: {layer_i: {name: [repeats, B, S, X]}}}).

A serving slot is one batch row of the cache; these read, write, copy and restart whole rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.kv_cache import KDA_LEAF_AXES

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


def restart_recurrent(row, restart):
    """`row` with its recurrent state (a KDA layer's conv inputs, state and positions absorbed) zeroed where
    the traced bool `restart` holds: a prompt prefilled from position 0 continues no earlier sequence. Latent
    and indexer-key slots stay as they are (a query at position p reads only the slots <= p written for it)."""
    def leaf(path, x):
        if getattr(path[-1], "key", None) not in KDA_LEAF_AXES:
            return x
        return jnp.where(restart, jnp.zeros_like(x), x)
    return jax.tree_util.tree_map_with_path(leaf, row)
