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

# the packed operand format is the INT4 kernel's (pallas_kernels/int4_matmul/packing.py); re-exported so that
# every INT4 user finds the whole quantiser here
from pallas_kernels.int4_matmul.packing import (PER_WORD, check_shape, dequantize, dequantize_packed,  # noqa: F401
                                                expand_scales, pack_grouped, packed_shapes, unpack_grouped)

QMIN, QMAX = -8, 7
SCALE_DTYPES = ("bfloat16", "float32")


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


def quantize(w_KN, group_size: int, scale_dtype="bfloat16"):
    """(q int8 [..., K, N] in [-8, 7], scale [..., K/G, N]); the rounding every INT4 path uses."""
    check_shape(w_KN.shape, group_size, packed=False)
    scale = scales(w_KN, group_size, scale_dtype)
    s = expand_scales(scale, group_size)
    ratio = w_KN.astype(jnp.float32) / jnp.where(s == 0, 1.0, s)
    q = jnp.where(s == 0, 0.0, jnp.clip(jnp.round(ratio), QMIN, QMAX))
    return q.astype(jnp.int8), scale


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


def quantize_packed(w_KN, group_size: int, scale_dtype="bfloat16"):
    """Offline quantiser: (packed int32 [..., K/8, N], scale [..., K/G, N]) from fp weights."""
    q, scale = quantize(w_KN, group_size, scale_dtype)
    return pack_grouped(q, group_size), scale


def packed_bytes(shape, group_size: int, scale_dtype="bfloat16") -> int:
    """Bytes of a [..., K, N] weight stored as INT4 + per-group scales."""
    n = int(np.prod(shape))
    return n // 2 + n // group_size * jnp.dtype(scale_dtype).itemsize
