"""Pallas TPU kernels for the warm-up stage's indexer KL, loss and gradients in one forward.

Per query token t over its key set -- the visible keys s (same non-zero segment, key position <= query
position), and with a selection mask ``allowed`` only those of them with allowed[t, s] != 0:

    p[t, s] = (1/H) sum_h exp(scale * q_h[t] . k_h[s] - lse_h[t])     (the attention's head-mean target)
    I[t, s] = sum_{h<HI} w[t, h] ReLU(iq_h[t] . ik[s])                (the indexer's scores)
    KL_t    = sum_s p log p - sum_s p I + lseI_t,   lseI_t = log sum_s exp I[t, s]

(sum_s p = 1: lse is the attention's log-sum-exp of the same logits over the same key set, so the target
needs no normalisation pass). With the mask this is the sparse stage's KL (DSA's selected keys, both
distributions renormalised over them) computed densely: at short context the top-k selection covers most of
the visible keys and the sparse attention runs as masked dense blocks, whose lse is over that set.
The gradient with respect to the scores is dKL_t / dI[t, s] = exp(I - lseI) - p, and through the ReLU
(dI / d(iq_h . ik) = w_h [iq_h . ik > 0]):

    g_h[t, s] = dI[t, s] w[t, h] [iq_h[t] . ik[s] > 0]
    d iq_h[t] = sum_s g_h[t, s] ik[s],   d ik[s] = sum_{t, h} g_h[t, s] iq_h[t],
    d w[t, h] = sum_s dI[t, s] ReLU(iq_h[t] . ik[s])

Kernels 1 and 2 have the grid (B, groups, T/bq/groups, S/bk) -- query block i * groups + g, key blocks
innermost; every block is computed key-major ([bk, bq], so per-query quantities are lane rows [1, bq]
like the flash kernel's lse):
  1. `_lse_kernel`: online log-sum-exp of I over the key set -> lseI [B, T] (only the indexer's
     HI x DI product per pair). Not run when the caller hands lseI: the sparse stage's top-k has the
     selected keys' scores at hand (lightning_indexer ``with_lse``).
  2. `_kl_kernel`: recomputes all H heads' logits of the pair of blocks in VMEM (the H x D product), the
     target p, I (its per-head dots kept in a VMEM scratch for the gradient), the per-token KL and, with
     ``with_grads``, d iq [bq, HI*DI] and d w [HI, bq] accumulated over the key blocks and d ik [S, DI]
     resident in VMEM (accumulated over the query blocks of a group, written once; two groups of
     interleaved query blocks, summed afterwards, leave a parallel grid axis for a chip's two
     TensorCores at batch 1).
  3. `_dk_kernel`, only when that d ik would not fit VMEM (`RESIDENT_DK_BYTES`): grid (B, S/bk, T/bq),
     keys outer, recomputing p and I per pair (a second H x D product) to accumulate d ik per key block.
No intermediate of size [T, S] or [T, H, S] ever reaches HBM (the mask is an input).
The query block of q and iq stays in VMEM while the key blocks stream (its index does not change along
the innermost axis); key blocks are re-read once per query block. Block skipping is the flash kernel's:
`needed_blocks` / `block_tables` scalar-prefetched, a step whose pair holds no visible pair neither
computes nor fetches (its key block index repeats the last needed one). The mask only removes pairs, so
the same tables serve it: its int8 [bq, bk] block is indexed by the step's query and fetched key block
(fetched only at needed steps) and transposed in VMEM to the key-major [bk, bq] -- one 32-bit transpose
per step instead of an XLA transpose of the whole [B, T, S] mask through HBM.

Per (query, key) pair of a needed block: 2 H D FLOPs for the logits, 2 HI DI for I in each kernel, and
with gradients 4 HI DI more (d iq, d ik; the dots are kept in VMEM, not recomputed); H + 2 transcendentals
(the heads' exponentials, log p, exp(I - lseI)). The mask changes neither: masked pairs are computed and
dropped like invisible ones.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention.kernel import (_columns, _rows, _split_mask, _table_index, _visible, block_tables,
                                                   needed_blocks)
from pallas_kernels.kernel_math import mm, mm_nt
from pallas_kernels.tpu_utils import LANES, check_blocks, mask_operand

# d ik of one batch row stays resident in VMEM (fp32 [S, DI], double-buffered by the pipeline) while the
# query blocks run up to this size (S = 8K at DI = 128); longer key sets get d ik from a separate kernel
# that recomputes the target (a Mosaic compile at S = 32K with d ik resident runs out of v5p's 64 MiB)
RESIDENT_DK_BYTES = 4 << 20
VMEM_LIMIT = 56 << 20   # under the 64 MiB per TensorCore of v5p / v7 (v6e: 128 MiB)


def query_groups(n_q, resident):
    """Groups of interleaved query blocks of the KL kernel: 2 with a resident d ik (each group accumulates
    its own in order, the groups run in parallel), else 1 (every query block is independent)."""
    return 2 if resident and n_q % 2 == 0 else 1


class Shapes(NamedTuple):
    B: int
    T: int
    S: int
    H: int
    D: int
    HI: int
    DI: int
    bq: int
    bk: int


def check_shapes(q_BTHD, k_BSHD, lse_BHT, iq_BTHD, ik_BSD, iw_BHT, block_q, block_k) -> Shapes:
    B, T, H, D = q_BTHD.shape
    S = k_BSHD.shape[1]
    HI, DI = iq_BTHD.shape[2:]
    expected = {"k": (k_BSHD.shape, (B, S, H, D)), "lse": (lse_BHT.shape, (B, H, T)),
                "iq": (iq_BTHD.shape, (B, T, HI, DI)), "ik": (ik_BSD.shape, (B, S, DI)),
                "iw": (iw_BHT.shape, (B, HI, T))}
    for name, (got, want) in expected.items():
        if got != want:
            raise ValueError(f"warmup_indexer_kl: {name} has shape {got}, expected {want}")
    if D % LANES or DI % LANES:
        raise ValueError(f"warmup_indexer_kl: head dims D={D}, DI={DI} must be multiples of {LANES}")
    check_blocks("warmup_indexer_kl", T, S, block_q, block_k)
    return Shapes(B, T, S, H, D, HI, DI, block_q, block_k)


# ----------------------------------------------------------------------------------------------- kernels
def _key_set(q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, allowed_ref):
    """Bool [bk, bq]: the pair is visible and (with a mask block [bq, bk] int8) allowed."""
    keys = _visible(q_pos_ref[...], q_seg_ref[...], kv_pos_ref[...], kv_seg_ref[...])
    if allowed_ref is None:
        return keys
    return keys & (allowed_ref[...].astype(jnp.int32).T != 0)   # int8 [bq, bk] widened to 32 bits, transposed


def _index_dots_t(ik, iq_ref, n_heads, dim):
    """Per indexer head h: ik iq_h^T [bk, bq] fp32."""
    return [mm_nt(ik, iq_ref[:, h * dim:(h + 1) * dim]) for h in range(n_heads)]


def _scores_t(dots, iw_ref):
    """I^T [bk, bq] = sum_h w_h ReLU(dots_h)."""
    scores = jnp.zeros(dots[0].shape, jnp.float32)
    for h, d in enumerate(dots):
        scores = scores + iw_ref[h:h + 1, :] * jnp.maximum(d, 0.0)
    return scores


def _lse_kernel(needed_ref, fetch_ref, iq_ref, ik_ref, iw_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref,
                *refs, n_q, n_k, groups, masked, index_heads, index_dim):
    # iq_ref [bq, HI*DI]; ik_ref [bk, DI]; iw_ref [HI, bq] fp32; q_pos/q_seg [1, bq]; kv_pos/kv_seg [bk, 1];
    # with ``masked`` allowed_ref [bq, bk] int8; lse_ref [1, bq] fp32 (-inf for a query with an empty key set);
    # m/l [1, bq] fp32 scratch
    allowed_ref, (lse_ref, m_scr, l_scr) = _split_mask(refs, masked)
    b, i, j = pl.program_id(0), pl.program_id(2) * groups + pl.program_id(1), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)

    @pl.when(needed_ref[_table_index(b, i, j, n_q, n_k)] != 0)
    def _accumulate():
        keys = _key_set(q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, allowed_ref)   # [bk, bq]
        scores = jnp.where(keys, _scores_t(_index_dots_t(ik_ref[...], iq_ref, index_heads, index_dim), iw_ref),
                           -jnp.inf)
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, jnp.max(scores, axis=0, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no key yet: keep exp() finite
        l_scr[...] = jnp.exp(m_prev - m_safe) * l_scr[...] + jnp.sum(jnp.exp(scores - m_safe), axis=0,
                                                                      keepdims=True)
        m_scr[...] = m_new

    @pl.when(j == n_k - 1)
    def _finalize():
        l = l_scr[...]
        lse_ref[...] = jnp.where(l > 0.0, m_scr[...] + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)


def _block_terms(q_ref, k_ref, lse_ref, iq_ref, ik_ref, iw_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref,
                 allowed_ref, *, scale, heads, head_dim, index_heads, index_dim):
    """One (query block, key block) pair, key-major: (key set, target p, per-head index dots, scores I),
    each [bk, bq] fp32 (the key set bool; dots: a list over the indexer heads)."""
    visible = _key_set(q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, allowed_ref)
    # the target: every head's probabilities from its logits and lse, averaged over the heads
    probs = jnp.zeros(visible.shape, jnp.float32)
    for h in range(heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        logits = mm_nt(k_ref[:, cols], q_ref[:, cols]) * scale
        probs = probs + jnp.exp(logits - lse_ref[h:h + 1, :])
    p = jnp.where(visible, probs * (1.0 / heads), 0.0)
    dots = _index_dots_t(ik_ref[...], iq_ref, index_heads, index_dim)
    return visible, p, dots, _scores_t(dots, iw_ref)


def _kl_kernel(needed_ref, fetch_ref, q_ref, k_ref, lse_ref, iq_ref, ik_ref, iw_ref, lse_i_ref, q_pos_ref,
               q_seg_ref, kv_pos_ref, kv_seg_ref, *refs, n_q, n_k, groups, masked, with_grads, resident_dk,
               **dims):
    # q_ref [bq, H*D]; k_ref [bk, H*D]; lse_ref [H, bq] fp32 (0 where -inf); iq_ref [bq, HI*DI];
    # ik_ref [bk, DI]; iw_ref [HI, bq] fp32; lse_i_ref [1, bq] fp32 (0 where -inf); q_pos/q_seg [1, bq];
    # kv_pos/kv_seg [bk, 1]; with ``masked`` allowed_ref [bq, bk] int8. Outputs: kl_ref [1, bq]; with grads
    # also diq_ref [bq, HI*DI], diw_ref [HI, bq] (accumulated over the key blocks) and, with ``resident_dk``,
    # dik_ref [S, DI] (resident, accumulated over the group's query blocks), all fp32. Scratch: kl_scr [1, bq],
    # dots_scr [HI, bk, bq] fp32.
    allowed_ref, refs = _split_mask(refs, masked)
    diq_ref = diw_ref = dik_ref = None
    if with_grads and resident_dk:
        kl_ref, diq_ref, diw_ref, dik_ref, kl_scr, dots_scr = refs
    elif with_grads:
        kl_ref, diq_ref, diw_ref, kl_scr, dots_scr = refs
    else:
        kl_ref, kl_scr, dots_scr = refs
    index_heads, index_dim = dims["index_heads"], dims["index_dim"]
    b, i, j = pl.program_id(0), pl.program_id(2) * groups + pl.program_id(1), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        kl_scr[...] = jnp.zeros(kl_scr.shape, jnp.float32)
        if with_grads:
            diq_ref[...] = jnp.zeros(diq_ref.shape, jnp.float32)
            diw_ref[...] = jnp.zeros(diw_ref.shape, jnp.float32)

    if dik_ref is not None:
        @pl.when((pl.program_id(2) == 0) & (j == 0))   # the group's first query block
        def _init_dk():
            dik_ref[...] = jnp.zeros(dik_ref.shape, jnp.float32)

    @pl.when(needed_ref[_table_index(b, i, j, n_q, n_k)] != 0)
    def _accumulate():
        visible, p, dots, scores = _block_terms(q_ref, k_ref, lse_ref, iq_ref, ik_ref, iw_ref, q_pos_ref,
                                                q_seg_ref, kv_pos_ref, kv_seg_ref, allowed_ref, **dims)
        p_log_p = jnp.where(p > 0.0, p * jnp.log(jnp.where(p > 0.0, p, 1.0)), 0.0)
        kl_scr[...] += jnp.sum(jnp.where(visible, p_log_p - p * scores, 0.0), axis=0, keepdims=True)
        if with_grads:
            d_scores = jnp.where(visible, jnp.exp(scores - lse_i_ref[...]) - p, 0.0)
            for h, d in enumerate(dots):
                dots_scr[h] = d
            ik = ik_ref[...]
            dk = jnp.zeros((ik.shape[0], index_dim), jnp.float32)
            for h in range(index_heads):
                cols = slice(h * index_dim, (h + 1) * index_dim)
                d = dots_scr[h]
                diw_ref[h:h + 1, :] += jnp.sum(d_scores * jnp.maximum(d, 0.0), axis=0, keepdims=True)
                g = jnp.where(d > 0.0, d_scores * iw_ref[h:h + 1, :], 0.0).astype(ik.dtype)   # [bk, bq]
                diq_ref[:, cols] += mm(g.T, ik)
                if dik_ref is not None:
                    dk = dk + mm(g, iq_ref[:, cols])
            if dik_ref is not None:
                rows = pl.ds(pl.multiple_of(j * ik.shape[0], ik.shape[0]), ik.shape[0])   # this step's own block
                dik_ref[rows, :] += dk

    @pl.when(j == n_k - 1)
    def _finalize():   # a query with an empty key set has lseI (handed as 0) and the sums 0; the wrapper masks it
        kl_ref[...] = kl_scr[...] + lse_i_ref[...]


def _dk_kernel(needed_ref, fetch_ref, q_ref, k_ref, lse_ref, iq_ref, ik_ref, iw_ref, lse_i_ref, q_pos_ref,
               q_seg_ref, kv_pos_ref, kv_seg_ref, *refs, n_q, n_k, masked, **dims):
    # d ik when it is too long to stay resident: grid (B, n_k, n_q), query blocks innermost, the same
    # blocks as `_kl_kernel` (with ``masked`` allowed_ref [bq, bk] int8); dik_ref [bk, DI] fp32 accumulated
    # over the query blocks.
    allowed_ref, (dik_ref,) = _split_mask(refs, masked)
    b, kb, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(qb == 0)
    def _init():
        dik_ref[...] = jnp.zeros(dik_ref.shape, jnp.float32)

    @pl.when(needed_ref[_table_index(b, kb, qb, n_k, n_q)] != 0)
    def _accumulate():
        visible, p, dots, scores = _block_terms(q_ref, k_ref, lse_ref, iq_ref, ik_ref, iw_ref, q_pos_ref,
                                                q_seg_ref, kv_pos_ref, kv_seg_ref, allowed_ref, **dims)
        d_scores = jnp.where(visible, jnp.exp(scores - lse_i_ref[...]) - p, 0.0)
        dtype, index_dim = ik_ref.dtype, dims["index_dim"]
        dk = jnp.zeros(dik_ref.shape, jnp.float32)
        for h, d in enumerate(dots):
            g = jnp.where(d > 0.0, d_scores * iw_ref[h:h + 1, :], 0.0).astype(dtype)
            dk = dk + mm(g, iq_ref[:, h * index_dim:(h + 1) * index_dim])
        dik_ref[...] += dk


# ------------------------------------------------------------------------------------------------ wrapper
def _separate_dk(d: Shapes, operands, blocks, needed, dims, cost_estimate, interpret):
    """d ik [B, S, DI] fp32 from `_dk_kernel`: grid (B, n_k, n_q), query blocks (and the mask's [bq, bk]
    block) fetched through the transposed block tables (a skipped step repeats the last needed query block)."""
    n_q, n_k = d.T // d.bq, d.S // d.bk
    tables = block_tables(jnp.swapaxes(needed, 1, 2))

    def fetched(b, kb, qb, needed, fetch):
        return fetch[_table_index(b, kb, qb, n_k, n_q)]

    index_maps = {"q": lambda b, kb, qb, *t: (b, fetched(b, kb, qb, *t), 0),     # [B, T, ...] blocks
                  "row": lambda b, kb, qb, *t: (b, 0, fetched(b, kb, qb, *t)),   # [B, n, T] rows
                  "k": lambda b, kb, qb, *_: (b, kb, 0),
                  "mask": lambda b, kb, qb, *t: (b, fetched(b, kb, qb, *t), kb)}   # [B, T, S] blocks
    return pl.pallas_call(
        functools.partial(_dk_kernel, n_q=n_q, n_k=n_k, masked=blocks[-1][0] == "mask", **dims),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(d.B, n_k, n_q),
            in_specs=[pl.BlockSpec((None, *shape), index_maps[kind]) for kind, shape in blocks],
            out_specs=pl.BlockSpec((None, d.bk, d.DI), index_maps["k"])),
        out_shape=jax.ShapeDtypeStruct((d.B, d.S, d.DI), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret, name="indexer_kl_warmup_dk", cost_estimate=cost_estimate,
    )(*tables, *operands)


class _IndexMaps(NamedTuple):
    """Block index maps of a grid (B, groups, n_q / groups, n_k): step (g, i) runs query block i * groups + g
    (interleaved, so the groups share the causal work evenly)."""
    groups: int
    n_q: int
    n_k: int

    def kv_block(self, b, g, i, j, needed, fetch):
        return b, fetch[_table_index(b, i * self.groups + g, j, self.n_q, self.n_k)], 0

    def own_q(self, b, g, i, j, *_):      # [B, T, ...] blocks of the query block
        return b, i * self.groups + g, 0

    def own_row(self, b, g, i, j, *_):    # [B, n, T] rows of the query block
        return b, 0, i * self.groups + g

    def mask_block(self, b, g, i, j, needed, fetch):   # [B, T, S]: the query block x the fetched key block
        return b, i * self.groups + g, fetch[_table_index(b, i * self.groups + g, j, self.n_q, self.n_k)]

    def spec(self, kind, shape):
        """kind: "q" a [B, T, ...] block of the query block, "row" a [B, n, T] row block of it, "k" the key
        block the tables fetch, "mask" the [bq, bk] block of a [B, T, S] mask at both."""
        maps = {"q": self.own_q, "row": self.own_row, "k": self.kv_block, "mask": self.mask_block}
        return pl.BlockSpec((None, *shape), maps[kind])


class WarmupKL(NamedTuple):
    kl_BT: jax.Array          # per-token KL, 0 for a query with an empty key set
    has_set_BT: jax.Array     # bool: the query's key set is not empty
    d_iq: jax.Array | None    # [B, T, HI, DI] fp32 gradient of sum_t KL_t (with_grads)
    d_ik: jax.Array | None    # [B, S, DI] fp32
    d_iw: jax.Array | None    # [B, T, HI] fp32


def cost(d: Shapes, q_itemsize, index_itemsize, *, with_grads, resident=True, masked=False
         ) -> list[pl.CostEstimate]:
    """Declared costs of the kernels that run -- lse, KL and (with gradients, d ik not ``resident``) d ik --
    for the compiled program's FLOP/byte accounting. Steps: the (query block, key block) pairs a causal
    sequence needs, (n + 1) / 2n of them with n blocks along the coarser axis (the tables decide at run
    time); pairs: their (query, key) pairs. Bytes: the blocks of the outer axis once, an inner block per
    needed step (re-read by every outer block that needs it), the outputs once (a resident d ik once per
    query group); with ``masked`` every kernel also reads the int8 mask block of each needed step."""
    n_q, n_k = d.T // d.bq, d.S // d.bk
    n = min(n_q, n_k)
    steps = d.B * n_q * n_k * (n + 1) // (2 * n)
    pairs = steps * d.bq * d.bk
    resident = with_grads and resident
    meta = 8    # int32 position and segment id per token
    per_query = d.HI * d.DI * index_itemsize + d.HI * 4 + meta     # iq, iw, position and segment id
    per_key = d.DI * index_itemsize + meta                          # ik, position and segment id
    att_query, att_key = d.H * (d.D * q_itemsize + 4), d.H * d.D * q_itemsize   # q with its lse; k
    index_flops = 2 * d.HI * d.DI
    mask = pairs if masked else 0   # one int8 per pair of a needed step, in every kernel
    costs = [pl.CostEstimate(flops=pairs * index_flops, transcendentals=pairs,
                             bytes_accessed=d.B * d.T * (per_query + 4) + steps * d.bk * per_key + mask)]
    # the KL kernel: queries outer; reads lseI, writes kl (+ d iq, d w, and a resident d ik per group)
    grads_out = d.B * d.T * d.HI * (d.DI + 1) * 4 if with_grads else 0
    if resident:
        grads_out += d.B * query_groups(n_q, True) * d.S * d.DI * 4
    kl_flops = 2 * d.H * d.D + index_flops * (1 + (2 if resident else 1 if with_grads else 0))
    costs.append(pl.CostEstimate(
        flops=pairs * kl_flops, transcendentals=pairs * (d.H + 2),
        bytes_accessed=(d.B * d.T * (att_query + per_query + 8) + steps * d.bk * (att_key + per_key) + grads_out
                        + mask)))
    if with_grads and not resident:   # the d ik kernel: keys outer, every needed query block re-read
        costs.append(pl.CostEstimate(
            flops=pairs * (2 * d.H * d.D + 2 * index_flops), transcendentals=pairs * (d.H + 1),
            bytes_accessed=(d.B * d.S * (att_key + per_key + d.DI * 4)
                            + steps * d.bq * (att_query + per_query + 4) + mask)))
    return costs


def warmup_indexer_kl(q_BTHD, k_BSHD, lse_BHT, iq_BTHD, ik_BSD, iw_BHT, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS,
                      allowed_BTS=None, index_lse_BT=None, *, scale, block_q=128, block_k=128, with_grads=True,
                      interpret=False, resident_dk_bytes=RESIDENT_DK_BYTES) -> WarmupKL:
    """Per-token warm-up KL and (``with_grads``) the gradients of sum_t KL_t. q [B, T, H, D], k [B, S, H, D]
    (the attention's MHA query and per-head keys), lse [B, H, T] fp32 (the attention's log-sum-exp of the
    scaled logits over the key set), iq [B, T, HI, DI], ik [B, S, DI], iw [B, HI, T]; ``allowed_BTS``
    (optional, bool or int8 [B, T, S]): the key set of query t is its visible keys s with allowed[t, s] != 0
    (without it, all of them). T, S multiples of the blocks; D, DI multiples of 128. d ik stays resident in
    the KL kernel while its fp32 [S, DI] fits ``resident_dk_bytes``, else a separate kernel computes it.
    ``index_lse_BT`` (optional, fp32 [B, T], -inf for an empty key set): lseI when the caller already has
    it -- the top-k that chose the selection holds the selected scores -- and the lse pass does not run."""
    d = check_shapes(q_BTHD, k_BSHD, lse_BHT, iq_BTHD, ik_BSD, iw_BHT, block_q, block_k)
    masked = allowed_BTS is not None
    mask_operands = (mask_operand("warmup_indexer_kl", allowed_BTS, (d.B, d.T, d.S)),) if masked else ()
    B, T, S, H, D, HI, DI, bq, bk = d
    n_q, n_k = T // bq, S // bk
    needed = needed_blocks(q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, bq, bk)
    tables = block_tables(needed)
    iq = iq_BTHD.reshape(B, T, HI * DI)
    iw = iw_BHT.astype(jnp.float32)
    q_pos, q_seg, kv_pos, kv_seg = _rows(q_pos_BT), _rows(q_seg_BT), _columns(kv_pos_BS), _columns(kv_seg_BS)
    resident = with_grads and S * DI * 4 <= resident_dk_bytes
    costs = cost(d, q_BTHD.dtype.itemsize, iq.dtype.itemsize, with_grads=with_grads, resident=resident,
                 masked=masked)
    dims = dict(scale=scale, heads=H, head_dim=D, index_heads=HI, index_dim=DI)
    # (kind, block shape) of every operand: see _IndexMaps.spec
    index_blocks = [("q", (bq, HI * DI)), ("k", (bk, DI)), ("row", (HI, bq))]                  # iq, ik, iw
    meta_blocks = [("row", (1, bq)), ("row", (1, bq)), ("k", (bk, 1)), ("k", (bk, 1))]   # positions, segments
    meta_blocks += [("mask", (bq, bk))] * len(mask_operands)                             # the mask's [bq, bk]
    lse_blocks = index_blocks + meta_blocks
    kl_blocks = ([("q", (bq, H * D)), ("k", (bk, H * D)), ("row", (H, bq))] + index_blocks + [("row", (1, bq))]
                 + meta_blocks)   # q, k, lse, iq, ik, iw, lseI, positions, segments(, mask)

    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)   # noqa: E731  (queries without keys are masked)

    # ---- pass 1: lseI (unless given)
    if index_lse_BT is not None:
        lse_i = index_lse_BT.astype(jnp.float32)[:, None, :]
    else:
        maps = _IndexMaps(1, n_q, n_k)
        lse_i = pl.pallas_call(
            functools.partial(_lse_kernel, n_q=n_q, n_k=n_k, groups=1, masked=masked, index_heads=HI,
                              index_dim=DI),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(B, 1, n_q, n_k),
                in_specs=[maps.spec(kind, shape) for kind, shape in lse_blocks],
                out_specs=pl.BlockSpec((None, 1, bq), maps.own_row),
                scratch_shapes=[pltpu.VMEM((1, bq), jnp.float32), pltpu.VMEM((1, bq), jnp.float32)]),
            out_shape=jax.ShapeDtypeStruct((B, 1, T), jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel",
                                                                      "arbitrary"),
                                                 vmem_limit_bytes=VMEM_LIMIT),
            interpret=interpret, name="indexer_kl_warmup_lse", cost_estimate=costs[0],
        )(*tables, iq, ik_BSD, iw, q_pos, q_seg, kv_pos, kv_seg, *mask_operands)
    has_set = jnp.isfinite(lse_i[:, 0, :])

    # ---- pass 2: target, KL and gradients. A resident d ik accumulates over the query blocks, so they run
    # in order -- within a group: two groups of interleaved query blocks (each with its own d ik, summed
    # afterwards) keep a "parallel" grid axis for the two TensorCores of a v5p chip at batch 1.
    groups = query_groups(n_q, resident)
    maps = _IndexMaps(groups, n_q, n_k)
    out_specs = [pl.BlockSpec((None, 1, bq), maps.own_row)]
    out_shape = [jax.ShapeDtypeStruct((B, 1, T), jnp.float32)]
    if with_grads:
        out_specs += [pl.BlockSpec((None, bq, HI * DI), maps.own_q), pl.BlockSpec((None, HI, bq), maps.own_row)]
        out_shape += [jax.ShapeDtypeStruct((B, T, HI * DI), jnp.float32),
                      jax.ShapeDtypeStruct((B, HI, T), jnp.float32)]
    if resident:
        out_specs.append(pl.BlockSpec((None, None, S, DI), lambda b, g, i, j, *_: (b, g, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, groups, S, DI), jnp.float32))
    operands = (q_BTHD.reshape(B, T, H * D), k_BSHD.reshape(B, S, H * D), finite(lse_BHT.astype(jnp.float32)),
                iq, ik_BSD, iw, finite(lse_i), q_pos, q_seg, kv_pos, kv_seg, *mask_operands)
    outs = pl.pallas_call(
        functools.partial(_kl_kernel, n_q=n_q, n_k=n_k, groups=groups, masked=masked,
                          with_grads=with_grads, resident_dk=resident, **dims),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, groups, n_q // groups, n_k),
            in_specs=[maps.spec(kind, shape) for kind, shape in kl_blocks],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((1, bq), jnp.float32), pltpu.VMEM((HI, bk, bq), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary" if resident else "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret, name="indexer_kl_warmup" + ("_grads" if with_grads else ""), cost_estimate=costs[1],
    )(*tables, *operands)
    if with_grads and not resident:
        outs = list(outs) + [_separate_dk(d, operands, kl_blocks, needed, dims, costs[2], interpret)[:, None]]
    kl = jnp.where(has_set, outs[0][:, 0, :], 0.0)
    if not with_grads:
        return WarmupKL(kl, has_set, None, None, None)
    _, d_iq, d_iw, d_ik = outs   # d ik [B, groups, S, DI]
    return WarmupKL(kl, has_set, d_iq.reshape(B, T, HI, DI), jnp.sum(d_ik, axis=1), jnp.swapaxes(d_iw, 1, 2))
