"""The XLA form of the row scatter-add: d[b, target[b, n]] += rows[b, n] for every update whose target is a
row of d (targets out of range, e.g. the sentinel S of a masked update, are dropped).

Shapes: d [B, S, W] fp32, rows [B, N, W], target [B, N] int32 (a row may have more dims than W: d [B, S,
...], rows [B, N, ...]). Letters: B batch rows, S rows of d (keys), N updates, W row width.
"""
import jax


def row_scatter_add(d_BSW, rows_BNW, target_BN):
    return jax.vmap(lambda d, t, r: d.at[t].add(r.astype(d.dtype), mode="drop"))(d_BSW, target_BN, rows_BNW)
