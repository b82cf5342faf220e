"""Pallas TPU flash attention for training, in the MHA form: forward and backward kernels.

Why our own kernel and not JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention, which
does offer segment ids, a causal mask, the log-sum-exp as a residual, any head dim that is a multiple of 128
and interpret mode): splash decides causality from *array indices* through a static mask object built on the
host (``CausalMask`` with a fixed offset). Our model decides visibility from *positions* and segment ids
(pallas_kernels/masking.py): under context parallelism a shard's queries are two non-adjacent chunks of the
sequence (the zig-zag layout of glm5_jax/parallel/context.py) attending to the gathered keys of the whole
sequence, and which chunks a shard holds is only known inside ``shard_map`` (a traced ``axis_index``), so no
static mask serves every shard. This kernel takes positions and segment ids as arrays and masks with the
project's one rule: key s is visible from query t iff seg[s] == seg[t] != 0 and pos[s] <= pos[t]. It also
returns the fp32 log-sum-exp (the warm-up stage's indexer KL target is computed from it) and takes its
cotangent.

Operands: q [B, T, H, D], k [B, S, H, D], v [B, S, H, Dv] are reshaped to [B, T, H*D], so a block (bq, D) of
head h is column block h and every block obeys the (8, 128) tiling rule. (In HBM's tiled layout that reshape
is a copy unless XLA has the producer -- the projection and concatenation that build q, k, v -- write [B, T,
H*D] directly; a compile of the kernels alone on parameters pays it.) D and Dv must be multiples of 128
(GLM-5: D = 192 nope + 64 rope = 256, Dv = 256).

Selection mask (optional ``allowed`` [B, T, S] int8): key s is attended from query t only if it is also
allowed there -- DSA's top-k set, when the sparse stage runs dense blockwise at short context. The mask
arrives as one int8 (bq, bk) block per grid step, fetched like the key block (a key-major [bk, bq] block of
its transpose in the backward's dK/dV kernel); it is re-read once per head, T * S * H bytes per sweep.

Block skipping. Causal attention over packed documents leaves most (query block, key block) pairs without a
visible pair. `needed_blocks` (XLA, O(B * T/bq * S/bk)) marks a pair *needed* unless per-block summaries
(positions per segment-id part) prove nothing is visible -- a test that depends on no layout, exact while a
block spans at most two documents. Tables are scalar-prefetched into SMEM: a step whose pair is not needed
does no compute, and its operand block index repeats the last needed one, so the pipeline issues no DMA for
it either.

Forward (grid B, H, T/bq, S/bk; key blocks innermost): online softmax with fp32 m, l, acc in VMEM;
out = acc / l, lse = m + log l (a query that sees no key: out 0, lse -inf).
Backward, with delta = rowsum(dO * O) - dlse (an lse cotangent enters like -delta since d lse / d s = p),
in key-major form (grid B, H, S/bk, T/bq; query blocks innermost) so lse and delta are rows [1, bq]:
    s^T = k q^T,  p^T = exp(s^T - lse),  dV += p^T dO,  dp^T = v dO^T,  ds^T = p^T (dp^T - delta),
    dK += ds^T q * scale,  dQ[query block] += (ds^T)^T k * scale
dQ accumulates in VMEM over the whole sweep of a head (one fp32 [T, D] block, resident while the key and
query blocks run, so both those grid axes are sequential) while it fits `FUSED_DQ_BYTES`; longer query
sets get dQ from a separate kernel (grid B, H, T/bq, S/bk) that recomputes p and dp query-major.
Per (query, key, head) pair of a needed block: forward 2D + 2Dv FLOPs, fused backward 6D + 4Dv (the five
products; for D = Dv = 256 that is 10 x 256), split backward 8D + 6Dv.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kernel_math import column_to_row, mm, mm_nt, row_to_column
from pallas_kernels.tpu_utils import LANES, check_blocks, mask_operand

# The backward computes dQ inside the dK/dV kernel while one head's fp32 dQ [T, D] fits this many bytes of
# VMEM (T = 8192 at D = 256), else in a separate dQ kernel. The pipeline double-buffers the dQ block, so the
# fused kernel needs ~2 x 8 MiB + ~11 MiB of 512-blocks and temporaries: its scoped VMEM limit leaves room
# under the 64 MiB per TensorCore of v5p and v7 (jax._src.pallas.mosaic.tpu_info; v6e has 128 MiB).
FUSED_DQ_BYTES = 8 << 20
FUSED_DQ_VMEM_LIMIT = 40 << 20
_INT_MIN, _INT_MAX = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max


def _visible(q_pos, q_seg, kv_pos, kv_seg, allowed_ref=None):
    """The masking.visible_mask rule on broadcastable blocks (a column side and a row side), and the
    selection mask's block where there is one."""
    visible = (q_seg == kv_seg) & (q_seg != 0) & (kv_pos <= q_pos)
    return visible if allowed_ref is None else visible & (allowed_ref[...] != 0)


