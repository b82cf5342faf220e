"""Helpers of the few-token decode MoE kernels (pallas_kernels/int4_decode_moe, pallas_kernels/bf16_decode_moe),
whose grid walks a chip's gathered assignments m = 0 .. M - 1.

``key_ref`` holds each assignment's expert id and ``offset_ref`` the chip's first expert; a step of another
chip's assignment computes nothing, and its weight BlockSpecs name blocks that a neighbouring local step reads,
so that the pipeline fetches nothing for it (`weights_expert`, `weights_tile`). The index maps unroll over the M
assignments (scalar code)."""
import jax
import jax.numpy as jnp


def local_expert(key_ref, offset_ref, j, n_local: int):
    """(assignment j's local expert, whether it is this chip's): its expert id minus the chip's first."""
    e = key_ref[j] - offset_ref[0]
    return e, (e >= 0) & (e < n_local)


def weights_expert(m, key_ref, offset_ref, n_local: int, M: int):
    """The local expert whose weights step m's BlockSpecs read: its own when local, else the last local one before
    m, else the first local one after, else 0."""
    first = jnp.int32(0)
    for j in reversed(range(M)):
        e, local = local_expert(key_ref, offset_ref, j, n_local)
        first = jnp.where(local, e, first)
    out = first
    for j in range(M):
        e, local = local_expert(key_ref, offset_ref, j, n_local)
        out = jnp.where((j <= m) & local, e, out)
    return out


def weights_tile(m, t, n_tiles: int, key_ref, offset_ref, n_local: int, M: int):
    """The width tile step (m, t) reads when the kernel also walks ``n_tiles`` tiles of each expert's width: t
    for a local assignment; for another chip's, the last tile when a local one came before m (the blocks it
    left in the pipeline), else the first (those the next local one fetches)."""
    if n_tiles == 1:
        return jnp.int32(0)
    _, here = local_expert(key_ref, offset_ref, m, n_local)
    before = jnp.bool_(False)
    for j in range(M):
        before = before | ((j < m) & local_expert(key_ref, offset_ref, j, n_local)[1])
    return jnp.where(here, t, jnp.where(before, n_tiles - 1, 0))


def token_rows(x_ref, rows: int, dtype):
    """The kernel's n token rows ([n, D] fp32 in VMEM) padded with zero rows to ``rows`` (one sublane tile), in
    ``dtype``: the products' left operand."""
    x = x_ref[...]
    n, D = x.shape
    if n < rows:
        x = jnp.concatenate([x, jnp.zeros((rows - n, D), x.dtype)], axis=0)
    return x.astype(dtype)


def add_gated_row(acc_ref, y_nD, gate, token):
    """acc[token] += gate * y[token] (fp32; the other rows as they are): an assignment's term in its token's sum."""
    row = jax.lax.broadcasted_iota(jnp.int32, y_nD.shape, 0) == token
    acc_ref[...] += jnp.where(row, gate * y_nD, 0.0)
