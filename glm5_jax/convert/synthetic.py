"""A random hub-layout checkpoint for any config.json: the converter tests' and benchmark's input.

Writes exactly the tensors (names, shapes) the `hf.layout` table expects, MTP layer included, as
sharded safetensors with an index; optionally in the block-FP8 layout. Norm weights are drawn around
1 and other weights around 0 with std 0.02 so that models built from them produce finite logits.
"""
from __future__ import annotations

import json

import numpy as np

from glm5_jax import storage
from glm5_jax.convert import fp8 as fp8_layout
from glm5_jax.convert.hub_reader import scale_key
from glm5_jax.convert.plan import build_plan
from glm5_jax.convert.safetensors_writer import ShardedSafetensorsWriter, ShardLayout
from glm5_jax.hf.config import config_from_hf


def write_random_hub_checkpoint(out_dir: str, hf_config: dict, dtype=np.float32, seed: int = 0,
                                max_shard_bytes: int = 2**30, fp8: bool = False) -> None:
    cfg = config_from_hf(hf_config)
    plan = build_plan(cfg)
    tensors = []
    for leaf in plan:
        for key in leaf.hub_keys():
            if fp8 and fp8_layout.is_quantised(key):
                tensors += [(key, np.dtype("float8_e4m3fn"), leaf.hub_shape),
                            (scale_key(key), np.dtype(np.float32), fp8_layout.scale_shape(leaf.hub_shape))]
            else:
                dt = np.float32 if leaf.keep_fp32 else dtype
                tensors.append((key, np.dtype(dt), leaf.hub_shape))
    storage.makedirs(out_dir)
    config = dict(hf_config)
    if fp8:
        config["quantization_config"] = fp8_layout.quantization_config(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    storage.write_atomically(storage.join(out_dir, "config.json"), json.dumps(config, indent=2).encode())
    writer = ShardedSafetensorsWriter(out_dir, ShardLayout(tensors, max_shard_bytes))
    rng = np.random.default_rng(seed)
    for leaf in plan:
        for key in leaf.hub_keys():
            w = rng.standard_normal(leaf.hub_shape, dtype=np.float32)
            w = 1.0 + 0.1 * w if key.endswith("norm.weight") else 0.02 * w
            if fp8 and fp8_layout.is_quantised(key):
                w8, scale = fp8_layout.quantise_blocks(w)
                writer.write(key, w8)
                writer.write(scale_key(key), scale)
            else:
                writer.write(key, w.astype(np.float32 if leaf.keep_fp32 else dtype))
    writer.close()
