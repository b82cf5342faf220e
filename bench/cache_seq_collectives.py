"""The collectives of one decode step over a cache split on its slots (logical axis ``cache_seq``).

Compiles `Transformer.decode` for one token per row on CPU with fake devices, the cache's slot axis on a
4-way mesh axis (rules ``("cache_seq", "fsdp"), ("batch", "data")`` first), and prints every all-gather /
all-reduce / reduce-scatter / all-to-all / collective-permute of the optimized HLO with its result shape
and the computation it sits in (a ``lax.switch`` branch runs only when taken). docs/long_context.md reads
this list.

    python bench/cache_seq_collectives.py                        # XLA path, S = 8192, k = 64
    python bench/cache_seq_collectives.py --impl=pallas_interpret
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.core import meta  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax import ModelConfig, RuntimeConfig, Transformer  # noqa: E402
from glm5_jax.generate.decoding import decode_config  # noqa: E402
from glm5_jax.model.kv_cache import cache_shardings, constrain_cache, init_cache  # noqa: E402
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh  # noqa: E402

_COLLECTIVE = re.compile(r"%(\S+) = (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")


def tiny_config(slots, topk, impl):
    """Two layers (a full indexer, then one sharing its top-k), small widths: latent C = 48, d_I = 32."""
    return ModelConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1,
                       intermediate_size=96, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
                       qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20, index_n_heads=8, index_head_dim=32,
                       index_topk=topk, indexer_types=("full", "shared"), n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, n_group=2, topk_group=1, max_position_embeddings=2 * slots,
                       runtime=RuntimeConfig(attention_impl=impl))


def collectives(hlo_text):
    """[(computation, name, result shape, kind)] of the optimized HLO text."""
    out, computation = [], None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0].lstrip("%")
        m = _COLLECTIVE.search(line)
        if m:
            out.append((computation, m.group(1), m.group(2), m.group(3)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=8192)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--impl", default="xla", choices=["xla", "reference", "pallas_interpret"])
    args = p.parse_args()

    cfg = decode_config(tiny_config(args.slots, args.topk, args.impl))
    mesh = build_mesh(MeshConfig(data=1, fsdp=4, expert=1, tensor=1), jax.devices()[:4])
    rules = (("cache_seq", "fsdp"), ("batch", "data")) + DEFAULT_RULES
    model = Transformer(cfg)
    variables = meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))

    def step(v, tokens, positions, cache):
        logits, _, cache = model.apply(v, tokens, positions, jnp.ones_like(tokens), cache, method=Transformer.decode)
        return logits, constrain_cache(cache)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        cache = init_cache(cfg, 1, args.slots)["decoder"]
        cache = jax.device_put(cache, cache_shardings(cache, mesh, rules))
        variables = jax.device_put(variables, NamedSharding(mesh, P()))
        tokens = jnp.zeros((1, 1), jnp.int32)
        positions = jnp.full((1, 1), args.slots // 2, jnp.int32)
        text = jax.jit(step).lower(variables, tokens, positions, cache).compile().as_text()
    print(f"impl {args.impl}, S = {args.slots} slots over 4 shards, k = {args.topk}, latent width "
          f"{cfg.kv_lora_rank + cfg.qk_rope_head_dim}, index_head_dim {cfg.index_head_dim}")
    for computation, name, shape, kind in collectives(text):
        print(f"{kind:>18} {shape:<28} {name:<16} in {computation}")


if __name__ == "__main__":
    main()
