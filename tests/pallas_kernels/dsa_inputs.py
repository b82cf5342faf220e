"""Shared inputs for the DSA kernel tests: packed segments, padding and causal positions."""
import jax.numpy as jnp
import numpy as np


def assert_close(actual, expected, tol):
    """Elementwise |a - e| <= tol * max(1, max|e|); infinities must coincide."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.abs(expected[finite]).max(initial=0.0)))
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=0, atol=tol * scale)


def positions_and_segments(B, T, S):
    """Queries are the last T of S cached tokens. Batch 0: one document with 3 padded tail slots;
    batch 1 (if any): two packed documents (positions restart) and no padding."""
    q_pos, kv_pos, q_seg, kv_seg = [], [], [], []
    for b in range(B):
        seg = np.ones(S, np.int32)
        pos = np.arange(S, dtype=np.int32)
        if b % 2 == 0:
            seg[S - 3:] = 0
        else:
            cut = S // 3
            seg[cut:] = 2
            pos[cut:] = np.arange(S - cut)
        kv_seg.append(seg), kv_pos.append(pos)
        q_seg.append(seg[S - T:]), q_pos.append(pos[S - T:])
    return tuple(jnp.asarray(np.stack(x)) for x in (q_pos, kv_pos, q_seg, kv_seg))


def normal(rng, shape, dtype=jnp.float32):
    """Standard-normal test data from a numpy Generator (no per-shape jax.random compiles)."""
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def packed(B, T, boundaries, pad_from, shift=37):
    """(positions, segment ids) [B, T]: documents starting at ``boundaries`` (row b shifted by ``shift`` b),
    positions restarting per document, segment 0 from ``pad_from`` in the last row."""
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        starts = sorted({0, *((x + shift * b) % T for x in boundaries)})
        for n, (s, e) in enumerate(zip(starts, starts[1:] + [T])):
            seg[b, s:e], pos[b, s:e] = n + 1, np.arange(e - s)
    seg[-1, pad_from:] = 0
    return jnp.asarray(pos), jnp.asarray(seg)
