"""Routed experts for a decode step with many tokens per chip: each assignment sent only to its expert's chip.

``moe_ep="a2a_decode"`` (the sampling mesh, glm5_jax/parallel/sampling.py): experts resident on the chips of
the expert axis as for ``moe_ep="gather"`` (glm5_jax/model/moe/decode_dispatch.py), tokens split over it. Per
layer and chip, n tokens x K choices, ``chips`` chips in the expert group:

    each (token, choice) -> its expert's chip and its rank among this chip's assignments to that chip ->
    send slots [chips, C] (the first C per destination, in token order; later ones dropped, counted)
    rows [chips, C, D] and each slot's local expert [chips, C]  --all_to_all over the expert axis-->
    the chip's SwiGLU of each received row by its local expert (`expert_rows`: the bf16 grouped matmul,
    the packed INT4 block kernel, decode_dispatch's, or with ``decode_moe_kernel`` the one-call INT4 kernel
    pallas_kernels/int4_moe_rows, which reads the received rows and writes their results in place; gates
    applied at the source)  --all_to_all back-->
    each slot's output -> sum_k gates[n, k] y[n, k] per token [n, D] (fp32)

With ``decode_a2a_exchange="ragged"`` the slots go: a chip sorts its assignments by destination and sends each
destination just its rows, each carrying its local expert as one more value (`with_key`), in one ragged all-to-all
(glm5_jax/parallel/ragged_exchange.py), each chip taking at
most `local_capacity` of the rows sent to it (senders' slices in sender order; the counts all-gathered first, so
every chip knows what each receiver keeps: `ragged_plan`), and the results come back the same way. A chip then
sends n K rows, not chips x C (744B, batch 3072 on 64 chips: 384 rows, not 64 x 16 = 1,024).

"gather" moves the expert group's tokens to every chip and their results back ([chips x n, D] twice, which
XLA:TPU compiles as two all-reduces); here a chip sends and receives [chips x C, D] twice, C =
`decode_dispatch.local_capacity` of its n K assignments (``moe_capacity_factor`` x the expected n K / chips per
destination, in whole 16-row tiles; 744B, batch 2048 on 64 chips: 32 x 8 / 64 = 4 expected, C = 16). The
worst case, n x min(K, local experts) per destination, is a buffer as large as the gather's, so an assignment
past C for one destination is dropped: its term is zero and it is counted (``dropped``, the MoE aux
"dropped"). A token's K choices are distinct experts, so with the factor at n_experts / K (C = n x min(K,
local experts)) none can be dropped. Tokens that do not split over the expert axis (batch 1) take the gather
dispatch, which then gathers nothing.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.moe import int4_weights
from glm5_jax.model.moe.decode_dispatch import (chip_blocks, chip_weights, dispatch_axes, expert_operands,
                                                 gathered_moe, int4_swiglu_blocks, local_capacity, local_swiglu,
                                                 sort_by_key, stacked_int4_operands)
from glm5_jax.model.moe.experts import block_layout, ceil_div_nonneg, div_nonneg
from glm5_jax.model.moe.expert_parallel import rank_within_expert, tile_rows
from glm5_jax.parallel.ragged_exchange import ragged_all_to_all
from pallas_kernels.impls import PALLAS_IMPLS
from pallas_kernels.int4_moe_rows import ops as int4_moe_rows_ops


def destination_capacity(n_tokens: int, top_k: int, n_experts: int, n_local: int, factor: float) -> int:
    """Send slots per destination chip for a chip's ``n_tokens`` tokens: ``factor`` x the expected share of its
    assignments in whole sublane tiles (`local_capacity`), at most the worst case n x min(K, n_local) (each
    token's K experts are distinct)."""
    return min(local_capacity(n_tokens * top_k, n_local, n_experts, factor), n_tokens * min(top_k, n_local))


def send_slots(expert_idx_nK, n_local: int, n_dest: int, cap: int):
    """Where a chip's assignments go: (slot_M: assignment m's send slot, dest * cap + its rank among the chip's
    assignments to dest in token order, ``n_dest * cap`` when dropped; assignment_S: the assignment in each
    slot, n K when empty; dropped: how many ranked past ``cap``)."""
    flat = expert_idx_nK.reshape(-1)
    M = flat.shape[0]
    dest = flat // n_local
    _, rank, _ = rank_within_expert(dest, n_dest)
    kept = rank < cap
    slot = jnp.where(kept, dest * cap + rank, n_dest * cap)
    assignment = jnp.full((n_dest * cap,), M, jnp.int32).at[slot].set(jnp.arange(M, dtype=jnp.int32), mode="drop")
    return slot, assignment, jnp.sum(~kept).astype(jnp.int32)


def ragged_plan(sizes_SR, me, capacity: int):
    """The ragged exchange's bookkeeping from every chip's assignment counts ``sizes_SR`` [senders, receivers]
    (identical on all chips) for chip ``me``: each receiver takes at most ``capacity`` rows, its senders'
    slices kept in sender order (a slice past the capacity cut to what fits, the rest of it dropped) ->
    dict of [chips] int32: ``send`` (kept rows to each receiver), ``send_offset`` (each slice's start in this
    chip's rows sorted by receiver), ``land`` (where each slice lands on its receiver), ``recv`` (kept rows from
    each sender), ``recv_offset`` (where each sender's slice lands here), ``back`` (where each sender's rows start
    in its sorted rows: the return slices' landing), and ``dropped`` (this chip's rows cut, a scalar)."""
    before = lambda a: jnp.cumsum(a, axis=0) - a                        # noqa: E731  exclusive prefix sums
    kept = jnp.clip(capacity - before(sizes_SR), 0, sizes_SR)             # [S, R]: senders in order per receiver
    landing = before(kept)                                                # [S, R]: where s's slice lands on r
    starts = jnp.cumsum(sizes_SR, axis=1) - sizes_SR                      # [S, R]: s's slice for r in s's rows
    return {"send": kept[me], "send_offset": starts[me], "land": landing[me], "recv": kept[:, me],
            "recv_offset": landing[:, me], "back": starts[:, me], "dropped": jnp.sum(sizes_SR[me] - kept[me])}


def with_key(rows, key_R):
    """``rows`` [R, D] or [R, D / 128, 128] with each row's local expert ``key_R`` (a small non-negative int)
    carried as a value of the rows' dtype at the end (2D: one extra column; tiled: one extra [1, 128] tile), so
    that one exchange moves both (`split_key`). Integers up to 256 are exact in bf16 (8 significant bits)."""
    value = key_R.astype(rows.dtype)
    if rows.ndim == 2:
        return jnp.concatenate([rows, value[:, None]], axis=1)
    tile = jnp.zeros((rows.shape[0], 1, rows.shape[2]), rows.dtype).at[:, 0, 0].set(value)
    return jnp.concatenate([rows, tile], axis=1)


def split_key(rows_k):
    """(rows, key [R] int32) from `with_key`'s rows."""
    if rows_k.ndim == 2:
        return rows_k[:, :-1], rows_k[:, -1].astype(jnp.int32)
    return rows_k[:, :-1], rows_k[:, -1, 0].astype(jnp.int32)


def expert_rows(rows_R, key_R, weights, cfg: ModelConfig, block, cost_blocks):
    """SwiGLU of each received row by its local expert ``key_R`` (n_local: an empty slot) -> [R, ...] in the
    compute dtype, shaped as ``rows_R`` ([R, D] or `tile_rows`' [R, D / 128, 128]); empty slots' rows unspecified.
    The rows are gathered straight into the expert-sorted layout the expert products take (the INT4 kernel's
    row blocks, `block_layout`; the grouped matmul's sorted rows) and each row's output gathered back from it;
    through the one-call kernel (`rows_kernel_applies`) the same blocks are only a slot table: the kernel DMAs
    each slot's row in and its result back to the row's place."""
    R, D, dt = rows_R.shape[0], math.prod(rows_R.shape[1:]), cfg.jnp_dtype
    int4 = isinstance(weights[0], int4_weights.Int4Weight)
    n_local = weights[0].packed.shape[-3] if int4 else weights[0].shape[0]
    order, group_sizes = sort_by_key(key_R, n_local)
    take = lambda x, rows: x.at[rows].get(mode="clip")                   # noqa: E731   (out of range: unread)
    if int4:
        src, block_expert, _, dest = block_layout(group_sizes, R, block)  # src: the sorted row in each slot
        block_expert = jnp.minimum(block_expert, n_local - 1)
        n_used = jnp.sum(ceil_div_nonneg(group_sizes[:n_local], block)).astype(jnp.int32)
        if rows_kernel_applies(cfg, rows_R):
            slot_row = jnp.where(src < R, take(order, src), R).astype(jnp.int32)   # the received row in each slot
            return int4_moe_rows_ops.int4_moe_rows(
                rows_R.astype(dt), slot_row, block_expert, n_used,
                *stacked_int4_operands(weights), group_size=cfg.quant_group_size, dtype=dt,
                impl=cfg.runtime.quant_matmul, cost_blocks=cost_blocks)
        x_blocks = take(rows_R, take(order, src)).astype(dt).reshape(-1, block, D)
        y = int4_swiglu_blocks(x_blocks, block_expert, n_used, weights, dt, cfg, cost_blocks).reshape(-1, D)
    else:
        dest = jnp.arange(R, dtype=jnp.int32)                           # each sorted row's place
        y = local_swiglu(take(rows_R, order).astype(dt).reshape(R, D), group_sizes, weights, dt, cfg)
    slot_of_row = jnp.zeros((R,), jnp.int32).at[order].set(dest)         # received row -> its output row
    return take(tile_rows(y.astype(dt)), slot_of_row).reshape(rows_R.shape)


def rows_kernel_applies(cfg: ModelConfig, rows_R) -> bool:
    """Whether a chip's received rows take the one-call INT4 kernel (``decode_moe_kernel``,
    pallas_kernels/int4_moe_rows): rows laid out [R, D / 128, 128] (`tile_rows`), a Pallas quant_matmul, no
    SwiGLU clamp."""
    return (cfg.runtime.decode_moe_kernel and cfg.runtime.quant_matmul in PALLAS_IMPLS and cfg.swiglu_limit is None
            and rows_R.ndim == 3)


def a2a_moe(x_ND, expert_idx_NK, gates_NK, w_gate, w_up, w_down, cfg: ModelConfig):
    """sum_k gates[n, k] SwiGLU_{expert_idx[n,k]}(x[n]) -> ([N, D] fp32, the assignments dropped over capacity,
    summed over the token shards), the experts resident on the chips of the expert axis (module docstring).
    Weights as `decode_dispatch.gathered_moe`'s."""
    N, K = expert_idx_NK.shape
    E = cfg.n_routed_experts
    mesh, ep, mlp, batch = dispatch_axes(N)
    if not ep or any(a not in batch for a in ep):        # tokens replicated over the expert axis: nothing to send
        return gathered_moe(x_ND, expert_idx_NK, gates_NK, w_gate, w_up, w_down, cfg), jnp.zeros((), jnp.int32)
    n_ep = math.prod(mesh.shape[a] for a in ep)
    n_local = E // n_ep
    n = N // math.prod(mesh.shape[a] for a in batch)                    # tokens per chip
    cap = destination_capacity(n, K, E, n_local, cfg.runtime.moe_capacity_factor)
    # a chip's experts take the expert group's n x chips tokens' choices, as with "gather": the same blocks
    block, cost_blocks = chip_blocks(n * n_ep, cfg, n_local, n_ep * math.prod(
        mesh.shape[a] for a in batch if a not in ep))
    dt = cfg.jnp_dtype

    def slots_body(x, idx, gates, *w):
        D = x.shape[-1]
        slot, assignment, dropped = send_slots(idx, n_local, n_ep, cap)
        filled = assignment < n * K
        # rows as [R, D / 128, 128] (`tile_rows`: a row gather moves the row's bytes, not its tile neighbours')
        send = tile_rows(x.astype(dt)).at[assignment // K].get(mode="clip")  # empty slots: unspecified rows
        key = jnp.where(filled, idx.reshape(-1).at[assignment].get(mode="clip") % n_local, n_local)
        to_experts = lambda a: jax.lax.all_to_all(a.reshape(n_ep, cap, *a.shape[1:]), ep, 0, 0,  # noqa: E731
                                                  tiled=True).reshape(a.shape)
        rows, row_key = to_experts(send), to_experts(key.astype(jnp.int32))     # by source chip, then slot
        y = expert_rows(rows, row_key, chip_weights(w), cfg, block, cost_blocks)
        if mlp:
            y = jax.lax.psum(y, mlp)
        back = to_experts(y)                                                     # each send slot's SwiGLU
        y_nKD = back.at[slot].get(mode="fill", fill_value=0).reshape(n, K, D)   # dropped: zero
        out = jnp.einsum("nk,nkd->nd", gates.astype(jnp.float32), y_nKD.astype(jnp.float32))
        return out, jax.lax.psum(dropped, batch)

    # ragged: each assignment's row sent alone, a chip receiving at most the factor x its expected rows
    exact = 2 ** (jnp.finfo(dt).nmant + 1)                              # consecutive integers exact in dt
    if n_local > exact:
        raise ValueError(f"a2a_moe: {n_local} local experts; the ragged exchange carries a row's local expert as a "
                         f"{jnp.dtype(dt).name} value, exact up to {exact}")
    received = local_capacity(n * n_ep * K, n_local, E, cfg.runtime.moe_capacity_factor)
    impl = "native" if cfg.runtime.decode_a2a_exchange == "ragged" else "dense"

    def ragged_body(x, idx, gates, *w):
        D = x.shape[-1]
        flat = idx.reshape(-1)
        dest = div_nonneg(flat, n_local)
        order = jnp.argsort(dest, stable=True)                       # this chip's assignments by receiver
        counts = jnp.bincount(dest, length=n_ep).astype(jnp.int32)
        plan = ragged_plan(jax.lax.all_gather(counts, ep), jax.lax.axis_index(ep), received)
        exchange_rows = lambda a, out, there: ragged_all_to_all(  # noqa: E731
            a, out, *there, axis_name=ep, impl=impl)
        there = (plan["send_offset"], plan["send"], plan["land"], plan["recv"])
        # rows as [., D / 128, 128] (`tile_rows`), each with its local expert in its bits: one exchange
        tiled = tile_rows(x.astype(dt))
        sent = with_key(tiled[div_nonneg(order, K)], (flat - dest * n_local)[order])   # key: the local expert
        unfilled = with_key(jnp.zeros((received,) + tiled.shape[1:], dt),
                            jnp.full((received,), n_local, jnp.int32))              # no expert
        rows, row_key = split_key(exchange_rows(sent, unfilled, there))
        y = expert_rows(rows, row_key, chip_weights(w), cfg, block, cost_blocks)
        if mlp:
            y = jax.lax.psum(y, mlp)
        back = exchange_rows(y, jnp.zeros((n * K,) + y.shape[1:], y.dtype),
                             (plan["recv_offset"], plan["recv"], plan["back"], plan["send"]))  # dropped: zero
        y_nKD = jnp.zeros_like(back).at[order].set(back).reshape(n, K, D)
        out = jnp.einsum("nk,nkd->nd", gates.astype(jnp.float32), y_nKD.astype(jnp.float32))
        return out, jax.lax.psum(plan["dropped"], batch)

    tok = P(batch, None)
    operands, specs = expert_operands(w_gate, w_up, w_down, ep, mlp)
    body = slots_body if cfg.runtime.decode_a2a_exchange == "slots" else ragged_body
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *specs), out_specs=(tok, P()),
                         check_vma=False)(x_ND, expert_idx_NK, gates_NK, *operands)
