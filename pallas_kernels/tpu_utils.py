"""Small helpers shared by the Pallas TPU kernels."""
import functools

import jax
import jax.numpy as jnp

# the minor dim of a TPU tile: arrays live in HBM as (8, 128) tiles of 32-bit words over their two minor dims
LANES = 128


def round_up(x, m):
    return -(-x // m) * m


def mxu_precision(*operands):
    """Explicit MXU precision: exact fp32 passes for fp32 operands, native for bf16. Explicit so a global
    ``jax_default_matmul_precision`` cannot ask Mosaic for an fp32 contraction of bf16 operands."""
    if all(x.dtype == jnp.float32 for x in operands):
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def smem_row_length(n: int) -> int:
    """Length of a rank-1 block of at least ``n`` elements that Mosaic accepts as one row of a longer flat
    array: a power of two of at least 128 words up to 1024, a multiple of 1024 beyond (its rank-1 block
    rule; e.g. a per-query index row of 2,560 slots is laid out in rows of 3,072)."""
    if n <= 1024:
        return max(LANES, 1 << (max(n, 1) - 1).bit_length())
    return round_up(n, 1024)


def pad_axis(x, axis, size, value=0):
    """x padded at the end of `axis` to `size` with `value` (block shapes must tile the array)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def check_blocks(kernel_name: str, T: int, S: int, block_q: int, block_k: int):
    """A blockwise attention-shaped kernel's grid: T queries and S keys each a multiple of its block, each block
    a multiple of LANES (ops.py pads to them)."""
    for name, n, blk in (("T", T, block_q), ("S", S, block_k)):
        if blk % LANES or n % blk:
            raise ValueError(f"{kernel_name}: {name}={n} is not a multiple of its block {blk} "
                             f"(a multiple of {LANES}); ops.py pads to it")


def mask_operand(kernel_name: str, allowed_BTS, shape):
    """A kernel's selection-mask operand: ``allowed_BTS`` (bool or int8, of ``shape`` = (B, T, S)) as int8."""
    if allowed_BTS.shape != tuple(shape):
        raise ValueError(f"{kernel_name}: allowed has shape {allowed_BTS.shape}, expected {tuple(shape)}")
    if allowed_BTS.dtype not in (jnp.bool_, jnp.int8):
        raise ValueError(f"{kernel_name}: allowed must be bool or int8, got {allowed_BTS.dtype}")
    return allowed_BTS.astype(jnp.int8)


def removable_when_unused(kernel_fn, *args, **static):
    """``kernel_fn(*args, **static)`` (a function issuing a ``pallas_call``) staged as its own jitted call.

    JAX never removes a ``pallas_call`` from a jaxpr, even when no output is used (its dead-code rule keeps
    it: a kernel may write through aliased inputs). Under a remat policy that saves a kernel's results by
    name, the rematerialised backward computation then still runs the kernel and drops what it computes.
    A jitted call is removed when none of its outputs is used, so the kernel goes with it; a forward kernel
    whose outputs a policy names is called through this.
    """
    return jax.jit(functools.partial(kernel_fn, **static))(*args)