def _split_mask(refs, masked):
    """(allowed_ref or None, the remaining refs): the optional mask operand comes first in ``refs``."""
    return (refs[0], refs[1:]) if masked else (None, refs)


# ------------------------------------------------------------------------------------------ block tables
class BlockTables(NamedTuple):
    """Scalar-prefetch tables, flattened [B * n_outer * n_inner] int32 (SMEM holds 1-D arrays compactly)."""
    needed: jax.Array   # 1 where the (outer, inner) block pair may hold a visible pair
    fetch: jax.Array    # the inner block index to load at that step (repeats the last needed one)


def _block_parts(pos_BT, seg_BT, block, pos_reduce, pos_fill):
    """Each block's live tokens in three parts -- its lowest segment id, its highest, and every segment
    strictly between -- as (first segment, last segment, position bound, live) [B, n_blocks, 3]; the bound
    is ``pos_reduce`` (max for queries, min for keys) of the part's positions."""
    B, T = pos_BT.shape
    pos, seg = pos_BT.reshape(B, T // block, block), seg_BT.reshape(B, T // block, block)
    live = seg != 0
    lo = jnp.min(jnp.where(live, seg, _INT_MAX), axis=-1, keepdims=True)
    hi = jnp.max(jnp.where(live, seg, _INT_MIN), axis=-1, keepdims=True)
    members = (live & (seg == lo), live & (seg == hi), live & (seg > lo) & (seg < hi))
    first = jnp.concatenate([lo, hi, lo + 1], axis=-1)
    last = jnp.concatenate([lo, hi, hi - 1], axis=-1)
    bound = jnp.stack([pos_reduce(jnp.where(m, pos, pos_fill), axis=-1) for m in members], axis=-1)
    has = jnp.stack([jnp.any(m, axis=-1) for m in members], axis=-1)
    return first, last, bound, has


def needed_blocks(q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, block_q, block_k):
    """Bool [B, T/bq, S/bk]: False only where no key of the key block can be visible from any query of the
    query block. Each block is split into parts by segment id (`_block_parts`); a query part and a key part
    may hold a visible pair only if their segment ranges meet and the key part's smallest position is at
    most the query part's largest. Exact while a block spans at most two documents; conservative (never
    skips a visible pair) with more."""
    qf, ql, qb, qh = (x[:, :, None, :, None] for x in _block_parts(q_pos_BT, q_seg_BT, block_q, jnp.max, _INT_MIN))
    kf, kl, kb, kh = (x[:, None, :, None, :] for x in _block_parts(kv_pos_BS, kv_seg_BS, block_k, jnp.min, _INT_MAX))
    pairs = qh & kh & (kf <= ql) & (qf <= kl) & (kb <= qb)
    return jnp.any(pairs, axis=(3, 4))


def block_tables(needed_BOI) -> BlockTables:
    """Tables for a grid whose inner axis walks the last axis of ``needed`` [B, n_outer, n_inner]."""
    n_inner = needed_BOI.shape[-1]
    steps = jnp.arange(n_inner, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(needed_BOI, steps, -1), axis=2)
    first = jnp.argmax(needed_BOI, axis=-1).astype(jnp.int32)[..., None]  # 0 when none is needed
    fetch = jnp.where(last >= 0, last, first)
    return BlockTables(needed_BOI.astype(jnp.int32).reshape(-1), fetch.astype(jnp.int32).reshape(-1))


def _table_index(b, outer, inner, n_outer, n_inner):
    return (b * n_outer + outer) * n_inner + inner


# ------------------------------------------------------------------------------------------------ forward
def _fwd_kernel(needed_ref, fetch_ref, q_ref, k_ref, v_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref,
                *refs, scale, n_q, n_k, masked):
    # q_ref [bq, D]; k_ref [bk, D]; v_ref [bk, Dv]; q_pos/q_seg [bq, 1]; kv_pos/kv_seg [1, bk] int32;
    # (masked: allowed_ref [bq, bk] int8); out_ref [bq, Dv]; lse_ref [1, bq] fp32; m/l [bq, 1], acc [bq, Dv]
    # fp32 scratch.
    allowed_ref, (out_ref, lse_ref, m_scr, l_scr, acc_scr) = _split_mask(refs, masked)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(needed_ref[_table_index(b, i, j, n_q, n_k)] != 0)
    def _accumulate():
        visible = _visible(q_pos_ref[...], q_seg_ref[...], kv_pos_ref[...], kv_seg_ref[...], allowed_ref)
        s = jnp.where(visible, mm_nt(q_ref[...], k_ref[...]) * scale, -jnp.inf)
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # nothing visible yet: keep exp() finite
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[...] = alpha * acc_scr[...] + mm(p.astype(v_ref.dtype), v_ref[...])
        m_scr[...] = m_new

    @pl.when(j == n_k - 1)
    def _finalize():
        l = l_scr[...]
        has_keys = l > 0.0
        l_safe = jnp.where(has_keys, l, 1.0)
        out_ref[...] = jnp.where(has_keys, acc_scr[...] / l_safe, 0.0).astype(out_ref.dtype)
        lse_ref[...] = column_to_row(jnp.where(has_keys, m_scr[...] + jnp.log(l_safe), -jnp.inf))


# ----------------------------------------------------------------------------------------------- backward
def _dkv_kernel(needed_ref, fetch_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, q_pos_ref, q_seg_ref,
                kv_pos_ref, kv_seg_ref, *refs, scale, n_q, n_k, fused_dq, masked):
    # key-major: k_ref [bk, D], v_ref [bk, Dv], kv_pos/kv_seg [bk, 1]; q_ref [bq, D], dout_ref [bq, Dv],
    # lse/delta [1, bq] fp32, q_pos/q_seg [1, bq]; (masked: allowed_ref [bk, bq] int8, the transposed mask);
    # dk/dv [bk, D/Dv] (fp32 accumulators in scratch); with ``fused_dq`` also dq_ref [T, D] fp32, this head's
    # whole dQ, resident in VMEM over the grid steps.
    allowed_ref, refs = _split_mask(refs, masked)
    if fused_dq:
        dk_ref, dv_ref, dq_ref, dk_scr, dv_scr = refs
    else:
        (dk_ref, dv_ref, dk_scr, dv_scr), dq_ref = refs, None
    b, kb, qb = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(qb == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    if fused_dq:
        @pl.when((kb == 0) & (qb == 0))
        def _init_dq():
            dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    @pl.when(needed_ref[_table_index(b, kb, qb, n_k, n_q)] != 0)
    def _accumulate():
        visible = _visible(q_pos_ref[...], q_seg_ref[...], kv_pos_ref[...], kv_seg_ref[...], allowed_ref)  # [bk, bq]
        lse = lse_ref[...]
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)   # queries without keys: every p is masked to 0
        q, dout = q_ref[...], dout_ref[...]
        p_t = jnp.where(visible, jnp.exp(mm_nt(k_ref[...], q) * scale - lse), 0.0)
        dv_scr[...] += mm(p_t.astype(dout.dtype), dout)
        dp_t = mm_nt(v_ref[...], dout)
        ds_t = jnp.where(visible, p_t * (dp_t - delta_ref[...]), 0.0)
        dk_scr[...] += mm(ds_t.astype(q.dtype), q) * scale
        if fused_dq:   # a needed step loads its own query block qb
            rows = pl.ds(pl.multiple_of(qb * q.shape[0], q.shape[0]), q.shape[0])
            dq_ref[rows, :] += mm(ds_t.T.astype(k_ref.dtype), k_ref[...]) * scale

    @pl.when(qb == n_q - 1)
    def _finalize():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(needed_ref, fetch_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, q_pos_ref, q_seg_ref,
               kv_pos_ref, kv_seg_ref, *refs, scale, n_q, n_k, masked):
    # query-major like the forward; lse/delta arrive as rows [1, bq] and are turned into columns once.
    allowed_ref, (dq_ref, dq_scr, lse_scr, delta_scr) = _split_mask(refs, masked)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
        lse = row_to_column(lse_ref[...])
        lse_scr[...] = jnp.where(lse == -jnp.inf, 0.0, lse)
        delta_scr[...] = row_to_column(delta_ref[...])

    @pl.when(needed_ref[_table_index(b, i, j, n_q, n_k)] != 0)
    def _accumulate():
        visible = _visible(q_pos_ref[...], q_seg_ref[...], kv_pos_ref[...], kv_seg_ref[...], allowed_ref)  # [bq, bk]
        k = k_ref[...]
        p = jnp.where(visible, jnp.exp(mm_nt(q_ref[...], k) * scale - lse_scr[...]), 0.0)
        dp = mm_nt(dout_ref[...], v_ref[...])
        ds = jnp.where(visible, p * (dp - delta_scr[...]), 0.0)
        dq_scr[...] += mm(ds.astype(k.dtype), k) * scale

    @pl.when(j == n_k - 1)
    def _finalize():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


# ------------------------------------------------------------------------------------------------ wrappers
class _Shapes(NamedTuple):
    B: int
    T: int
    S: int
    H: int
    D: int
    Dv: int
    bq: int
    bk: int


def _shapes(q_BTHD, k_BSHD, v_BSHV, block_q, block_k) -> _Shapes:
    B, T, H, D = q_BTHD.shape
    S, Dv = k_BSHD.shape[1], v_BSHV.shape[3]
    if k_BSHD.shape != (B, S, H, D) or v_BSHV.shape[:3] != (B, S, H):
        raise ValueError(f"flash_attention: q {q_BTHD.shape}, k {k_BSHD.shape}, v {v_BSHV.shape} disagree")
    if D % LANES or Dv % LANES:
        raise ValueError(f"flash_attention: head dims {D}, {Dv} must be multiples of {LANES}")
    check_blocks("flash_attention", T, S, block_q, block_k)
    return _Shapes(B, T, S, H, D, Dv, block_q, block_k)


def _cost(d: _Shapes, itemsize, flops_per_pair, passes, mask_reads=0):
    """Declared cost (the compiled program's FLOP/byte accounting reads it): ``flops_per_pair`` for every
    (query, key, head) pair of the blocks a causal sequence needs -- n(n+1)/2 of n^2 block pairs with n key
    blocks, which a zig-zag context shard needs too on average (the tables decide at run time) -- and
    ``passes`` reads of q, k, v and the per-query rows (out or dO, fp32 lse and delta), plus ``mask_reads``
    sweeps of the int8 selection mask's needed blocks (one byte per pair: it is re-read per head)."""
    n_k = d.S // d.bk
    pairs = d.B * d.H * d.T * d.S * (n_k + 1) // (2 * n_k)
    operands = d.B * d.H * ((d.T + d.S) * d.D + d.S * d.Dv + d.T * d.Dv) * itemsize + d.B * d.H * d.T * 8
    return pl.CostEstimate(flops=pairs * flops_per_pair, transcendentals=pairs,
                           bytes_accessed=passes * operands + mask_reads * pairs)


def _params(innermost="arbitrary", outer="parallel", vmem_limit_bytes=None):
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", outer, innermost),
                                vmem_limit_bytes=vmem_limit_bytes)


