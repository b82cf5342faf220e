"""One chunk of Kimi Delta Attention for one (batch row, head), on 2-D fp32 values: the math the Pallas
kernels run per grid step (and the "xla" impl scans), written with MXU products, masked selects and
reductions only, so that Mosaic lowers it and ``jax.vjp`` of it lowers too (the backward kernel runs the
VJP of this function, chunk by chunk in reverse).

The equations are those of reference.chunk_kda (the WY form). Two things differ from the readable form,
both for the TPU:

* decay(i, j) = exp(G_i - G_j) [K] is never materialised as [C, C, K]. The chunk is cut into sub-chunks
  of SUB rows; for rows of sub-chunk a and keys before it the decay is split at r = G of a's first row,
  exp(G_i - r) * exp(r - G_j), both factors <= 1 since G falls (g <= 0), so one matmul per sub-chunk
  does them; pairs inside a diagonal SUB x SUB block take the exact per-pair form, column by column.
  (exp(G_i) * exp(-G_j) over the whole chunk would overflow fp32 for strong gates.)
* T = (I + A_kk)^-1 by block doubling (1x1, 2x2, ... C x C diagonal blocks inverted in turn, two matmuls a
  step) rather than a C-step forward substitution.

Shapes (per row and head): S [K, V], q/k/g [C, K], v [C, V], beta and segment ids as columns [C, 1].
"""
import jax
import jax.numpy as jnp

from pallas_kernels.kernel_math import column_to_row, mm, mm_nt, mm_tn, row_to_column

SUB = 16   # rows per sub-chunk: pairs inside a diagonal SUB x SUB block take the per-pair decay


def sub_chunk(C):
    """Rows per sub-chunk for a chunk of C (a multiple of 16) tokens: SUB, or C / 2 for a short chunk (so
    that a 16-token chunk, cheap to test, still has sub-chunks)."""
    return min(SUB, C // 2)


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x_NK, i):
    """Row ``i`` of x as [1, K] (a masked sublane reduction, no unaligned slice)."""
    return jnp.sum(jnp.where(_iota(x_NK.shape, 0) == i, x_NK, 0.0), axis=0, keepdims=True)


def decayed_scores(x_CK, y_CK, G_CK, *, strict, sub, loop=False):
    """A[i, j] = sum_k x[i, k] y[j, k] exp(G[i, k] - G[j, k]) for j < i (``strict``) or j <= i, else 0.
    ``loop``: the diagonal blocks' columns in a ``lax.fori_loop`` (the same ops; one body for XLA to
    compile) instead of unrolled (the Pallas kernels)."""
    C = x_CK.shape[0]
    token_C1 = _iota((C, 1), 0)
    col_SC = _iota((sub, C), 1)
    row_S1 = _iota((sub, 1), 0)
    blocks = []
    for a in range(C // sub):
        lo = a * sub
        xa, ya, Ga = x_CK[lo:lo + sub], y_CK[lo:lo + sub], G_CK[lo:lo + sub]
        block = jnp.zeros((sub, C), jnp.float32)
        if a:   # keys of earlier sub-chunks, the decay split at r = G of this sub-chunk's first row
            r = Ga[0:1]
            y_from_r = y_CK * jnp.exp(jnp.where(token_C1 < lo, r - G_CK, 0.0))
            block = jnp.where(col_SC < lo, mm_nt(xa * jnp.exp(Ga - r), y_from_r), 0.0)

        def diagonal_column(t, block, lo=lo, xa=xa, ya=ya, Ga=Ga):   # the diagonal block, one key column
            seen = row_S1 > t if strict else row_S1 >= t
            decay = jnp.exp(jnp.where(seen, Ga - _row(Ga, t), 0.0))
            column = jnp.sum(xa * _row(ya, t) * decay, axis=1, keepdims=True)
            return jnp.where((col_SC == lo + t) & seen, column, block)

        columns = sub - 1 if strict else sub
        if loop:
            block = jax.lax.fori_loop(0, columns, diagonal_column, block)
        else:
            for t in range(columns):
                block = diagonal_column(t, block)
        blocks.append(block)
    return jnp.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0]


def unit_lower_inverse(N_CC):
    """(I + N)^-1 for a strictly lower triangular N, by doubling blocks: with T the inverse of the diagonal
    s-blocks and L the s-blocks just below them inside each 2s-block, the 2s-blocks' inverse is
    (I + T L)^-1 T = T - T L T ((T L)^2 = 0). log2(C) steps of two matmuls."""
    C = N_CC.shape[0]
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    T = (row == col).astype(jnp.float32)
    s = 1
    while s < C:
        L = jnp.where((row // (2 * s) == col // (2 * s)) & (row // s != col // s), N_CC, 0.0)
        T = T - mm(mm(T, L), T)
        s *= 2
    return T


def chunk_step(S_KV, q_CK, k_CK, v_CV, g_CK, beta_C1, seg_C1, prev_C1, *, scale, loop=False):
    """(o [C, V], the state after the chunk [K, V]) from the state before it. ``seg``: the tokens' segment
    ids, ``prev``: the id of the document the carried state belongs to (the same in every row). ``loop``:
    see `decayed_scores`."""
    C = q_CK.shape[0]
    sub = sub_chunk(C)
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    G = mm((row >= col).astype(jnp.float32), g_CK)            # cumsum of g along the chunk
    same = seg_C1 == column_to_row(seg_C1)                    # [C, C]: same document
    sees_state = seg_C1 == prev_C1                            # [C, 1]: the carried state's document
    seg_last = _row(seg_C1, C - 1)                            # [1, 1]
    q = q_CK * scale
    a_qk = jnp.where(same, decayed_scores(q, k_CK, G, strict=False, sub=sub, loop=loop), 0.0)
    a_kk = jnp.where(same, beta_C1 * decayed_scores(k_CK, k_CK, G, strict=True, sub=sub, loop=loop), 0.0)
    T = unit_lower_inverse(a_kk)
    exp_G = jnp.exp(G)
    w = mm(T, jnp.where(sees_state, beta_C1 * k_CK * exp_G, 0.0))
    v_new = mm(T, beta_C1 * v_CV) - mm(w, S_KV)
    o = mm(jnp.where(sees_state, q * exp_G, 0.0), S_KV) + mm(a_qk, v_new)
    G_last = _row(G, C - 1)                                   # [1, K]
    k_to_end = jnp.where(seg_C1 == seg_last, k_CK * jnp.exp(G_last - G), 0.0)
    keep = seg_last == _row(prev_C1, C - 1)                   # no document starts inside the chunk
    S_next = jnp.where(keep, row_to_column(jnp.exp(G_last)) * S_KV, 0.0) + mm_tn(k_to_end, v_new)
    return o, S_next
