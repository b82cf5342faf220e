"""Tiny random GLM-5s for generation tests: DSA selection matters once a sequence exceeds index_topk."""
import functools

import jax
import jax.numpy as jnp
from flax.core import meta

from glm5_jax import ModelConfig, RuntimeConfig, Transformer

TINY = ModelConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, first_k_dense_replace=1,
                   intermediate_size=96, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
                   qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20, index_n_heads=8, index_head_dim=32,
                   index_topk=8, indexer_types=("full", "shared", "full", "shared"), n_routed_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1, initializer_range=0.1,
                   num_nextn_predict_layers=1, mtp_depth=2, max_position_embeddings=256,
                   runtime=RuntimeConfig(remat_policy="none"))


@functools.lru_cache(maxsize=8)
def _jitted_init(cfg):   # one compiled init per config, whatever the seed
    return jax.jit(lambda key: Transformer(cfg).init(key, jnp.zeros((1, 8), jnp.int32)))


@functools.lru_cache(maxsize=8)
def init_variables(cfg, seed=0):
    return meta.unbox(_jitted_init(cfg)(jax.random.PRNGKey(seed)))


def full_logits(cfg, variables, tokens_BT):
    return jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, jnp.asarray(tokens_BT))