def _columns(x_BT):
    return x_BT.astype(jnp.int32)[:, :, None]


def _rows(x_BT):
    return x_BT.astype(jnp.int32)[:, None, :]


class _Side:
    """One side (queries or keys) of a grid (B, H, n_outer, n_inner) whose scalar-prefetch tables walk the
    inner block axis: BlockSpecs of that side's operands. The outer side's blocks follow the grid's outer
    index; the inner side's are the tables' fetched index (the last needed one again on a skipped step)."""

    def __init__(self, size, outer, n_outer, n_inner):
        self.size, self.outer = size, outer
        self.n_outer, self.n_inner = n_outer, n_inner

    def index(self, b, o, i, fetch):
        """This side's block index at grid step (b, h, o, i), the same for every head h."""
        return o if self.outer else fetch[_table_index(b, o, i, self.n_outer, self.n_inner)]

    def heads(self, width):
        """Head h's (size, width) block of a [B, n, H * width] operand (q, k, v, dO and their gradients)."""
        return pl.BlockSpec((None, self.size, width),
                            lambda b, h, o, i, needed, fetch: (b, self.index(b, o, i, fetch), h))

    def per_head_row(self):
        """Head h's [1, size] block of a [B, H, 1, n] per-query row (lse, delta)."""
        return pl.BlockSpec((None, None, 1, self.size),
                            lambda b, h, o, i, needed, fetch: (b, h, 0, self.index(b, o, i, fetch)))

    def meta(self):
        """The block's positions or segment ids: a column [size, 1] on the outer side, a row [1, size] on the
        inner (so the two broadcast against each other)."""
        if self.outer:
            return pl.BlockSpec((None, self.size, 1), lambda b, h, o, i, *_: (b, o, 0))
        return pl.BlockSpec((None, 1, self.size), lambda b, h, o, i, needed, fetch: (b, 0, self.index(b, o, i, fetch)))

    def meta_operand(self, x_BN):
        """Positions or segment ids [B, n] in the form ``meta`` blocks."""
        return _columns(x_BN) if self.outer else _rows(x_BN)


