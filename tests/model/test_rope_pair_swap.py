"""rope_impl="pair_swap" (glm5_jax/model/rope.py: x * cos + swap_pairs(x) * sin over the full width): the same
values, bit for bit, as the sliced pair-interleaved rotation of the first channels with the rest passed
through, for plain RoPE and YaRN, bf16 and fp32 inputs, positions up to 200K."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.rope import apply_pair_swap_rope, apply_rope, pair_swap_tables, rope_cos_sin

YARN = dict(factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
            beta_slow=1)


@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("dim,width", [(64, 64), (64, 128)])
def test_pair_swap_equals_the_sliced_rotation(scaling, dtype, dim, width):
    positions = jnp.array([[0, 1, 5, 8191], [12, 4097, 65535, 200_000]], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 3, width), dtype)            # [B, T, heads, width]
    cos, sin = rope_cos_sin(positions, dim, 1e6, scaling, 163840)
    want = jnp.concatenate([apply_rope(x[..., :dim], cos[:, :, None], sin[:, :, None], interleaved=True),
                            x[..., dim:]], -1)
    cos2, sin2 = pair_swap_tables(positions, dim, width, 1e6, scaling, 163840)
    got = apply_pair_swap_rope(x, cos2[:, :, None], sin2[:, :, None])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got[:, 1:, :, :dim]), np.asarray(x[:, 1:, :, :dim]))   # it rotated
    if scaling is None:      # by hand, pair 1 at position 5: (x2 cos a - x3 sin a, x3 cos a + x2 sin a)
        a = 5 * 1e6 ** (-2 / dim)
        x2, x3 = (float(x[0, 2, 0, c]) for c in (2, 3))
        tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(got[0, 2, 0, 2:4], np.float64),
                                   [x2 * np.cos(a) - x3 * np.sin(a), x3 * np.cos(a) + x2 * np.sin(a)],
                                   rtol=tol, atol=tol)
