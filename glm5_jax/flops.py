"""Model FLOPs per token and the device's measured matmul peak, for MFU (model FLOPs utilisation).

Training FLOPs per token = 6 x (matmul parameters one token uses) + 3 x forward attention FLOPs over
the keys it actually attends (DSA: min(k, visible); dense: all visible keys), indexer included. The
embedding lookup is not a matmul and is excluded; the LM head is included.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from glm5_jax.param_count import count_params


def mean_visible_keys(seq_len: int, topk: int | None) -> float:
    """Average over causal positions 0..T-1 of the keys attended: min(t + 1, k)."""
    keys = [min(t + 1, topk) if topk else t + 1 for t in range(seq_len)]
    return sum(keys) / seq_len


def train_flops_per_token(cfg, seq_len: int, sparse: bool = True, params=None) -> dict[str, float]:
    counts = count_params(cfg, params)
    matmul_params = counts["active"] - cfg.vocab_size * cfg.hidden_size   # drop the embedding table
    H, L = cfg.num_attention_heads, cfg.num_hidden_layers
    attended = mean_visible_keys(seq_len, cfg.index_topk if (sparse and cfg.use_indexer) else None)
    attention_fwd = 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * attended * L
    indexer_fwd = 0.0
    if cfg.use_indexer:
        n_full = sum(t == "full" for t in cfg.layer_indexer_types)
        indexer_fwd = 2 * cfg.index_n_heads * cfg.index_head_dim * mean_visible_keys(seq_len, None) * n_full
    return {"matmul": 6.0 * matmul_params, "attention": 3.0 * attention_fwd, "indexer": 3.0 * indexer_fwd,
            "total": 6.0 * matmul_params + 3.0 * (attention_fwd + indexer_fwd)}


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
