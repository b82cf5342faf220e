"""Expert-parallel routed experts: a `shard_map` over the mesh in context.

Tokens arrive sharded over the batch axes (and the sequence axes under context parallelism), experts
over the mesh axis the logical "exp" axis maps to (mesh names come from the current logical-axis rules,
never from model code). Per token shard:

    assignments (token, expert) -> rank within their expert -> capacity check -> transport to the expert's
    shard -> grouped SwiGLU over the local experts' received rows -> reverse transport -> [N, K, D]

Each (source shard, expert) pair carries at most ``C = ceil(capacity_factor * N_local * K / E)``
assignments; later ones (in token order) are dropped: their expert output is zero and they are counted
in ``dropped``. With ``RuntimeConfig.moe_a2a_chunks = c > 1`` a shard's tokens go as c chunks of N_local / c
tokens, one after another, each with its own capacity (of N_local / c tokens) and its own transports: one
chunk's all_to_all has the other chunks' expert matmuls to overlap (an async all_to_all on TPU). With
``RuntimeConfig.moe_a2a_chunk_by = "experts"`` (a2a) the chunks split the experts instead: chunk j carries
every token's assignments to the j-th share of each shard's local experts, one capacity over the whole
shard. A grouped matmul then holds as many rows over c times fewer experts: fewer row tiles cut by a group
boundary, each expert's weights read in one call, and capacity bins of all the shard's tokens. Both
transports keep exactly the same assignments, so they compute the same function:

* ``"a2a"``: the capacity-padded [E * C, D] buffer goes through `jax.lax.all_to_all` (runs on CPU); the
  receiver packs each local expert's received rows together (the per-source counts travel with them), so
  the grouped matmul never multiplies a padding slot. With ``RuntimeConfig.moe_group_align = a > 1`` each
  expert's rows start at a multiple of a rows, zero rows between: a grouped matmul with a-row tiles then
  computes no tile twice (megablox computes a tile two groups share once per group) for the cost of
  multiplying the zero rows, half a tile per expert on average;
* ``"ragged_a2a"``: only the kept rows travel, with `jax.lax.ragged_all_to_all` (TPU/GPU only).

The grouped matmul is ``ModelConfig.moe_impl``'s (glm5_jax/model/moe/experts.py; "blocked", a whole-batch CPU
implementation, runs as ragged_dot here). Expert weights enter with their F (``mlp_moe``) dimension still
sharded; the partial down-projections are summed over that mesh axis, in the compute dtype. Their model
width D (``embed``: FSDP) also enters sharded and is all-gathered inside, so that the backward pass
reduce-scatters each weight gradient to its FSDP shard (the transpose of that all-gather) instead of
all-reducing the whole local expert gradient and slicing it afterwards.
"""
from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.moe.experts import swiglu_rows
from glm5_jax.parallel.axes import BATCH, EMBED, EXP, MLP_MOE, SEQ
from glm5_jax.parallel.shard_map import logical_mesh_axes
from pallas_kernels.impls import BLOCKED, RAGGED_DOT
from pallas_kernels.tpu_utils import LANES


def _single(axes: tuple[str, ...], what: str) -> str | None:
    if len(axes) > 1:
        raise ValueError(f"expert parallelism needs the logical {what!r} axis on one mesh axis, got {axes}")
    return axes[0] if axes else None


def capacity(tokens_local: int, top_k: int, n_experts: int, factor: float) -> int:
    """Slots per (source shard, expert): factor x the fair share of this shard's assignments."""
    return max(1, math.ceil(factor * tokens_local * top_k / n_experts))


