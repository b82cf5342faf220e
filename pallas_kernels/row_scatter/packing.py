"""Row gradients as bf16 pairs packed in uint32 lanes: how a row of W fp32 values travels through HBM in
``packed_width(W)`` 32-bit lanes instead of W.

Why not a bf16 array: XLA:TPU tiles a bf16 [.., 1, W] array (2, 128)(2, 1), padding its single row to two,
so a bf16 row costs the HBM bytes of an fp32 one. A uint32 [.., 1, Wp] array keeps (1, 128) tiles (one row =
one DMA) and holds two bf16 values per lane: lane j carries column j in its high half and column j + Wp in
its low half. Both halves are bf16 roundings (to nearest even) of the fp32 values; unpacking is exact.

The same jnp code runs in XLA and inside Mosaic kernels (bitcasts, masks and shifts of 32-bit lanes).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.tpu_utils import LANES, round_up

_HIGH_HALF = 0xFFFF0000


def packed_width(W: int) -> int:
    """Lanes of a packed row of W values: half of W, rounded up to whole 128-lane tiles (640 -> 384)."""
    return round_up(-(-W // 2), LANES)


def _bf16_bits(x):
    """uint32 bit patterns of x rounded to bf16 (as fp32: the bf16 bits in the high half, zeros below)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16).astype(jnp.float32), jnp.uint32)


def pack_bf16_pairs(x_NW):
    """[..., W] float -> [..., packed_width(W)] uint32 (columns past W are zeros)."""
    W = x_NW.shape[-1]
    Wp = packed_width(W)
    x = x_NW.astype(jnp.float32)
    if 2 * Wp > W:
        x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], 2 * Wp - W), jnp.float32)], axis=-1)
    high, low = _bf16_bits(x[..., :Wp]), _bf16_bits(x[..., Wp:])
    return (high & jnp.uint32(_HIGH_HALF)) | (low >> 16)


def unpack_bf16_pairs(p_NWp, W: int):
    """Inverse of `pack_bf16_pairs`: [..., Wp] uint32 -> [..., W] fp32 (the bf16-rounded values)."""
    if p_NWp.dtype != jnp.uint32 or 2 * p_NWp.shape[-1] < W:
        raise ValueError(f"unpack_bf16_pairs: want uint32 [..., >= {-(-W // 2)}]; got {p_NWp.dtype} {p_NWp.shape}")
    high = jax.lax.bitcast_convert_type(p_NWp & jnp.uint32(_HIGH_HALF), jnp.float32)
    low = jax.lax.bitcast_convert_type(p_NWp << 16, jnp.float32)
    return jnp.concatenate([high, low], axis=-1)[..., :W]
