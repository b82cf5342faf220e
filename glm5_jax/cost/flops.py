"""Model FLOPs per token and the device's measured matmul peak, for MFU (model FLOPs utilisation).

Training FLOPs per token = 6 x (matmul parameters one token uses) + 3 x forward attention FLOPs over
the keys it actually attends (DSA: min(k, visible); dense: all visible keys) + the indexer: its scores
over every visible key (forward only) and 2 x the forward of the keys its KL loss covers (sparse stage:
the selected min(k, visible); otherwise every visible key). Given the stage's ``indexer_loss``, a step
that runs no KL ("none") counts none, and a dense-stage step without it runs no indexer at all (nor its
projections); the warm-up trains only the indexer, so the frozen model counts its forward alone (2 x
parameters, 1 x attention) and the indexer's projections their forward and weight gradient (4 x). The
embedding lookup is not a matmul and is excluded; the LM head is included.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from flax.core import meta

from glm5_jax.cost.categories import CATEGORIES, categorize_param
from glm5_jax.model.param_count import ROUTED_EXPERT_LEAVES, abstract_variables, count_params


def mla_layers(cfg) -> int:
    """Main layers with MLA attention (GLM-5: all; GLM-5.3-Flash: one in four, the rest KDA)."""
    return sum(a == "mla" for a in cfg.layer_attention_types)


def full_indexer_layers(cfg) -> int:
    """MLA layers that run their own indexer."""
    return sum(t == "full" and a == "mla" for t, a in zip(cfg.layer_indexer_types, cfg.layer_attention_types))


def selected_keys(cfg) -> int:
    """Keys a query's DSA selection holds at most: index_topk, plus the pooled indexer's tail."""
    tail = cfg.index_kpool - 1 if cfg.index_kpool is not None and cfg.index_kpool_always_select_tail else 0
    return cfg.index_topk + tail


def kda_core_fwd(cfg) -> float:
    """Forward FLOPs per token of the KDA layers' recurrence (pallas_kernels/kda): per head four
    state-sized products (decay, S^T k, the rank-1 update, S^T q) of K x V multiply-adds."""
    kda = len(cfg.layer_attention_types) - mla_layers(cfg)
    return 2 * 4 * cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim * kda


def mean_visible_keys(seq_len: int, topk: int | None) -> float:
    """Average over causal positions 0..T-1 of the keys attended: min(t + 1, k)."""
    keys = [min(t + 1, topk) if topk else t + 1 for t in range(seq_len)]
    return sum(keys) / seq_len


def indexer_weight_passes(sparse: bool, indexer_loss: str | None) -> float:
    """Matmul passes over the lightning indexer's projection weights per token, as multiples of its
    forward: 0 when the stage runs no indexer (dense attention without its KL loss), 2 in the warm-up
    (forward + weight gradient: its inputs are detached from the frozen model, so no input gradient),
    3 otherwise (forward + both gradients)."""
    if not sparse and indexer_loss == "none":
        return 0.0
    return 2.0 if indexer_loss == "warmup" else 3.0


def _is_indexer_weight(names: list[str]) -> bool:
    return "indexer" in names and names[-1] not in ("scale", "bias")


def _indexer_weights(params) -> int:
    """The main stack's indexer projection weights (the MTP's are its own category)."""
    return sum(math.prod(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if (names := [getattr(k, "key", str(k)) for k in path])[0] != "mtp" and _is_indexer_weight(names))


def train_flops_per_token(cfg, seq_len: int, sparse: bool = True, params=None,
                          indexer_loss: str | None = None) -> dict[str, float]:
    params = meta.unbox(abstract_variables(cfg)["params"] if params is None else params)   # traced once
    counts = count_params(cfg, params)
    passes = 1.0 if indexer_loss == "warmup" else 3.0      # the warm-up's frozen model: forward only
    # the indexer's projections run as the stage says (`indexer_weight_passes`), not as the frozen or
    # trained model around them
    indexer_weights = _indexer_weights(params) if cfg.use_indexer else 0
    matmul_params = counts["active"] - cfg.vocab_size * cfg.hidden_size - indexer_weights   # no embedding table
    indexer_weight_flops = 2 * indexer_weight_passes(sparse, indexer_loss) * indexer_weights
    H = cfg.num_attention_heads
    L = mla_layers(cfg)
    attended = mean_visible_keys(seq_len, selected_keys(cfg) if (sparse and cfg.use_indexer) else None)
    attention_fwd = 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * attended * L + kda_core_fwd(cfg)
    scores_fwd = kl_fwd = 0.0
    if cfg.use_indexer:
        # the indexer scores every visible key for the top-k (no gradient); its KL loss trains it on the
        # keys it is scored against: the selected min(k, visible) in the sparse stage, every visible key
        # in the warm-up (DeepSeek-V3.2 report, section 2.1), backward = 2 x that forward. The pooled indexer
        # (GLM-5.3-Flash) scores one key per pool of index_kpool tokens.
        per_key = 2 * cfg.index_n_heads * cfg.index_head_dim * full_indexer_layers(cfg)
        scored = mean_visible_keys(seq_len, None) / (cfg.index_kpool or 1)
        scores_fwd = per_key * scored if sparse or indexer_loss != "none" else 0.0
        kl_fwd = per_key * mean_visible_keys(seq_len, cfg.index_topk if sparse else None) \
            if indexer_loss != "none" else 0.0
    indexer = scores_fwd + 2.0 * kl_fwd
    matmul = 2 * passes * matmul_params + indexer_weight_flops
    return {"matmul": matmul, "attention": passes * attention_fwd, "indexer": indexer,
            "indexer_scores": scores_fwd, "indexer_kl": 2.0 * kl_fwd,
            "total": matmul + passes * attention_fwd + indexer}


def train_flops_by_category(cfg, seq_len: int, sparse: bool = True, params=None,
                            indexer_loss: str | None = None) -> dict[str, float]:
    """`train_flops_per_token` split like the compiled step's attribution (glm5_jax.cost.categories):
    6 x the matmul parameters of each part one token uses (routed experts: K of E, plus the router),
    attention core 3 x its forward, the indexer's scores behind the top-k (forward, no gradient) and its
    KL loss's gradient (2 x the forward over the keys the loss covers). "mtp" (per application x mtp_depth: its block, one
    layer of attention and indexer) and the MTP's second use of the shared LM head (in "lm_head_loss",
    where the compiled head's FLOPs land too) are not part of `train_flops_per_token`'s total; without
    them the categories sum to that total up to the norm weights it counts."""
    params = meta.unbox(abstract_variables(cfg)["params"] if params is None else params)
    active = cfg.num_experts_per_tok / max(cfg.n_routed_experts, 1)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [getattr(k, "key", str(k)) for k in path]
        cat = categorize_param(names)
        if cat is None:
            continue
        n = math.prod(leaf.shape)
        if len(names) >= 2 and names[-2] == "moe" and names[-1] in ROUTED_EXPERT_LEAVES:
            n *= active
        if _is_indexer_weight(names):
            out[cat] += 2 * indexer_weight_passes(sparse, indexer_loss) * n
        else:
            out[cat] += (2.0 if indexer_loss == "warmup" else 6.0) * n
    per_token = train_flops_per_token(cfg, seq_len, sparse=sparse, params=params, indexer_loss=indexer_loss)
    L = max(mla_layers(cfg), 1)
    out["attention_core"] = per_token["attention"]
    out["indexer_topk"] = per_token["indexer_scores"]
    out["indexer_kl"] = per_token["indexer_kl"]
    n_full = full_indexer_layers(cfg) if cfg.use_indexer else 0
    out["mtp"] = cfg.mtp_depth * (out["mtp"] + per_token["attention"] / L
                                  + (per_token["indexer"] / n_full if n_full else 0.0))
    out["lm_head_loss"] *= 1 + cfg.mtp_depth       # the MTP runs the shared head again (its HLO is the head's)
    return out


def measure_matmul_peak(n: int = 1024, dtype=jnp.float32, repeats: int = 5, min_seconds: float = 1.0) -> float:
    """Best achieved FLOP/s of a jitted n x n x n matmul on the default device, over at least
    ``repeats`` runs and ``min_seconds`` of them (a few runs can all land in a slow moment: CPU
    frequency ramp-up, a neighbour's burst)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return 2.0 * n ** 3 / best