class _Grid:
    """The grid of one of the three kernels: query blocks outer and key blocks inner (``query_major``: the
    forward and the dQ kernel) or the other way round (the dK/dV kernel)."""

    def __init__(self, d: _Shapes, query_major):
        n_q, n_k = d.T // d.bq, d.S // d.bk
        n_outer, n_inner = (n_q, n_k) if query_major else (n_k, n_q)
        self.shape = (d.B, d.H, n_outer, n_inner)
        self.q = _Side(d.bq, query_major, n_outer, n_inner)
        self.kv = _Side(d.bk, not query_major, n_outer, n_inner)
        self.d = d

    def in_specs(self, masked, backward):
        """The kernels' operands in order: q, k, v, (``backward``: dO, lse, delta), q_pos, q_seg, kv_pos,
        kv_seg, (``masked``: the selection mask's [outer, inner] block, of its transpose when key-major)."""
        d, q, kv = self.d, self.q, self.kv
        specs = [q.heads(d.D), kv.heads(d.D), kv.heads(d.Dv)]
        if backward:
            specs += [q.heads(d.Dv), q.per_head_row(), q.per_head_row()]
        specs += [q.meta(), q.meta(), kv.meta(), kv.meta()]
        if masked:
            outer, inner = (q, kv) if q.outer else (kv, q)
            specs.append(pl.BlockSpec((None, outer.size, inner.size),
                                      lambda b, h, o, i, needed, fetch: (b, o, inner.index(b, o, i, fetch))))
        return specs

    def meta_operands(self, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS):
        return (self.q.meta_operand(q_pos_BT), self.q.meta_operand(q_seg_BT), self.kv.meta_operand(kv_pos_BS),
                self.kv.meta_operand(kv_seg_BS))

    def spec(self, masked, backward, out_specs, scratch_shapes):
        return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=self.shape,
                                            in_specs=self.in_specs(masked, backward), out_specs=out_specs,
                                            scratch_shapes=scratch_shapes)


