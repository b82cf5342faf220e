"""Rotary position embeddings (docs/architecture.md#rope): pair-interleaved or half-split, plain or YaRN frequencies.

Pair-interleaved rotation keeps the pair layout (x[2j], x[2j+1]) in place (DeepSeek's layout); HF
writes it de-interleaved, which permutes q and k identically and so leaves every logit unchanged
(docs/architecture.md#rope-output-layout-is-free-if-q-k-and-cache-agree).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_mscale(rope_scaling: dict | None) -> float:
    """Extra softmax-scale factor mscale^2 of DeepSeek's YaRN (1 for plain RoPE, i.e. GLM-5)."""
    if not rope_scaling or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2


def rope_inverse_frequencies(dim: int, theta: float, rope_scaling: dict | None, max_position_embeddings: int):
    """(inv_freq [dim/2] float32, cos/sin amplitude) for plain RoPE or YaRN (arXiv 2309.00071)."""
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    inv_freq = 1.0 / (theta ** exponents)
    if not rope_scaling:
        return inv_freq, 1.0
    original = rope_scaling["original_max_position_embeddings"]
    factor = rope_scaling.get("factor") or max_position_embeddings / original
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    amplitude = rope_scaling.get("attention_factor")
    if amplitude is None:
        amplitude = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def dim_of_rotations(n_rot):  # the rotary dim whose wavelength fits n_rot times into `original`
        return dim * math.log(original / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of_rotations(beta_fast), dim_of_rotations(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep_original = 1.0 - ramp   # high-frequency dims extrapolate, low-frequency dims interpolate
    inv_freq = (inv_freq / factor) * (1.0 - keep_original) + inv_freq * keep_original
    return inv_freq, float(amplitude)


def rope_cos_sin(positions, dim, theta, rope_scaling=None, max_position_embeddings=0):
    """cos, sin of shape positions.shape + [dim/2], float32."""
    inv_freq, amplitude = rope_inverse_frequencies(dim, theta, rope_scaling, max_position_embeddings)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles) * amplitude, jnp.sin(angles) * amplitude


def apply_rope(x, cos, sin, *, interleaved: bool):
    """Rotate the last axis of x (width dim) by cos/sin [..., dim/2] broadcast over x's middle axes.

    cos/sin have the batch/sequence axes of x followed by dim/2; extra axes of x between them (heads)
    are handled by the caller inserting singleton axes.
    """
    x32 = x.astype(jnp.float32)
    if interleaved:
        even, odd = x32[..., 0::2], x32[..., 1::2]
        rot_even, rot_odd = even * cos - odd * sin, odd * cos + even * sin
        out = jnp.stack([rot_even, rot_odd], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        first, second = x32[..., :half], x32[..., half:]
        out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def _exact_matmul(x, m):
    """x @ m for a 0/1 or +-1 matrix m with at most one non-zero per column: each output one exact product."""
    return jnp.einsum("...d,de->...e", x, jnp.asarray(m, x.dtype), preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)


def pair_swap_tables(positions, dim, width, theta, rope_scaling=None, max_position_embeddings=0):
    """The pair-interleaved rotation of the first ``dim`` of ``width`` channels as x * cos + swap_pairs(x) * sin
    (`apply_pair_swap_rope`) -> cos, sin of shape positions.shape + [width], float32: channels 2j and 2j + 1
    take `rope_cos_sin`'s pair j (the same values, spread by an exact 0/1 matmul: a traced repeat is a
    broadcast XLA moves back behind the cos), sin signed (-sin on even channels, +sin on odd), channels from
    ``dim`` on passed through (cos 1, sin 0)."""
    cos, sin = rope_cos_sin(positions, dim, theta, rope_scaling, max_position_embeddings)
    channel = np.arange(width)
    spread = (channel[None, :] // 2 == np.arange(dim // 2)[:, None]) & (channel < dim)[None, :]   # [dim/2, width]
    sign = np.where(channel % 2 == 0, -1.0, 1.0)
    return _exact_matmul(cos, spread) + (channel >= dim), _exact_matmul(sin, spread * sign)


def apply_pair_swap_rope(x, cos, sin):
    """x * cos + swap_pairs(x) * sin in fp32 -> x.dtype, with the tables of `pair_swap_tables` (broadcast over x's
    middle axes like `apply_rope`'s): `apply_rope`'s interleaved rotation term for term (even * cos - odd *
    sin, odd * cos + even * sin), swap_pairs (x[2j] <-> x[2j + 1]) an exact permutation matmul."""
    width = x.shape[-1]
    swapped = _exact_matmul(x, np.arange(width)[:, None] == (np.arange(width) ^ 1)[None, :])
    return (x.astype(jnp.float32) * cos + swapped * sin).astype(x.dtype)
