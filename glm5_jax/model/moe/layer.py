"""Mixture of experts (GLM-5 / DeepSeek-V3): sigmoid router with a selection-only correction bias,
group-limited top-k, normalised and scaled gates, sorted grouped expert matmuls, a shared expert.

route -> routed experts' SwiGLU (grouped matmuls by ``ModelConfig.moe_impl``) -> gate-weighted combine.
The routed experts never run as a compute-every-expert einsum: the N*K (token, expert) assignments are
sorted by expert and fed to grouped matmuls (glm5_jax/model/moe/experts.py), so FLOPs are those of the K chosen
experts only. ``moe_impl="blocked"`` is a separate implementation for XLA:CPU (glm5_jax/model/moe/blocked.py);
expert parallelism over a mesh is glm5_jax/model/moe/expert_parallel.py.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model import routing_replay
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layers import SwiGLU, constrain, logical_param, normal_init
from glm5_jax.model.moe import decode_a2a, decode_dispatch, int4_swiglu, int4_weights
from glm5_jax.model.moe.blocked import BLOCKED_MOE_NAMES, blocked_swiglu
from glm5_jax.model.moe.expert_parallel import expert_parallel_swiglu
from glm5_jax.model.moe.experts import EXPERT_OUT_NAME, KERNEL_IMPLS, sorted_swiglu
from glm5_jax.parallel.axes import ACT_EMBED, BATCH, EMBED, EXP, MLP_MOE, SEQ
from glm5_jax.parallel.shard_map import logical_axis_shards, logical_shard_map, multi_device_mesh_in_context
from pallas_kernels.impls import AUTO, BLOCKED, PALLAS_IMPLS, RAGGED_DOT
from pallas_kernels.router_topk import kernel as router_topk_kernel, ops as router_topk_ops

__all__ = ["BIAS_COLLECTION", "BLOCKED_MOE_NAMES", "MoE", "grouped_swiglu", "route", "sequence_balance_loss"]

DECODE_DISPATCHES = ("gather", "a2a_decode")   # moe_ep values of the decode step's routed experts
BIAS_COLLECTION = "moe_bias"   # non-trainable: updated by the balancing rule, never by gradients


def route(scores_NE, bias_E, cfg: ModelConfig, replay_NK=None):
    """Expert choice: indices [N,K] chosen on sigmoid + bias, gates [N,K] from the unbiased sigmoid. With
    ``replay_NK`` the recorded tokens' experts are taken from it (glm5_jax/model/routing_replay.py), their
    gates still from this forward's scores. Without expert groups or replay, a Pallas ``router_impl`` makes
    the choice in one kernel (pallas_kernels/router_topk; decoding only)."""
    N, E = scores_NE.shape
    if replay_NK is None and cfg.n_group == 1 and cfg.runtime.router_impl in PALLAS_IMPLS:
        routed = _route_kernel(scores_NE, bias_E, cfg)
        if routed is not None:
            return routed
    biased = scores_NE + bias_E
    if cfg.n_group > 1:
        grouped = biased.reshape(N, cfg.n_group, E // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                        # top-2 sum per group
        _, kept_groups = jax.lax.top_k(group_score, cfg.topk_group)
        # per token (vmap), not an iota token index: see pallas_kernels/masking.py selection_mask (a token axis
        # that does not divide its shards must not scatter through padded indices)
        keep = jax.vmap(lambda g: jnp.zeros((cfg.n_group,), bool).at[g].set(True))(kept_groups)
        biased = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, E)
    _, expert_idx = jax.lax.top_k(biased, cfg.num_experts_per_tok)
    if replay_NK is not None:
        expert_idx = routing_replay.replay_experts(expert_idx, replay_NK)
    gates = jnp.take_along_axis(scores_NE, expert_idx, axis=-1)                  # unbiased: the bias only selects
    if cfg.norm_topk_prob:
        gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
    return expert_idx.astype(jnp.int32), gates * cfg.routed_scaling_factor


def _route_kernel(scores_NE, bias_E, cfg: ModelConfig):
    """`route` by pallas_kernels/router_topk (``router_impl``), per token shard; None where a shard holds more
    tokens than the kernel takes."""
    N = scores_NE.shape[0]
    shards = logical_axis_shards(BATCH) if multi_device_mesh_in_context() else 1
    if (N // shards if N % shards == 0 else N) > router_topk_kernel.MAX_TOKENS:    # indivisible: replicated
        return None

    def choose(scores, bias):
        return router_topk_ops.route_topk(scores, bias, top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob,
                                          scale=cfg.routed_scaling_factor, impl=cfg.runtime.router_impl)

    tokens = (BATCH, None)
    return logical_shard_map(choose, in_axes=(tokens, (None,)), out_axes=(tokens, tokens))(scores_NE, bias_E)


def grouped_swiglu(x_ND, expert_idx_NK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, impl=RAGGED_DOT, limit=None):
    """y[n, k] = SwiGLU_{expert_idx[n,k]}(x[n]) -> [N, K, D] (fp32), by ``impl`` (a ``ModelConfig.moe_impl``).

    On a multi-device mesh (no expert parallelism) the Pallas kernels run per token shard with the expert
    weights gathered whole; "auto" there stays with ragged_dot, which XLA partitions itself.
    """
    if impl == BLOCKED:
        assert limit is None, "the blocked experts have no clamped SwiGLU (ModelConfig validates this)"
        return blocked_swiglu(x_ND, expert_idx_NK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype)
    if impl == AUTO and multi_device_mesh_in_context():
        impl = RAGGED_DOT
    if impl not in KERNEL_IMPLS:
        return sorted_swiglu(x_ND, expert_idx_NK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, impl, limit)
    tokens, experts = (BATCH, None), (None, None, None)
    per_shard = logical_shard_map(lambda *a: sorted_swiglu(*a, dtype, impl, limit), (tokens, tokens) + (experts,) * 3,
                                  (BATCH, None, None))
    return per_shard(x_ND, expert_idx_NK, w_gate_EDF, w_up_EDF, w_down_EFD)


def sequence_balance_loss(scores_BTE, expert_idx_BTK, token_mask_BT, num_experts, top_k):
    """DeepSeek-V3 sequence-wise balance term Σ_i f_i P_i per sequence, averaged over sequences."""
    mask = token_mask_BT.astype(jnp.float32)
    n_tokens = jnp.maximum(mask.sum(-1), 1.0)                                     # [B]
    chosen = jax.nn.one_hot(expert_idx_BTK, num_experts, dtype=jnp.float32).sum(-2)   # [B,T,E]
    f = num_experts / top_k * jnp.einsum("bte,bt->be", chosen, mask) / n_tokens[:, None]
    normed = scores_BTE / scores_BTE.sum(-1, keepdims=True)
    p = jnp.einsum("bte,bt->be", normed, mask) / n_tokens[:, None]
    return jnp.mean(jnp.sum(f * p, axis=-1))


class MoE(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, token_mask_BT, layer_index=None, replay_BTK=None):
        """``layer_index``: the scanned layer's index, with ``decode_stacked_experts`` (int4_weights.py);
        ``replay_BTK``: recorded experts to route by (glm5_jax/model/routing_replay.py). The aux dict's
        "expert_idx" [B, T, K] is the routing used."""
        cfg = self.cfg
        B, T, D = x_BTD.shape
        E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
        init, dt = normal_init(cfg), cfg.jnp_dtype
        # Router weight stays fp32 whatever param_dtype is (HF keeps it in fp32).
        w_router = logical_param(self, "router", (D, E), (EMBED, None), init, jnp.float32)
        bias = self.variable(BIAS_COLLECTION, "e_score_correction_bias",
                             nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                             jax.random.PRNGKey(0), (E,), jnp.float32)
        # routed-expert weights under ModelConfig.quant (glm5_jax/model/moe/int4_weights.py): fp, fake-quantised
        # INT4 (QAT), dequantised INT4, or packed INT4 for the Pallas dequantise-matmul
        w_gate = int4_weights.expert_weight(self, "gate_proj", (E, D, F), (EXP, EMBED, MLP_MOE), init, cfg,
                                            layer_index)
        w_up = int4_weights.expert_weight(self, "up_proj", (E, D, F), (EXP, EMBED, MLP_MOE), init, cfg,
                                          layer_index)
        w_down = int4_weights.expert_weight(self, "down_proj", (E, F, D), (EXP, MLP_MOE, EMBED), init, cfg,
                                            layer_index)

        if isinstance(w_gate, int4_weights.StackedWeight) and cfg.runtime.moe_ep != "gather":
            # stacked fp experts are read in place only by the gathered decode's kernel: the others take the slice
            w_gate, w_up, w_down = (w.of_layer() for w in (w_gate, w_up, w_down))

        x_ND = x_BTD.reshape(B * T, D)
        scores = jax.nn.sigmoid(jnp.dot(x_ND.astype(jnp.float32), w_router.astype(jnp.float32),
                                        precision=jax.lax.Precision.HIGHEST))          # [N,E] fp32
        replay = None if replay_BTK is None else replay_BTK.reshape(B * T, -1)
        expert_idx, gates = route(scores, nn.unbox(bias.value), cfg, replay)
        dropped = None
        # decode dispatches (moe/decode_dispatch.py, moe/decode_a2a.py): the gate-weighted sum per token comes back
        gathered = cfg.runtime.moe_ep in DECODE_DISPATCHES and not self.is_initializing()
        if gathered and cfg.runtime.moe_ep == "a2a_decode":
            routed, dropped = decode_a2a.a2a_moe(x_ND, expert_idx, gates, w_gate, w_up, w_down, cfg)
        elif gathered:
            routed = decode_dispatch.gathered_moe(x_ND, expert_idx, gates, w_gate, w_up, w_down, cfg)
        elif isinstance(w_gate, int4_weights.Int4Weight):              # packed INT4 experts, Pallas kernel
            y_NKD = int4_swiglu.grouped_swiglu(x_ND, expert_idx, w_gate, w_up, w_down, dt, cfg)
        elif self.is_initializing():   # only the variables matter; init's dummy batch need not split over the mesh
            y_NKD = grouped_swiglu(x_ND, expert_idx, w_gate, w_up, w_down, dt, RAGGED_DOT, cfg.swiglu_limit)
        elif cfg.runtime.moe_ep == "none":
            y_NKD = grouped_swiglu(x_ND, expert_idx, w_gate, w_up, w_down, dt, cfg.runtime.moe_impl, cfg.swiglu_limit)
        else:   # expert parallel over the mesh in context (glm5_jax/model/moe/expert_parallel.py)
            y_NKD, dropped = expert_parallel_swiglu(x_ND, expert_idx, w_gate, w_up, w_down, cfg)
        if not gathered:
            y_NKD = checkpoint_name(y_NKD, EXPERT_OUT_NAME)
            routed = jnp.einsum("nk,nkd->nd", gates, y_NKD)                             # fp32 accumulation
        out = routed.reshape(B, T, D)
        if cfg.n_shared_experts:
            out = out + SwiGLU(cfg, cfg.n_shared_experts * F, name="shared_expert")(x_BTD).astype(jnp.float32)

        mask = token_mask_BT.reshape(-1).astype(jnp.float32)
        aux = {
            "expert_load": jnp.zeros((E,), jnp.float32).at[expert_idx.reshape(-1)].add(
                jnp.repeat(mask, cfg.num_experts_per_tok)),
            "balance_loss": sequence_balance_loss(scores.reshape(B, T, E), expert_idx.reshape(B, T, -1),
                                                  token_mask_BT, E, cfg.num_experts_per_tok),
        }
        aux["expert_idx"] = expert_idx.reshape(B, T, -1)
        if dropped is not None:
            aux["dropped"] = dropped.astype(jnp.float32)          # assignments over expert capacity
        return constrain(out.astype(dt), (BATCH, SEQ, ACT_EMBED)), aux
