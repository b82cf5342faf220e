"""selection_mask on a mesh whose batch does not divide its shards equals the mask built by hand.

The layout is the one a sharded decode step gives it: the selection (top-k indices and their validity,
computed after the split as score > -inf) split over ``data``, the mask's rows over ``tensor`` (it meets
the heads there). Written as a scatter with the batch as an iota index column, XLA's SPMD partitioner pads
the 3 rows to 4 with index (0, 0, 0) and validity 0 > -inf, and the pad row marks slot 0 of row 0.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_kernels.masking import selection_mask

S = 6
IDX = np.array([[[1, 2, 4]], [[2, 3, 5]], [[3, 0, 1]]], np.int32)   # [B=3, T=1, k=3]; row 2 holds slot 0
SCORES = np.array([[[0.5, 0.2, 0.1]], [[0.3, 0.2, -np.inf]], [[0.9, 0.4, -np.inf]]], np.float32)


def by_hand():
    mask = np.zeros((3, 1, S), bool)
    for b, t, j in np.ndindex(IDX.shape):
        mask[b, t, IDX[b, t, j]] |= SCORES[b, t, j] > -np.inf
    return mask


def test_selection_mask_with_an_indivisible_batch_split_two_ways():
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])

    @jax.jit
    def sharded(idx, scores):
        idx, scores = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data"))) for x in (idx, scores))
        mask = selection_mask(idx, scores > -jnp.inf, S)
        return jax.lax.with_sharding_constraint(mask, NamedSharding(mesh, P("tensor")))

    want = by_hand()
    assert not want[0, 0, 0] and want[2, 0, 0]          # slot 0 belongs to row 2's selection only
    np.testing.assert_array_equal(np.asarray(sharded(IDX, SCORES)), want)
    np.testing.assert_array_equal(np.asarray(selection_mask(IDX, SCORES > -np.inf, S)), want)
