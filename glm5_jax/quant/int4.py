"""The one INT4 weight quantiser: symmetric, per group of G input channels, one scale per group.

Shared by quantisation-aware training (`fake_quantize`), the offline quantiser (`quantize` + `pack`)
and INT4 inference (`unpack` + `dequantize`), so the weights QAT trains against are exactly the ones
served. Weights are ``[..., K, N]`` with K the input (contracted) axis; groups run along K:

    scale[g, n] = round_to_scale_dtype(max_{k in group g} |w[k, n]| / 7)
    q[k, n]     = clip(round_half_even(w[k, n] / scale[k // G, n]), -8, 7)      (0 where scale == 0)
    w_hat[k, n] = q[k, n] * scale[k // G, n]

With a bf16 scale the product is exact in fp32 (a 4-bit integer times an 8-bit mantissa), so every
implementation that dequantises in fp32 (XLA, the Pallas kernel, compressed-tensors in torch) gets the
same bits.

Packed layout (`pack`): eight 4-bit values per int32 word, stored as q + 8 (0..15). Rows are packed in
chunks of 8G: packed row ``c*G + r`` holds, in nibble j (bits 4j..4j+3), row ``c*8G + j*G + r`` of
the chunk — so nibble j of a chunk's G packed rows is one whole scale group, which is what lets the
Pallas kernel dequantise a [8G, N] tile with shifts and one scale row per group. Storage is K*N/2 bytes,
as two values per byte.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

QMIN, QMAX = -8, 7
PER_WORD = 8                 # 4-bit values per int32 word
SCALE_DTYPES = ("bfloat16", "float32")


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


def _grouped(x_KN, group_size):
    *lead, K, N = x_KN.shape
    return x_KN.reshape(*lead, K // group_size, group_size, N)


def scales(w_KN, group_size: int, scale_dtype="bfloat16"):
    """Per-group scale [..., K/G, N] = max |w| / 7 over each group, rounded to `scale_dtype`."""
    amax = jnp.max(jnp.abs(_grouped(w_KN.astype(jnp.float32), group_size)), axis=-2)
    return _round_to(amax / QMAX, jnp.dtype(scale_dtype))


def _round_to(x_f32, dtype):
    """x rounded to `dtype` (returned in `dtype`) by an explicit reduce_precision: XLA may drop an
    f32 -> bf16 -> f32 convert pair (excess precision), which would let different programs see
    different scales; reduce_precision is always kept."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x_f32, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(dtype)


def _expand(scale_gN, group_size):
    return jnp.repeat(scale_gN.astype(jnp.float32), group_size, axis=-2)


def quantize(w_KN, group_size: int, scale_dtype="bfloat16"):
    """(q int8 [..., K, N] in [-8, 7], scale [..., K/G, N]); the rounding every INT4 path uses."""
    check_shape(w_KN.shape, group_size, packed=False)
    scale = scales(w_KN, group_size, scale_dtype)
    s = _expand(scale, group_size)
    ratio = w_KN.astype(jnp.float32) / jnp.where(s == 0, 1.0, s)
    q = jnp.where(s == 0, 0.0, jnp.clip(jnp.round(ratio), QMIN, QMAX))
    return q.astype(jnp.int8), scale


def dequantize(q_KN, scale_gN, group_size: int, dtype=jnp.float32):
    """q * scale in fp32 (exact for bf16 scales), then cast to `dtype`."""
    return (q_KN.astype(jnp.float32) * _expand(scale_gN, group_size)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quantize(w_KN, group_size: int, scale_dtype: str = "bfloat16"):
    """`dequantize(*quantize(w))` in w's dtype, bit for bit; its gradient is the identity to w (the
    straight-through estimator), so QAT updates the fp master weights."""
    q, scale = quantize(w_KN, group_size, scale_dtype)
    return dequantize(q, scale, group_size, w_KN.dtype)


def _fake_quantize_fwd(w_KN, group_size, scale_dtype):
    return fake_quantize(w_KN, group_size, scale_dtype), None


def _fake_quantize_bwd(group_size, scale_dtype, _, g):
    return (g,)


fake_quantize.defvjp(_fake_quantize_fwd, _fake_quantize_bwd)


# ------------------------------------------------------------------ packing
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


def quantize_packed(w_KN, group_size: int, scale_dtype="bfloat16"):
    """Offline quantiser: (packed int32 [..., K/8, N], scale [..., K/G, N]) from fp weights."""
    q, scale = quantize(w_KN, group_size, scale_dtype)
    return pack_grouped(q, group_size), scale


def dequantize_packed(packed_kN, scale_gN, group_size: int, dtype=jnp.float32):
    return dequantize(unpack_grouped(packed_kN, group_size), scale_gN, group_size, dtype)


def packed_bytes(shape, group_size: int, scale_dtype="bfloat16") -> int:
    """Bytes of a [..., K, N] weight stored as INT4 + per-group scales."""
    n = int(np.prod(shape))
    return n // 2 + n // group_size * jnp.dtype(scale_dtype).itemsize
