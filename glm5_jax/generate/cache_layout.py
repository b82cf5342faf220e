"""The decode cache's layout where the layers read it in place (``RuntimeConfig.decode_cache_read="pallas"``):
row-major, per shard, inside every program that decodes from it."""
from __future__ import annotations

import jax
from jax.experimental.layout import Layout, with_layout_constraint

from glm5_jax.model.kv_cache import leaf_axes
from glm5_jax.parallel.shard_map import logical_shard_map


def row_major(x) -> Layout:
    """The row-major layout of ``x`` (tiles left to the compiler): the layout a Pallas kernel takes."""
    return Layout(major_to_minor=tuple(range(x.ndim)))


def pin_cache_layout(cfg, cache):
    """``cache`` held row-major inside the decode loop where the layers read it in place (``decode_cache_read=
    "pallas"``), per shard (a layout constraint on the sharded array alone gathers it whole); as it is
    otherwise."""
    if cfg.runtime.decode_cache_read != "pallas":
        return cache
    flat, tree = jax.tree.flatten(cache)
    axes = tuple(leaf_axes(x) for x in flat)
    pin = logical_shard_map(lambda *xs: tuple(with_layout_constraint(x, row_major(x)) for x in xs), axes, axes)
    return tree.unflatten(pin(*flat))
