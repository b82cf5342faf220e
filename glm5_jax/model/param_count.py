"""Parameter counts from shapes alone (`jax.eval_shape`; nothing is allocated)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax.core import meta

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.transformer import Transformer

ROUTED_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def abstract_variables(cfg: ModelConfig):
    """ShapeDtypeStructs of every variable collection of `Transformer(cfg)`, no allocation."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: Transformer(cfg).init(jax.random.PRNGKey(0), t), tokens)


def count_params(cfg: ModelConfig, params=None) -> dict[str, int]:
    """Main-stack parameters (embedding, layers, final norm, head) as "total"; those one token uses
    ("active": K of E routed experts, docs/architecture.md#notation-and-sizes; "active_without_embeddings" also drops
    the embedding
    table and the head); "mtp": the MTP module's own parameters (it shares embedding and head).
    `params` (arrays or shapes) saves tracing the model when the caller already has them."""
    params = meta.unbox(abstract_variables(cfg)["params"] if params is None else params)
    total = mtp = routed = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [getattr(k, "key", str(k)) for k in path]
        n = math.prod(leaf.shape)
        if names[0] == "mtp":
            mtp += n
            continue
        total += n
        if len(names) >= 2 and names[-2] == "moe" and names[-1] in ROUTED_EXPERT_LEAVES:
            routed += n
    inactive = routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) // max(cfg.n_routed_experts, 1)
    embeddings = 2 * cfg.vocab_size * cfg.hidden_size
    return {"total": total, "active": total - inactive, "active_without_embeddings": total - inactive - embeddings,
            "mtp": mtp}