def flash_fwd(q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, *, scale, block_q=512,
              block_k=512, allowed_BTS=None, interpret=False):
    """(out [B, T, H, Dv] in q's dtype, lse [B, H, T] fp32). T and S must be multiples of the blocks.
    ``allowed_BTS``: the optional selection mask (bool or int8 [B, T, S])."""
    d = _shapes(q_BTHD, k_BSHD, v_BSHV, block_q, block_k)
    masked = allowed_BTS is not None
    B, T, S, H, D, Dv, bq, bk = d
    n_q, n_k = T // bq, S // bk
    tables = block_tables(needed_blocks(q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, bq, bk))
    grid = _Grid(d, query_major=True)
    mask_arg = [mask_operand("flash_attention", allowed_BTS, (B, T, S))] if masked else []
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, n_q=n_q, n_k=n_k, masked=masked),
        grid_spec=grid.spec(masked, backward=False, out_specs=[grid.q.heads(Dv), grid.q.per_head_row()],
                            scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                                            pltpu.VMEM((bq, Dv), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((B, T, H * Dv), q_BTHD.dtype),
                   jax.ShapeDtypeStruct((B, H, 1, T), jnp.float32)],
        compiler_params=_params(),
        interpret=interpret,
        name="flash_attention_fwd_masked" if masked else "flash_attention_fwd",
        cost_estimate=_cost(d, q_BTHD.dtype.itemsize, 2 * (D + Dv), passes=1, mask_reads=int(masked)),
    )(tables.needed, tables.fetch, q_BTHD.reshape(B, T, H * D), k_BSHD.reshape(B, S, H * D),
      v_BSHV.reshape(B, S, H * Dv), *grid.meta_operands(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS), *mask_arg)
    return out.reshape(B, T, H, Dv), lse[:, :, 0, :]