def expected_routed_rows(tokens_per_shard: int, cfg: ModelConfig) -> float | None:
    """The routed rows each grouped matmul holds on average, per token shard of ``tokens_per_shard``
    tokens: on the all-to-all transports a shard receives its chunk's tokens x K rows on average (every
    assignment lands on one shard; an expert chunk holds the shard's tokens x K / chunks: its share of the
    experts) in a buffer with room for the capacity; None without them (the rows are the N x K assignments
    themselves, the whole buffer). The cost model's `GroupedMatmulLoad.rows`."""
    if cfg.runtime.moe_ep not in TRANSPORTS:
        return None
    chunks = cfg.runtime.moe_a2a_chunks
    if cfg.runtime.moe_a2a_chunk_by == "experts":
        return tokens_per_shard * cfg.num_experts_per_tok / chunks
    if tokens_per_shard % chunks:
        chunks = 1
    return float(tokens_per_shard // chunks * cfg.num_experts_per_tok)


def rank_within_expert(flat_e, n_experts):
    """order (assignments sorted by expert, stable), each assignment's rank among its expert's, counts [E]."""
    counts = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat_e.shape[0], dtype=jnp.int32) - starts[flat_e[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return order, rank, counts


def tile_rows(x_RD):
    """[R, D] -> [R, D / 128, 128] when D is a multiple of 128, else unchanged. A TPU array lives in HBM as
    tiles of (8, 128) 32-bit words ((16, 128) bf16 values) over its two minor dims, so a row of [R, D]
    shares its tiles with the 7-15 rows beside it and a gather or scatter of single rows moves whole
    tiles, 8-16x the rows' bytes; in the [R, D / 128, 128] view each row is tiles of its own and a row
    gather moves only its bytes (the reshape back to [R, D] for a matmul is one relayout copy). On CPU
    both are the same row-major bytes."""
    R, D = x_RD.shape
    return x_RD.reshape(R, D // LANES, LANES) if D % LANES == 0 else x_RD


# The transport's row gathers, each with the gather its gradient is: JAX's transpose of a gather is a
# scatter-add into a zero-filled buffer (the buffer written, then read and written back at every update).
# Rows no one reads are left unspecified (a clipped index: a copy of some real row, finite when the data
# is): a padding slot of the send buffer (the receiver packs only filled slots), a packed row past the
# local experts' rows (the grouped matmuls never multiply those and zero their output), a returned
# padding slot. Zero-filling them costs a select pass over the rows.


def _take(x, rows, zero_fill):
    return x.at[rows].get(mode="fill", fill_value=0) if zero_fill else x.at[rows].get(mode="clip")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_unique_rows(x_R, rows_M, inverse_R, zero_fill=False):
    """x[rows] -> [M, ...], where ``rows`` names each row of x at most once and ``inverse[r]`` is the
    output row that took x row r (out of range: none). A row out of range comes out zero with
    ``zero_fill``, else unspecified. Gradient: dy[inverse], unspecified at rows of x no output took."""
    return _take(x_R, rows_M, zero_fill)


def _take_unique_rows_fwd(x_R, rows_M, inverse_R, zero_fill):
    return _take(x_R, rows_M, zero_fill), inverse_R


def _take_unique_rows_bwd(zero_fill, inverse_R, dy_M):
    return _take(dy_M, inverse_R, False), None, None


take_unique_rows.defvjp(_take_unique_rows_fwd, _take_unique_rows_bwd)


@jax.custom_vjp
def take_token_rows(x_N, token_of_slot_S, slot_NK):
    """x[token_of_slot] -> [S, ...], where each slot holds one (token, choice) assignment and ``slot_NK[n,
    k]`` is the slot of token n's k-th (out of range: dropped); a slot out of range is unspecified.
    Gradient: each token's kept slots gathered and summed in fp32."""
    return _take(x_N, token_of_slot_S, False)


def _take_token_rows_fwd(x_N, token_of_slot_S, slot_NK):
    return _take(x_N, token_of_slot_S, False), slot_NK


def _take_token_rows_bwd(slot_NK, dy_S):
    d_NK = _take(dy_S, slot_NK, False)
    kept = (slot_NK < dy_S.shape[0]).reshape(slot_NK.shape + (1,) * (dy_S.ndim - 1))
    return jnp.where(kept, d_NK.astype(jnp.float32), 0).sum(axis=1).astype(dy_S.dtype), None, None


take_token_rows.defvjp(_take_token_rows_fwd, _take_token_rows_bwd)


def _a2a_experts(x, idx, w_gate, w_up, w_down, *, ep, mlp, cap, dtype, impl, align=1, limit=None):
    """Capacity-padded all_to_all transport. Shapes are per shard. The weights are [El, F, D] each, or
    (expert chunks) tuples of c chunks of [El / c, F, D], chunk j every shard's j-th share of its local experts:
    each chunk then has its own send buffer, dispatch -> grouped SwiGLU -> combine, so one chunk's all_to_all
    runs beside another chunk's matmuls."""
    chunked = isinstance(w_gate, tuple)
    weights = list(zip(w_gate, w_up, w_down)) if chunked else [(w_gate, w_up, w_down)]
    n, K = idx.shape
    c, Ec, D = len(weights), weights[0][0].shape[0], x.shape[-1]
    El = c * Ec
    n_ep = jax.lax.axis_size(ep) if ep else 1
    E = El * n_ep
    flat_e = idx.reshape(-1)
    _, rank, counts = rank_within_expert(flat_e, E)
    kept = rank < cap
    kept_counts = jnp.minimum(counts, cap).reshape(n_ep, El)             # [dest, El] filled slots
    recv_counts = jax.lax.all_to_all(kept_counts, ep, 0, 0, tiled=True) if ep else kept_counts   # [src, El]
    rows = tile_rows(x.astype(dtype))
    # chunk j's send buffer is [dest, Ec, C] rows (one chunk: [dest, El, C], expert-major): expert e = dest * El +
    # local is in chunk local // Ec, at block dest * Ec + local % Ec; an assignment of another chunk, or a
    # dropped one, is out of range there
    dest, local = flat_e // El, flat_e % El
    in_chunk = jnp.where(kept, (dest * Ec + local % Ec) * cap + rank, 0)
    chunk_of = jnp.where(kept, local // Ec, c)                           # c: dropped
    slots, assignments, returned = [], [], []
    for j, w_j in enumerate(weights):
        slot = jnp.where(chunk_of == j, in_chunk, n_ep * Ec * cap)
        # the (token, choice) assignment each send slot carries (n * K: an empty slot) and so its token (n:
        # none), then one gather fills the buffer: no [n * K, D] copy of the tokens and no zero-filled buffer
        # scattered into (whose bytes a scatter reads and writes)
        assignment_of_slot = jnp.full((n_ep * Ec * cap,), n * K, jnp.int32).at[slot].set(
            jnp.arange(n * K, dtype=jnp.int32), mode="drop")
        send = take_token_rows(rows, assignment_of_slot // K, slot.reshape(n, K))
        returned.append(_a2a_expert_chunk(send, recv_counts[:, j * Ec:(j + 1) * Ec], *w_j, ep=ep, mlp=mlp, cap=cap,
                                          dtype=dtype, impl=impl, align=align, limit=limit))
        slots.append(slot)
        assignments.append(assignment_of_slot)
    y_assign = take_rows_of_chunks(returned, slots, assignments)
    return y_assign.reshape(n, K, D), jnp.sum(~kept).astype(jnp.int32)


@jax.custom_vjp
def take_rows_of_chunks(xs, rows_list, inverse_list):
    """Sum over chunks j of xs[j][rows[j]], each row out of range read as zero: every output row names a row
    of at most one chunk (the combine of the expert chunks: each assignment is in one chunk). Gradient: for
    each chunk dy[inverse[j]], unspecified at rows no output took -- no concatenation of the chunks' buffers
    and no zero-filled cotangent per chunk."""
    return functools.reduce(operator.add, (_take(x, rows, True) for x, rows in zip(xs, rows_list)))


def _take_rows_of_chunks_fwd(xs, rows_list, inverse_list):
    return take_rows_of_chunks(xs, rows_list, inverse_list), inverse_list


def _take_rows_of_chunks_bwd(inverse_list, dy):
    return [_take(dy, inverse, False) for inverse in inverse_list], None, None


take_rows_of_chunks.defvjp(_take_rows_of_chunks_fwd, _take_rows_of_chunks_bwd)


def _a2a_expert_chunk(send, recv_counts_SE, w_gate, w_up, w_down, *, ep, mlp, cap, dtype, impl, align, limit=None):
    """One chunk's dispatch -> grouped SwiGLU -> combine: ``send`` [dest, El, C] rows (El: this chunk's local
    experts) -> the rows returned to their slots."""
    n_ep, El = recv_counts_SE.shape
    D = math.prod(send.shape[1:])                                        # rows may come as [D / 128, 128]
    recv = jax.lax.all_to_all(send, ep, 0, 0, tiled=True) if ep else send        # [src, El, C] rows
    # pack: local expert e's filled slots from every source, contiguous (from a multiple of `align`);
    # padding slots go nowhere
    packed_slot, group_sizes, Rp = _packed_slots(recv_counts_SE, cap, align)   # [src, El, C]; Rp = padding
    R = n_ep * El * cap
    # the received row each packed row takes (R: none), then a gather, as for `send`. With aligned groups the
    # rows between an expert's last row and the next tile are multiplied: they must be zero (their gate / up
    # products, SwiGLU and weight-gradient terms are then exactly zero)
    recv_row_of_packed = jnp.full((Rp,), R, jnp.int32).at[packed_slot.reshape(-1)].set(
        jnp.arange(R, dtype=jnp.int32), mode="drop")
    packed = take_unique_rows(recv, recv_row_of_packed, packed_slot.reshape(-1), align > 1)
    y = _reduce_partial_widths(swiglu_rows(packed.reshape(Rp, D), group_sizes, w_gate, w_up, w_down, dtype,
                                           impl, gate_up_transposed=True, out_dtype=dtype, limit=limit), mlp, dtype)
    back = take_unique_rows(tile_rows(y), packed_slot.reshape(-1), recv_row_of_packed)   # [src, El, C] rows
    return jax.lax.all_to_all(back, ep, 0, 0, tiled=True) if ep else back


def _reduce_partial_widths(y_RD, mlp, dtype):
    """The expert outputs in the compute dtype, summed over the `mlp` axis when the expert width is split
    over it (each shard holds a partial down product). The sum runs in the compute dtype, as the rows
    travel back in it anyway: a bf16 all-reduce moves half the bytes of the fp32 one."""
    y_RD = y_RD.astype(dtype)
    return jax.lax.psum(y_RD, mlp) if mlp else y_RD


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _packed_slots(counts_SE, cap, align=1):
    """Where each received slot [S, E, C] goes once every local expert's filled slots are packed together
    (expert-major, then source, then slot), each expert's rows starting at a multiple of ``align`` ->
    (row of each slot, the buffer's row count for a padding slot (c >= counts[s, e]); each expert's rows
    rounded up to ``align`` [E] (the grouped matmul's group sizes); the buffer's rows: an expert receives at
    most S x C rows, so E x (S x C rounded up to ``align``) hold every expert's rows and padding -- no more
    than S x E x C when S x C is a multiple of ``align``)."""
    S, El = counts_SE.shape
    padded_E = -(-counts_SE.sum(0) // align) * align
    start_SE = _exclusive_cumsum(padded_E)[None, :] + _exclusive_cumsum(counts_SE, axis=0)
    rows = El * (-(-(S * cap) // align) * align)
    c = jnp.arange(cap, dtype=jnp.int32)
    slot = start_SE[:, :, None] + c
    return jnp.where(c < counts_SE[:, :, None], slot, rows).astype(jnp.int32), padded_E.astype(jnp.int32), rows


def _ragged_a2a_experts(x, idx, w_gate, w_up, w_down, *, ep, mlp, cap, dtype, impl, align=1, limit=None):
    """ragged_all_to_all transport of the kept rows only (same kept set as `_a2a_experts`)."""
    n, K = idx.shape
    El, D = w_gate.shape[0], x.shape[-1]
    n_ep = jax.lax.axis_size(ep)
    E, A, R = El * n_ep, n * K, n_ep * El * cap
    me = jax.lax.axis_index(ep)
    flat_e = idx.reshape(-1)
    order, rank, counts = rank_within_expert(flat_e, E)
    kept = rank < cap
    kept_counts = jnp.minimum(counts, cap)                                # [E]
    # kept assignments, sorted by expert (hence by destination shard), packed to the front
    kept_sorted = kept[order]
    packed_pos = jnp.where(kept_sorted, jnp.cumsum(kept_sorted) - 1, A)
    row_of_sorted = jnp.zeros((A,), jnp.int32).at[packed_pos].set(order.astype(jnp.int32), mode="drop")
    send = x.astype(dtype)[row_of_sorted // K]                            # rows past the kept ones: unused
    send_sizes = kept_counts.reshape(n_ep, El).sum(-1)                    # [dest]
    all_kept = jax.lax.all_gather(kept_counts, ep)                        # [src, E]
    sent = all_kept.reshape(n_ep, n_ep, El).sum(-1)                       # sent[src, dest]
    input_offsets = _exclusive_cumsum(send_sizes)
    output_offsets = _exclusive_cumsum(sent, axis=0)[me]                  # where my rows land on each dest
    recv_sizes = sent[:, me]
    recv = jax.lax.ragged_all_to_all(send, jnp.zeros((R, D), dtype), input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=ep)
    # received rows: for each source, for each local expert, its kept rows; then padding
    cnt = jax.lax.dynamic_slice_in_dim(all_kept, me * El, El, axis=1)     # [src, El]
    ends = jnp.cumsum(cnt.reshape(-1))
    piece = jnp.searchsorted(ends, jnp.arange(R), side="right")           # (src, el) index; n_ep*El = padding
    local_e = jnp.where(piece < n_ep * El, piece % El, El)
    by_expert_order = jnp.argsort(local_e, stable=True)
    y = _reduce_partial_widths(
        swiglu_rows(recv[by_expert_order], cnt.sum(0).astype(jnp.int32), w_gate, w_up, w_down, dtype, impl,
                    gate_up_transposed=True, out_dtype=dtype, limit=limit), mlp, dtype)
    y_recv = jnp.zeros((R, D), dtype).at[by_expert_order].set(y)
    recv_offsets = _exclusive_cumsum(recv_sizes)
    back_offsets = _exclusive_cumsum(sent, axis=1)[:, me]                 # my rows' offsets in each source
    returned = jax.lax.ragged_all_to_all(y_recv, jnp.zeros((A, D), dtype), recv_offsets, recv_sizes,
                                         back_offsets, send_sizes, axis_name=ep)
    # assignment -> its packed row (kept) or zero (dropped)
    packed_of_assignment = jnp.zeros((A,), jnp.int32).at[order].set(packed_pos.astype(jnp.int32))
    y_assign = returned.at[packed_of_assignment].get(mode="fill", fill_value=0)
    return y_assign.reshape(n, K, D), jnp.sum(~kept).astype(jnp.int32)


TRANSPORTS = {"a2a": _a2a_experts, "ragged_a2a": _ragged_a2a_experts}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_minor_width(w_EFd, axes):
    """all_gather of [E, F, D / n] over ``axes`` along the minor dim -> [E, F, D], whose gradient reduce-scatters
    the [E * F, D] view: the TPU compiler turns the transpose of the 3-D gather into an all-reduce of the whole
    gradient when E is under a sublane tile (an expert chunk of 4 experts), twice the bytes of a reduce-scatter
    and the whole gradient in memory."""
    return jax.lax.all_gather(w_EFd, axes, axis=2, tiled=True)


def _gather_minor_width_fwd(w_EFd, axes):
    return gather_minor_width(w_EFd, axes), None


def _gather_minor_width_bwd(axes, _, g_EFD):
    E, F, D = g_EFD.shape
    g = jax.lax.psum_scatter(g_EFD.reshape(E * F, D), axes, scatter_dimension=1, tiled=True)
    return (g.reshape(E, F, -1),)


gather_minor_width.defvjp(_gather_minor_width_fwd, _gather_minor_width_bwd)


def expert_parallel_swiglu(x_ND, expert_idx_NK, w_gate_EDF, w_up_EDF, w_down_EFD, cfg: ModelConfig):
    """Routed-expert outputs y[n, k] = SwiGLU_{expert_idx[n,k]}(x[n]) -> ([N, K, D] in the compute dtype
    (the rows cross the all_to_all in it), dropped count).

    Must run under a mesh (`jax.set_mesh`) and Flax logical-axis rules; the mesh axes are those of the
    logical "batch", "seq", "exp" and "mlp_moe" axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(f"moe_ep={cfg.runtime.moe_ep!r} needs a mesh in context (jax.set_mesh) and logical axis rules")
    # token shards: the batch axes, then the sequence axes (context parallelism): the [B, T] -> [N] flatten
    # of tokens sharded that way is sharded over both, batch-major. Tokens are independent here, so any
    # split is correct; one that does not divide N (a short decode step) keeps to the batch axes.
    batch = tuple(a for a in logical_mesh_axes(BATCH) if mesh.shape[a] > 1)
    with_seq = batch + tuple(a for a in logical_mesh_axes(SEQ) if mesh.shape[a] > 1)
    if expert_idx_NK.shape[0] % math.prod(mesh.shape[a] for a in with_seq) == 0:
        batch = with_seq
    ep = _single(logical_mesh_axes(EXP), EXP)
    mlp = _single(logical_mesh_axes(MLP_MOE), MLP_MOE)
    ep = ep if ep and mesh.shape[ep] > 1 else None
    mlp = mlp if mlp and mesh.shape[mlp] > 1 else None
    if cfg.runtime.moe_ep == "ragged_a2a" and ep is None:
        raise ValueError("moe_ep='ragged_a2a' needs the 'exp' axis on a mesh axis of size > 1")
    if ep and ep not in batch:
        raise ValueError(f"expert axis {ep!r} must also shard the batch (tokens) for expert parallelism")
    if mlp and mlp in batch:
        raise ValueError(f"mesh axis {mlp!r} cannot shard both tokens and expert widths")
    N, K = expert_idx_NK.shape
    shards = math.prod(mesh.shape[a] for a in batch)
    if N % shards:
        raise ValueError(f"{N} tokens do not split over the {shards} token shards {batch}")
    chunks = cfg.runtime.moe_a2a_chunks
    by_experts = cfg.runtime.moe_a2a_chunk_by == "experts"
    n_ep = mesh.shape[ep] if ep else 1
    if by_experts and (cfg.n_routed_experts // n_ep) % chunks:
        raise ValueError(f"moe_a2a_chunk_by='experts': {cfg.n_routed_experts // n_ep} local experts per shard do "
                         f"not split into moe_a2a_chunks={chunks} chunks")
    if not by_experts and (N // shards) % chunks:
        chunks = 1                 # a short step (decode) whose tokens per shard do not split: one chunk
    token_chunks = 1 if by_experts else chunks
    cap = capacity(N // shards // token_chunks, K, cfg.n_routed_experts, cfg.runtime.moe_capacity_factor)
    body = TRANSPORTS[cfg.runtime.moe_ep]
    impl = RAGGED_DOT if cfg.runtime.moe_impl == BLOCKED else cfg.runtime.moe_impl
    tok = P(batch or None, None)

    # the weights' FSDP axes (logical "embed"), gathered inside: their transpose reduce-scatters the grads
    fsdp = tuple(a for a in logical_mesh_axes(EMBED) if mesh.shape[a] > 1 and a not in (ep, mlp))
    if fsdp and (w_gate_EDF.shape[1] % math.prod(mesh.shape[a] for a in fsdp)):
        fsdp = ()

    def gather_width(w_EFd):
        if not fsdp:
            return w_EFd
        return gather_minor_width(w_EFd, fsdp) if by_experts else jax.lax.all_gather(w_EFd, fsdp, axis=2, tiled=True)

    def local(x, idx, *w_EFD):
        # (gate, up, down) per chunk -> per weight, a tuple over the chunks, each gathered from its FSDP shards
        per_chunk = zip(*(iter(w_EFD),) * 3)
        wg_EFD, wu_EFD, wd_EFD = (tuple(map(gather_width, ws)) for ws in zip(*per_chunk))
        common = dict(ep=ep, mlp=mlp, cap=cap, dtype=cfg.jnp_dtype, impl=impl, align=cfg.runtime.moe_group_align,
                      limit=cfg.swiglu_limit)
        if by_experts:   # the chunks are inside the transport
            y, dropped = body(x, idx, wg_EFD, wu_EFD, wd_EFD, **common)
            return y, jax.lax.psum(dropped, batch) if batch else dropped
        (wg_EFD,), (wu_EFD,), (wd_EFD,) = wg_EFD, wu_EFD, wd_EFD
        # token chunks, each its own dispatch -> experts -> combine: they share no data, so the compiler can
        # run one chunk's all_to_all beside another chunk's expert matmuls
        ys, drops = zip(*(body(x_c, idx_c, wg_EFD, wu_EFD, wd_EFD, **common)
                          for x_c, idx_c in zip(jnp.split(x, chunks), jnp.split(idx, chunks))))
        y, dropped = jnp.concatenate(ys), sum(drops)
        return y, jax.lax.psum(dropped, batch) if batch else dropped

    # All three weights enter as [E, F, D], the gate and up ones transposed on each shard (no communication):
    # the FSDP dim is then the minor one of each, and the TPU compiler turns each gradient's transpose of the
    # gather into a reduce-scatter; the gate / up gradients, scattered on the middle dim of [E, D, F], it
    # compiled as an all-reduce of the whole local gradient and a slice.
    w_spec = P(ep, mlp, fsdp or None)
    dt = cfg.jnp_dtype            # weights cast before the shard_map: FSDP gathers them in the compute dtype
    weights = (jnp.swapaxes(w_gate_EDF, 1, 2).astype(dt), jnp.swapaxes(w_up_EDF, 1, 2).astype(dt),
               w_down_EFD.astype(dt))

    def expert_chunks(w):
        """[E, F, D] -> its chunks [E / c, F, D], chunk j every expert shard's j-th share of its local experts:
        each enters the shard_map as its own operand, gathered and reduce-scattered there on its own (the
        slices fuse into the cast above; a slice of the gathered weights inside would be a copy)."""
        if not by_experts:
            return (w,)
        w = w.reshape(n_ep, chunks, w.shape[0] // (n_ep * chunks), *w.shape[1:])
        return tuple(w[:, j].reshape(-1, *w.shape[3:]) for j in range(chunks))

    operands = [w_j for chunked in zip(*map(expert_chunks, weights)) for w_j in chunked]   # gate, up, down per chunk
    return jax.shard_map(local, in_specs=(tok, tok) + (w_spec,) * len(operands),
                         out_specs=(P(batch or None, None, None), P()), check_vma=False)(
        x_ND, expert_idx_NK, *operands)
