"""The packed INT4 operand format the grouped INT4 matmul kernel reads, and its dequantisation.

Eight 4-bit values per int32 word, stored as q + 8 (0..15). Rows are packed in chunks of 8G (G = the
quantisation group): packed row ``c*G + r`` holds, in nibble j (bits 4j..4j+3), row ``c*8G + j*G + r`` of
the chunk, so nibble j of a chunk's G packed rows is one whole scale group and the kernel dequantises a
[8G, N] tile with shifts and one scale row per group. The rounding that produces q lives with the rest of
the quantiser in `glm5_jax.quant.int4`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PER_WORD = 8                 # 4-bit values per int32 word


def check_shape(shape, group_size: int, what: str = "weight", packed: bool = True) -> None:
    """Errors naming the problem when a [..., K, N] weight cannot be grouped (and, with `packed`, packed)."""
    if len(shape) < 2:
        raise ValueError(f"INT4 {what}: needs [..., K, N], got shape {tuple(shape)}")
    K = shape[-2]
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"INT4 {what}: group_size={group_size} must be a positive multiple of 8")
    if not packed and K % group_size:
        raise ValueError(f"INT4 {what}: input width K={K} must be a multiple of group_size={group_size}")
    if packed and K % (PER_WORD * group_size):
        raise ValueError(f"INT4 {what}: input width K={K} must be a multiple of 8 * group_size = "
                         f"{PER_WORD * group_size} (shape {tuple(shape)})")


def expand_scales(scale_gN, group_size):
    return jnp.repeat(scale_gN.astype(jnp.float32), group_size, axis=-2)


def dequantize(q_KN, scale_gN, group_size: int, dtype=jnp.float32):
    """q * scale in fp32 (exact for bf16 scales), then cast to `dtype`."""
    return (q_KN.astype(jnp.float32) * expand_scales(scale_gN, group_size)).astype(dtype)


def pack_grouped(q_KN, group_size: int):
    """int8 [..., K, N] in [-8, 7] -> int32 [..., K/8, N]; nibble j of packed row c*G + r = row c*8G + j*G + r."""
    check_shape(q_KN.shape, group_size)
    *lead, K, N = q_KN.shape
    u = (q_KN.astype(jnp.int32) + 8).astype(jnp.uint32).reshape(*lead, K // (PER_WORD * group_size), PER_WORD,
                                                                   group_size, N)
    shifts = (4 * jnp.arange(PER_WORD, dtype=jnp.uint32)).reshape(PER_WORD, 1, 1)
    words = jnp.sum(u << shifts, axis=-3, dtype=jnp.uint32)          # disjoint bits: sum == or
    return jax.lax.bitcast_convert_type(words, jnp.int32).reshape(*lead, K // PER_WORD, N)


def unpack_grouped(packed_kN, group_size: int):
    """int32 [..., K/8, N] -> int8 [..., K, N] in [-8, 7] (inverse of `pack_grouped`)."""
    *lead, k, N = packed_kN.shape
    if k % group_size:
        raise ValueError(f"INT4 packed weight: {k} packed rows is not a multiple of group_size={group_size}")
    words = jnp.broadcast_to(packed_kN.reshape(*lead, k // group_size, 1, group_size, N),
                             (*lead, k // group_size, PER_WORD, group_size, N))
    shifts = (4 * jnp.arange(PER_WORD, dtype=jnp.int32)).reshape(PER_WORD, 1, 1)
    nibbles = jax.lax.shift_right_logical(words, jnp.broadcast_to(shifts, words.shape)) & 0xF
    return (nibbles - 8).astype(jnp.int8).reshape(*lead, k * PER_WORD, N)


def packed_shapes(shape, group_size: int):
    """(packed, scale) shapes of a [..., K, N] weight."""
    check_shape(shape, group_size)
    *lead, K, N = shape
    return (*lead, K // PER_WORD, N), (*lead, K // group_size, N)


def dequantize_packed(packed_kN, scale_gN, group_size: int, dtype=jnp.float32):
    return dequantize(unpack_grouped(packed_kN, group_size), scale_gN, group_size, dtype)
