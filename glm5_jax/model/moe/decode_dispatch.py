"""Routed experts for a decode step: a few tokens per chip, experts resident on their chips.

``moe_ep="gather"`` (the sampling mesh, glm5_jax/parallel/sampling.py): experts split over the mesh axis of
the logical "exp" axis, each chip holding its experts whole (their F width possibly split over the axis of
"mlp_moe"). Per layer and chip:

    tokens x [N_local, D], choices and gates [N_local, K]  --all_gather over the expert axis-->  [N_g, ...]
    the assignments to this chip's experts, sorted by local expert  ->  grouped SwiGLU (bf16 grouped matmul,
    or the packed INT4 kernel: pallas_kernels/int4_matmul)  ->  gate-weighted sum per token y [N_g, D] (zero
    for tokens that chose none of this chip's experts)
    --sum over the expert axis (reduce-scatter back to each token's chip; plus the F-width axis)-->  [N_local, D]

A decode step carries a handful of tokens per chip, so gathering every token of the expert group (N_g x D
bf16: 12 KiB a token at GLM-5's D = 6144) costs less than the capacity bookkeeping of an all-to-all, and
no assignment is ever dropped. When the tokens do not split over the expert axis (batch 1) they are
replicated there and the results summed instead of reduce-scattered.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.moe import int4_weights
from glm5_jax.model.moe.experts import expert_blocks, max_blocks, swiglu_rows
from glm5_jax.parallel.axes import BATCH, EXP, MLP_MOE
from glm5_jax.parallel.shard_map import logical_mesh_axes
from pallas_kernels.impls import BLOCKED, PALLAS_IMPLS, RAGGED_DOT
from pallas_kernels.bf16_decode_moe import kernel as bf16_decode_moe_kernel, ops as bf16_decode_moe_ops
from pallas_kernels.int4_decode_moe import kernel as int4_decode_moe_kernel, ops as int4_decode_moe_ops
from pallas_kernels.int4_matmul import ops as int4_ops

INT4_MAX_BLOCK = 128        # rows per INT4 kernel block
ROW_MULTIPLE = 16           # sublane tile of bf16 activations


# at most this many gathered assignments per chip: the INT4 path lays its rows out by all-pairs comparisons
# (`compare_slots`, a few fusions), not a sort, a bincount, cumulative sums and scatters (~80 small ops)
COMPARE_MAX_ASSIGNMENTS = 128


def local_keys(expert_idx_M, first_expert, n_local):
    """Each assignment's local expert, ``n_local`` for another chip's."""
    local = expert_idx_M - first_expert
    return jnp.where((local >= 0) & (local < n_local), local, n_local)


def local_assignments(expert_idx_MK_flat, first_expert, n_local):
    """(order [M]: assignments sorted by local expert, other chips' last; group_sizes [n_local + 1], the last
    one counting the assignments to other chips' experts)."""
    return sort_by_key(local_keys(expert_idx_MK_flat, first_expert, n_local), n_local)


def sort_by_key(key_M, n_local):
    """(order: the assignments sorted by their `local_keys` ``key_M``, stable; group_sizes [n_local + 1])."""
    return jnp.argsort(key_M, stable=True), jnp.bincount(key_M, length=n_local + 1).astype(jnp.int32)


def compare_slots(key_M, n_local, cap, block, n_blocks):
    """The INT4 kernel's row layout of a chip's M assignments from all-pairs comparisons of their local experts
    ``key_M`` (`local_keys`): what sorting them by expert (stable, `local_assignments`), keeping the first ``cap``
    local ones and padding each expert's rows to whole blocks (`glm5_jax.model.moe.experts.expert_blocks`)
    give, in the blocks that run. -> (slot_PRM: [n_blocks P, rows per block R, M] True where a kept assignment
    sits, block_expert [P], n_used).

    An assignment's place among its expert's (``within``) and in the sorted order (``rank``) are counts over
    the others; the kept ones of an expert are its first, and those at a multiple of ``block`` each open one of
    its blocks: an assignment's slot is ``block`` x the blocks opened by kept assignments of lower experts, plus
    ``within``, and the assignment at a used block's first slot names the block's expert."""
    M = key_M.shape[0]
    i = np.arange(M)                                                        # index tables: host constants
    lower = key_M[None, :] < key_M[:, None]                                 # [i, j]: j's expert sorts before i's
    within = jnp.sum((key_M[None, :] == key_M[:, None]) & (i[None, :] < i[:, None]), axis=1)
    kept = (key_M < n_local) & (jnp.sum(lower, axis=1) + within < cap)      # the first cap in the stable sort
    opens = kept & (within % block == 0)
    dest = jnp.sum(lower & opens[None, :], axis=1) * block + within
    first_P = np.arange(n_blocks)[:, None] * block                          # each block's first slot
    slot_PRM = (dest == (first_P + np.arange(block))[:, :, None]) & kept    # in the kernel's block shape
    first_PM = (dest == first_P) & kept                                     # who sits at each block's first slot
    block_expert = jnp.where(jnp.any(first_PM, axis=1), jnp.sum(jnp.where(first_PM, key_M, 0), axis=1), n_local - 1)
    return slot_PRM, block_expert.astype(jnp.int32), jnp.sum(opens).astype(jnp.int32)


def int4_block_rows(rows: int) -> int:
    """Rows per INT4 kernel block for ``rows`` expected assignments on a chip: whole sublane tiles, at most
    `INT4_MAX_BLOCK` (few rows: one block per used expert, its INT4 words read once)."""
    return min(INT4_MAX_BLOCK, -(-max(rows, 1) // ROW_MULTIPLE) * ROW_MULTIPLE)


def touched_share(n_tokens: int, top_k: int, n_experts: int) -> float:
    """Expected share of the experts that ``n_tokens`` tokens choose at least once (uniform routing, each
    token K distinct experts): 1 - (1 - K / E)^N."""
    return 1.0 - (1.0 - top_k / n_experts) ** n_tokens


def block_count_pmf(n_tokens: int, top_k: int, n_experts: int, block: int) -> np.ndarray:
    """P(an expert's rows fill b blocks of ``block`` rows), b = 0, 1, ...: under uniform routing (each token
    chooses ``top_k`` distinct experts of ``n_experts``) an expert's rows R ~ Binomial(n_tokens, K / E) and
    its blocks are ceil(R / block)."""
    p = top_k / n_experts
    r = np.arange(n_tokens + 1)
    if p >= 1:                                      # every token chooses every expert
        rows = (r == n_tokens).astype(float)
    else:
        log_choose = np.array([math.lgamma(n_tokens + 1) - math.lgamma(k + 1) - math.lgamma(n_tokens - k + 1)
                               for k in r])
        rows = np.exp(log_choose + r * math.log(p) + (n_tokens - r) * math.log1p(-p))
    return np.bincount(-(-r // block), weights=rows)


def busiest_chip_blocks(n_tokens: int, top_k: int, n_experts: int, n_local: int, block: int, n_chips: int) -> float:
    """Expected INT4 kernel row blocks on the BUSIEST of ``n_chips`` chips holding ``n_local`` experts each, for
    ``n_tokens`` tokens (the kernel's cost hint: a synchronous step waits for that chip, kernel.py's grid
    runs the used blocks). A chip's blocks B = sum of its experts' ceil(R_e / block) (`block_count_pmf`);
    taking the experts, and the chips, as independent (their counts are weakly, negatively correlated:
    within ~1% of a Monte Carlo of the routing at GLM-5's shapes), B has the n_local-fold convolution of one
    expert's distribution F and E[max over chips] = sum_{b >= 0} (1 - P(B <= b)^n_chips). Batch 1 on 8 chips
    of 32 of 256 experts, K = 8: B ~ Binomial(32, 1/32), mean 1, E[max] ~ 2.5."""
    one = block_count_pmf(n_tokens, top_k, n_experts, block)
    chip = np.array([1.0])
    for _ in range(n_local):
        chip = np.convolve(chip, one)
    cdf = np.minimum(np.cumsum(chip), 1.0)
    return float(np.sum(1.0 - cdf ** n_chips))


def local_swiglu(x_sorted_MD, group_sizes, weights, dtype, cfg: ModelConfig):
    """SwiGLU of rows sorted by local expert (``group_sizes`` [E_local + 1]: the last group, other chips'
    experts, is not computed) through fp (bf16) experts -> [M, D] fp32, zero past the local groups (INT4
    experts: `int4_block_scatter`)."""
    w_gate, w_up, w_down = weights
    impl = RAGGED_DOT if cfg.runtime.moe_impl == BLOCKED else cfg.runtime.moe_impl
    return swiglu_rows(x_sorted_MD, group_sizes[:-1], w_gate, w_up, w_down, dtype, impl)


def int4_block_scatter(x_sorted_MD, take_M, group_sizes, gates_NK, k, n, weights, dtype, cfg: ModelConfig, block,
                       cost_blocks):
    """sum over a chip's kept assignments m of gates[take[m]] SwiGLU(x_sorted[m]) into token take[m] // k -> [n, D]
    fp32, INT4 experts: the kernel's row blocks added into their tokens straight from the block layout (the
    padding rows and the blocks past n_used dropped), not first gathered back into sorted order. The rows are
    added in the same order as from the sorted rows (blocks follow the sorted order), the non-local group's
    rows (zeros there) left out. Only the blocks of local experts run: the kernel's grid stops at n_used."""
    M = x_sorted_MD.shape[0]
    n_local = group_sizes.shape[0] - 1
    x_blocks, block_expert, _, dest = expert_blocks(x_sorted_MD, group_sizes, block)
    n_used = jnp.sum(-(-group_sizes[:n_local] // block)).astype(jnp.int32)
    y_blocks = int4_swiglu_blocks(x_blocks, jnp.minimum(block_expert, n_local - 1), n_used, weights, dtype, cfg,
                                  cost_blocks)
    R = y_blocks.shape[0] * block
    src_R = jnp.full((R,), M, jnp.int32).at[dest].set(jnp.arange(M, dtype=jnp.int32))   # sorted row of a slot
    assignment_R = take_M[jnp.minimum(src_R, M - 1)]
    used_R = (src_R < M) & (jnp.arange(R) // block < n_used)
    token_R = jnp.where(used_R, assignment_R // k, n)                 # n: out of range, dropped
    y_RD = y_blocks.reshape(R, -1) * gates_NK[assignment_R][:, None].astype(jnp.float32)
    return jnp.zeros((n, y_RD.shape[-1]), jnp.float32).at[token_R].add(y_RD, mode="drop")


def int4_swiglu_blocks(x_blocks, block_expert, n_used, weights, dtype, cfg: ModelConfig, cost_blocks):
    """SwiGLU of row blocks [n, block, D] through the INT4 kernel (block i by expert block_expert[i], blocks
    from n_used on unspecified) -> [n, block, D] fp32."""
    w_gate, w_up, w_down = weights

    def mm(x, w):
        return int4_ops.int4_block_matmul(x, block_expert, n_used, w.packed, w.scale,
                                          group_size=cfg.quant_group_size, impl=cfg.runtime.quant_matmul,
                                          cost_blocks=cost_blocks, layer=w.layer)

    h = (jax.nn.silu(mm(x_blocks, w_gate)) * mm(x_blocks, w_up)).astype(dtype)
    return mm(h, w_down)


def compare_int4_moe(x_nD, key_M, gates_M, weights, dtype, cfg: ModelConfig, cap, block, cost_blocks):
    """A chip's routed-expert sum for few assignments (``key_M``: `local_keys` of the n x K choices in token
    order, ``gates_M`` theirs) -> [n, D] fp32: the sorted path of `gathered_moe`'s body with its rows laid out
    by `compare_slots` (the same rows in the blocks that run, the same ``cap`` kept), rows moved by one-hot
    selects (each slot takes one token or none: exact), no gathers or scatters."""
    n, D = x_nD.shape
    M = key_M.shape[0]
    n_local = weights[0].packed.shape[-3]
    n_blocks = max_blocks(cap, n_local + 1, block)
    slot_PRM, block_expert, n_used = compare_slots(key_M, n_local, cap, block, n_blocks)
    token_PRMn = slot_PRM[..., None] & (np.arange(M)[:, None] // (M // n) == np.arange(n))
    slot_token_PRn = jnp.any(token_PRMn, axis=2)                          # slot (p, r) holds a row of token t
    x_PRD = jnp.sum(jnp.where(slot_token_PRn[..., None], x_nD.astype(dtype), 0), axis=2, dtype=dtype)
    y_PRD = int4_swiglu_blocks(x_PRD, block_expert, n_used, weights, dtype, cfg, cost_blocks)   # unspecified
    gate_PR = jnp.sum(jnp.where(slot_PRM, gates_M.astype(jnp.float32), 0.0), axis=2)         # past n_used
    y_PRnD = jnp.where(slot_token_PRn[..., None], (y_PRD * gate_PR[..., None])[:, :, None], 0.0)
    return jnp.sum(y_PRnD, axis=(0, 1))


def local_capacity(n_assignments: int, n_local: int, n_experts: int, factor: float) -> int:
    """Rows a chip's experts take per step: ``factor`` x their expected share of the gathered assignments, in
    whole sublane tiles, at most all of them."""
    return min(n_assignments, -(-math.ceil(factor * n_assignments * n_local / n_experts) // ROW_MULTIPLE) * ROW_MULTIPLE)


def dispatch_axes(n_tokens: int):
    """(mesh, ep, mlp, batch): the mesh in context and its axes > 1 of the logical "exp", "mlp_moe" and "batch"
    axes; ``batch`` empty when the ``n_tokens`` do not split over it (batch 1: every chip holds the token)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("the decode MoE dispatch needs a mesh in context (jax.set_mesh) and logical axis rules")
    ep, mlp, batch = (tuple(a for a in logical_mesh_axes(ax) if mesh.shape[a] > 1) for ax in (EXP, MLP_MOE, BATCH))
    if n_tokens % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    return mesh, ep, mlp, batch


def chip_blocks(n_seen: int, cfg: ModelConfig, n_local: int, n_chips: int) -> tuple[int, float]:
    """(rows per INT4 kernel block, the kernel's cost hint: the busiest chip's expected used blocks) for a chip
    whose experts see the choices of ``n_seen`` tokens, on ``n_chips`` chips with their own load."""
    K, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    block = int4_block_rows(-(-n_seen * K * n_local // E))
    return block, busiest_chip_blocks(n_seen, K, E, n_local, block, n_chips)


def expert_operands(w_gate, w_up, w_down, ep, mlp):
    """(operands, in_specs) of the routed-expert weights for a `shard_map` over ``ep`` (experts) and ``mlp``
    (their F width): [E, D, F], [E, D, F], [E, F, D] arrays, `Int4Weight`s as (words, scale) pairs and, when
    stacked over layers, the layer index, or `StackedWeight`s as their stacks and the layer index (`chip_weights`
    rebuilds them inside)."""
    in_up, in_down = P(ep or None, None, mlp or None), P(ep or None, mlp or None, None)
    stacked = lambda specs: tuple(P(None, *s) for s in specs) + (P(),)          # noqa: E731  [L, ...] + layer
    if isinstance(w_gate, int4_weights.StackedWeight):
        return (w_gate.stack, w_up.stack, w_down.stack, w_gate.layer), stacked((in_up, in_up, in_down))
    if not isinstance(w_gate, int4_weights.Int4Weight):
        return (w_gate, w_up, w_down), (in_up, in_up, in_down)
    operands = (w_gate.packed, w_gate.scale, w_up.packed, w_up.scale, w_down.packed, w_down.scale)
    specs = (in_up, in_up, in_up, in_up, in_down, in_down)
    if w_gate.layer is not None:               # stacked [L, E, ...]: the layer axis whole on every chip
        return operands + (w_gate.layer,), stacked(specs)
    return operands, specs


def chip_weights(w):
    """The (gate, up, down) weights inside the `shard_map` from `expert_operands`' operands."""
    if len(w) == 4:                             # stacked fp weights, then the layer
        return tuple(int4_weights.StackedWeight(a, w[3]) for a in w[:3])
    if len(w) < 6:
        return w
    layer = w[6] if len(w) == 7 else None       # packed (words, scale) pairs, then the layer if stacked
    return tuple(int4_weights.Int4Weight(*w[i:i + 2], layer) for i in (0, 2, 4))


def fused_moe_applies(cfg: ModelConfig, n_tokens: int, n_assignments: int, cap: int, w_gate) -> bool:
    """Whether a chip's routed-expert sum runs as a one-call kernel (``decode_moe_kernel``): packed INT4 experts
    through pallas_kernels/int4_decode_moe, stacked bf16 experts (`StackedWeight`) through
    pallas_kernels/bf16_decode_moe; few enough assignments and tokens, every assignment within the chip's
    capacity (the kernel keeps them all), a Pallas quant_matmul, no SwiGLU clamp."""
    if isinstance(w_gate, int4_weights.StackedWeight):
        kern = bf16_decode_moe_kernel
    elif isinstance(w_gate, int4_weights.Int4Weight):
        kern = int4_decode_moe_kernel
    else:
        return False
    return (cfg.runtime.decode_moe_kernel and cfg.runtime.quant_matmul in PALLAS_IMPLS and cfg.swiglu_limit is None
            and n_assignments <= kern.MAX_ASSIGNMENTS and n_tokens <= kern.ROWS and cap >= n_assignments)


def fused_moe(x_nD, expert_M, gates_M, weights, first, cfg: ModelConfig, cost_assignments):
    """A chip's routed-expert sum through the one-call kernel (`fused_moe_applies`): the assignments' expert ids
    ``expert_M``, the chip's experts ``first`` .. ``first`` + E_local - 1 (an int32 [1], the kernel's offset) ->
    [n, D] summed in fp32, rounded to the compute dtype as the other paths' sums are before the all-reduce;
    ``cost_assignments``: the kernel's declared busiest-chip local assignments."""
    if isinstance(weights[0], int4_weights.StackedWeight):
        return bf16_decode_moe_ops.bf16_decode_moe(
            x_nD, expert_M, gates_M, *(w.stack for w in weights), weights[0].layer, first, dtype=cfg.jnp_dtype,
            impl=cfg.runtime.quant_matmul, out_dtype=cfg.jnp_dtype, cost_assignments=cost_assignments)
    return int4_decode_moe_ops.int4_decode_moe(
        x_nD, expert_M, gates_M, *stacked_int4_operands(weights), first, group_size=cfg.quant_group_size,
        dtype=cfg.jnp_dtype, impl=cfg.runtime.quant_matmul, out_dtype=cfg.jnp_dtype,
        cost_assignments=cost_assignments)


def stacked_int4_operands(weights) -> tuple:
    """The one-call INT4 MoE kernels' weight operands from (gate, up, down) `Int4Weight`s: each (packed words,
    scales) pair stacked [L, E, ...] (a leading layer axis of 1 when the weights are one layer's), then the
    layer to read."""
    stacked = weights[0].layer is not None
    lead = (lambda a: a) if stacked else (lambda a: a[None])      # noqa: E731
    return (*(lead(a) for w in weights for a in (w.packed, w.scale)), weights[0].layer if stacked else 0)


def chip_expert_sum(x_nD, key_M, gates_M, weights, cfg: ModelConfig, cap, block, cost_blocks):
    """A chip's routed-expert sum over its first ``cap`` local assignments (in assignment order): row t of the
    result is sum over assignments m of row t (m // (M / n) == t, ``key_M[m]`` < n_local: `local_keys`) of
    gates[m] SwiGLU_{key[m]}(x[t]) -> [n, D] in the compute dtype. INT4 experts: the kernel's row layout by
    comparisons (few assignments, `compare_int4_moe`) or by sorting (`int4_block_scatter`); fp experts: the
    grouped matmul."""
    n, M, dt = x_nD.shape[0], key_M.shape[0], cfg.jnp_dtype
    k = M // n
    int4 = isinstance(weights[0], int4_weights.Int4Weight)
    n_local = weights[0].packed.shape[-3] if int4 else weights[0].shape[0]
    if int4 and M <= COMPARE_MAX_ASSIGNMENTS:
        return compare_int4_moe(x_nD, key_M, gates_M, weights, dt, cfg, cap, block, cost_blocks).astype(dt)
    order, group_sizes = sort_by_key(key_M, n_local)
    take = order[:cap]                                                  # this chip's assignments first
    kept = jnp.diff(jnp.minimum(jnp.cumsum(group_sizes[:n_local]), cap), prepend=0)
    sizes = jnp.append(kept, cap - jnp.sum(kept)).astype(jnp.int32)
    if int4:
        return int4_block_scatter(x_nD.astype(dt)[take // k], take, sizes, gates_M, k, n, weights, dt, cfg, block,
                                  cost_blocks).astype(dt)
    y_rows = local_swiglu(x_nD.astype(dt)[take // k], sizes, weights, dt, cfg)
    y_rows = y_rows * gates_M[take][:, None].astype(jnp.float32)                   # 0 past kept
    return jnp.zeros((n, y_rows.shape[-1]), jnp.float32).at[take // k].add(y_rows).astype(dt)


def gathered_moe(x_ND, expert_idx_NK, gates_NK, w_gate, w_up, w_down, cfg: ModelConfig):
    """The routed experts' gate-weighted sum sum_k gates[n, k] SwiGLU_{expert_idx[n,k]}(x[n]) -> [N, D] fp32, the
    experts resident on the chips of the expert axis (module docstring). Weights: [E, D, F], [E, D, F], [E, F, D]
    arrays, `Int4Weight`s (possibly stacked over layers with their layer index, read in place) or `StackedWeight`s.

    A chip takes at most `local_capacity` (``RuntimeConfig.moe_capacity_factor`` x its expected share) of the
    gathered assignments, its own experts' first in token order; assignments past it (none while routing is
    within the factor of uniform) add nothing."""
    N, K = expert_idx_NK.shape
    E = cfg.n_routed_experts
    mesh, ep, mlp, batch = dispatch_axes(N)
    gather = tuple(a for a in ep if a in batch)         # token shards the expert group gathers
    n_ep = math.prod(mesh.shape[a] for a in ep)
    n_local = E // n_ep
    n_seen = N // math.prod(mesh.shape[a] for a in batch) * math.prod(mesh.shape[a] for a in gather)
    cap = local_capacity(n_seen * K, n_local, E, cfg.runtime.moe_capacity_factor)
    # chips with their own load: the expert group's, times the token shards outside it (the tensor axis
    # splits each chip's experts' width, same load)
    n_chips = n_ep * math.prod(mesh.shape[a] for a in batch if a not in gather)
    block, cost_blocks = chip_blocks(n_seen, cfg, n_local, n_chips)
    fused = fused_moe_applies(cfg, n_seen, n_seen * K, cap, w_gate)
    # the one-call kernel's cost hint: the busiest chip's expected local assignments (blocks of one row)
    cost_assignments = busiest_chip_blocks(n_seen, K, E, n_local, 1, n_chips)

    def body(x, idx, gates, firsts, *w):
        if gather:
            x, idx, gates = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, idx, gates))
        if fused:
            y = fused_moe(x, idx.reshape(-1), gates.reshape(-1), chip_weights(w), firsts, cfg, cost_assignments)
        else:       # stacked fp weights: the layer's slice (a copy) for the grouped matmul
            weights = tuple(a.of_layer() if isinstance(a, int4_weights.StackedWeight) else a for a in chip_weights(w))
            y = chip_expert_sum(x, local_keys(idx.reshape(-1), firsts[0], n_local), gates.reshape(-1),
                                weights, cfg, cap, block, cost_blocks)
        if mlp:
            y = jax.lax.psum(y, mlp)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        rest = tuple(a for a in ep if a not in gather)
        return jax.lax.psum(y, rest) if rest else y

    tok = P(batch or None, None)
    operands, specs = expert_operands(w_gate, w_up, w_down, ep, mlp)
    # each chip's first expert as an operand split over the expert axis (a constant: no per-layer ops to find
    # the chip's place on the axis)
    firsts = np.arange(n_ep, dtype=np.int32) * n_local
    y = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, P(ep or None), *specs),
                      out_specs=P(batch or None, None), check_vma=False)(x_ND, expert_idx_NK, gates_NK, firsts,
                                                                         *operands)
    return y.astype(jnp.float32)
