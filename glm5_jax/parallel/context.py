"""Context parallelism: one training sequence split over the mesh axes of the logical "seq" axis.

Layout (zig-zag). With n sequence shards, a row of T tokens is cut into 2n equal chunks and shard i holds
chunks i and 2n-1-i, in that order:

    natural   c0 c1 c2 c3 c4 c5 c6 c7            (n = 4)
    layout   [c0 c7][c1 c6][c2 c5][c3 c4]         shard i = [c_i, c_{2n-1-i}]

Why: the indexer scores every visible earlier key (causal, O(T^2 / 2) summed over queries) and the
dense / warm-up stages attend to every visible key; with contiguous shards the last shard would do
2n-1 times the causal work of the first. Paired chunks give every shard the same number of
(query, earlier key) pairs. The sparse core itself is balanced either way (k keys per query).

Everything that decides visibility reads positions and segment ids, never array indices
(pallas_kernels/masking.py), so the model runs on the permuted sequence unchanged. The code that does
depend on array order is handled here and in its callers:

* `glm5_jax.model.transformer.Transformer` permutes tokens, positions, segment ids and MTP's shifted next tokens
  into the layout (shifts happen in natural order first); its logits come out in layout order;
* `glm5_jax.train.losses` shifts targets in natural order, then permutes them the same way;
* attention (`glm5_jax.model.context_attention`) gathers the keys of all shards and puts them back in
  natural order, so a selected index is a natural token index and key windows stay contiguous.

The layout is active when the mesh in context splits "seq" into n > 1 shards and T is a multiple of
2n (`layout_shards`); otherwise nothing is permuted (and GSPMD partitions whatever it is given).
"""
from __future__ import annotations

import jax.numpy as jnp

from glm5_jax.parallel.axes import SEQ
from glm5_jax.parallel.shard_map import all_gather_logical, logical_axis_shards


def layout_shards(T: int) -> int:
    """n > 1 when a length-T sequence runs in the zig-zag layout over n shards, else 1."""
    n = logical_axis_shards(SEQ)
    return n if n > 1 and T % (2 * n) == 0 else 1


def to_layout(x_BT, n: int):
    """[B, T, ...] in natural order -> zig-zag layout over n shards (identity for n = 1)."""
    if n == 1:
        return x_BT
    B, T = x_BT.shape[:2]
    c = T // (2 * n)
    x = x_BT.reshape(B, 2, n, c, *x_BT.shape[2:])
    first, second = x[:, 0], jnp.flip(x[:, 1], axis=1)      # chunks i and 2n-1-i at shard i
    return jnp.stack([first, second], axis=2).reshape(x_BT.shape)


def from_layout(y_BT, n: int):
    """Inverse of `to_layout`."""
    if n == 1:
        return y_BT
    B, T = y_BT.shape[:2]
    c = T // (2 * n)
    y = y_BT.reshape(B, n, 2, c, *y_BT.shape[2:])
    return jnp.stack([y[:, :, 0], jnp.flip(y[:, :, 1], axis=1)], axis=1).reshape(y_BT.shape)


def gather_sequence(x_local_BT, n: int):
    """Inside a per-shard body (`shard_map.logical_shard_map`): every shard's rows of ``x``
    [B, T/n, ...] gathered and put in natural order -> [B, T, ...]. The backward pass returns each
    shard's share of the gradient to it (the all-gather's transpose is a reduce-scatter)."""
    return from_layout(all_gather_logical(x_local_BT, SEQ, axis=1), n)