def flash_bwd(q_BTHD, k_BSHD, v_BSHV, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, dout_BTHV, lse_BHT, delta_BHT, *,
              scale, block_q=512, block_k=512, allowed_BTS=None, interpret=False):
    """(dq, dk, dv) in the dtypes of q, k, v. ``delta = rowsum(dO * O) - dlse`` [B, H, T] fp32;
    ``allowed_BTS``: the forward's selection mask, if it had one."""
    d = _shapes(q_BTHD, k_BSHD, v_BSHV, block_q, block_k)
    masked = allowed_BTS is not None
    allowed = mask_operand("flash_attention", allowed_BTS, (d.B, d.T, d.S)) if masked else None
    B, T, S, H, D, Dv, bq, bk = d
    n_q, n_k = T // bq, S // bk
    needed = needed_blocks(q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, bq, bk)
    q, k, v = q_BTHD.reshape(B, T, H * D), k_BSHD.reshape(B, S, H * D), v_BSHV.reshape(B, S, H * Dv)
    dout = dout_BTHV.astype(q.dtype).reshape(B, T, H * Dv)
    lse, delta = (x.astype(jnp.float32)[:, :, None, :] for x in (lse_BHT, delta_BHT))
    itemsize = q.dtype.itemsize

    # ---- dK, dV: key blocks outer, query blocks inner (fetched through the transposed tables)
    grid = _Grid(d, query_major=False)
    fused_dq = T * D * 4 <= FUSED_DQ_BYTES
    out_specs = [grid.kv.heads(D), grid.kv.heads(Dv)]
    out_shape = [jax.ShapeDtypeStruct((B, S, H * D), k.dtype), jax.ShapeDtypeStruct((B, S, H * Dv), v.dtype)]
    if fused_dq:   # one head's dQ accumulates in VMEM over all its (key block, query block) steps
        out_specs.append(pl.BlockSpec((None, T, D), lambda b, h, kb, qb, *_: (b, 0, h)))
        out_shape.append(jax.ShapeDtypeStruct((B, T, H * D), jnp.float32))
    grads = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, n_q=n_q, n_k=n_k, fused_dq=fused_dq, masked=masked),
        grid_spec=grid.spec(masked, backward=True, out_specs=out_specs,
                            scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, Dv), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=(_params("arbitrary", outer="arbitrary", vmem_limit_bytes=FUSED_DQ_VMEM_LIMIT) if fused_dq
                         else _params()),
        interpret=interpret,
        name="flash_attention_bwd_fused" if fused_dq else "flash_attention_bwd_dkv",
        cost_estimate=_cost(d, itemsize, 6 * D + 4 * Dv if fused_dq else 4 * D + 4 * Dv, passes=2,
                            mask_reads=int(masked)),
    )(*block_tables(jnp.swapaxes(needed, 1, 2)), q, k, v, dout, lse, delta,
      *grid.meta_operands(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS), *([jnp.swapaxes(allowed, 1, 2)] if masked else []))
    if fused_dq:
        dk, dv, dq = grads
        return (dq.astype(q.dtype).reshape(B, T, H, D), dk.reshape(B, S, H, D), dv.reshape(B, S, H, Dv))
    dk, dv = grads

    # ---- dQ: query blocks outer, key blocks inner (like the forward)
    grid = _Grid(d, query_major=True)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, n_q=n_q, n_k=n_k, masked=masked),
        grid_spec=grid.spec(masked, backward=True, out_specs=grid.q.heads(D),
                            scratch_shapes=[pltpu.VMEM((bq, D), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                                            pltpu.VMEM((bq, 1), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((B, T, H * D), q.dtype),
        compiler_params=_params(),
        interpret=interpret,
        name="flash_attention_bwd_dq",
        cost_estimate=_cost(d, itemsize, 4 * D + 2 * Dv, passes=2, mask_reads=int(masked)),
    )(*block_tables(needed), q, k, v, dout, lse, delta, *grid.meta_operands(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS),
      *([allowed] if masked else []))
    return dq.reshape(B, T, H, D), dk.reshape(B, S, H, D), dv.reshape(B, S, H, Dv)
