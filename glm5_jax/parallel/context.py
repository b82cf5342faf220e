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

* `lay_out` puts a natural-order `Batch` into the layout once: its tokens, positions and segment ids, and
  the tokens k = 1, 2, .. steps ahead with their validity (shifted in natural order first, then permuted).
  They are MTP depth k's input tokens and the targets of the logits (k = 1) and of MTP depth k - 1. The
  model (`glm5_jax.model.transformer.Transformer.forward_laid_out`; ``__call__`` lays out its arguments
  with it) and the losses (`glm5_jax.train.losses`) read these arrays; the logits come out in layout order;
* attention (`glm5_jax.model.context_attention`) gathers the keys of all shards and puts the indexer's
  keys, positions and segment ids back in natural order, so a selected index is a natural token index and
  key windows stay contiguous; the sparse core's latent rows stay in the gathered (layout) order and each
  selected index is mapped to its row there (`layout_index`), so the widest per-token rows, and their
  gradients, are never reordered.

The layout is active when the mesh in context splits "seq" into n > 1 shards and T is a multiple of
2n (`layout_shards`); otherwise nothing is permuted (and GSPMD partitions whatever it is given).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from glm5_jax.data.batch import Batch
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


@struct.dataclass
class LaidOutBatch:
    """A `Batch` in the sequence layout of the mesh in context, with its shifted tokens (`lay_out`)."""
    tokens: jax.Array                       # int32 [B, T]
    segment_ids: jax.Array                  # int32 [B, T]
    positions: jax.Array                    # int32 [B, T]
    ahead_tokens: tuple[jax.Array, ...]     # [k - 1]: int32 [B, T], the tokens k steps ahead (`Batch.ahead`)
    ahead_valid: tuple[jax.Array, ...]      # [k - 1]: bool [B, T], where those are valid targets


def lay_out(batch: Batch, ahead: int) -> LaidOutBatch:
    """`batch` (natural order) and its tokens 1 .. `ahead` steps ahead, all in the layout: the one place
    where the training inputs and targets are permuted. Shifts run in natural order, before the permutation."""
    n = layout_shards(batch.tokens.shape[1])
    shifted = [batch.ahead(k) for k in range(1, ahead + 1)]
    return LaidOutBatch(tokens=to_layout(batch.tokens, n), segment_ids=to_layout(batch.segment_ids, n),
                        positions=to_layout(batch.positions, n),
                        ahead_tokens=tuple(to_layout(t, n) for t, _ in shifted),
                        ahead_valid=tuple(to_layout(v, n) for _, v in shifted))


def layout_index(t, n: int, T: int):
    """The position in the zig-zag layout over n shards of natural token index ``t`` (int array) of a
    length-T row: `to_layout(x, n)[..., layout_index(t), ...] == x[..., t, ...]` (identity for n = 1)."""
    if n == 1:
        return t
    c = T // (2 * n)
    chunk, r = t // c, t % c
    second = chunk >= n
    shard = jnp.where(second, 2 * n - 1 - chunk, chunk)
    return (shard * 2 * c + second.astype(t.dtype) * c + r).astype(t.dtype)


def gather_sequence(x_local_BT, n: int):
    """Inside a per-shard body (`shard_map.logical_shard_map`): every shard's rows of ``x``
    [B, T/n, ...] gathered and put in natural order -> [B, T, ...]. The backward pass returns each
    shard's share of the gradient to it (the all-gather's transpose is a reduce-scatter)."""
    return from_layout(all_gather_logical(x_local_BT, SEQ, axis=1), n)
