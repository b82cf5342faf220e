"""Tiny checkpoints for the converter tests: HF-saved GLM-5 / DeepSeek-V3.2 models and synthetic ones."""
from __future__ import annotations

import os

import numpy as np

from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint

GLM_KW = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
              topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
              index_n_heads=16, index_head_dim=32, index_topk=8, first_k_dense_replace=1, max_position_embeddings=256,
              rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def save_hf_model(out_dir: str, family: str = "glm", dtype: str = "float32", seed: int = 0) -> str:
    """A random tiny transformers model saved with save_pretrained (norms and routing bias perturbed)."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from hf_reference import perturbed

    torch.manual_seed(seed)
    if family == "glm":
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**GLM_KW, attn_implementation="eager"))
    else:
        kw = {**GLM_KW, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "rope_parameters": YARN}
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kw, attn_implementation="eager"))
    model = perturbed(model).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    return out_dir


def hf_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


def assert_same_tensors(dir_a: str, dir_b: str) -> int:
    """Same key set; every tensor with the same dtype, shape and bytes. Returns the tensor count."""
    a, b = SafetensorsCheckpoint(dir_a), SafetensorsCheckpoint(dir_b)
    assert set(a.keys()) == set(b.keys()), sorted(set(a.keys()) ^ set(b.keys()))[:5]
    for key in a.keys():
        x, y = a.raw(key), b.raw(key)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (key, x.dtype, x.shape, y.dtype, y.shape)
        assert x.tobytes() == y.tobytes(), key
    return len(a.keys())


def siblings(path: str) -> list[str]:
    """Entries next to `path` that share its name (temporary or partial outputs)."""
    parent, name = os.path.split(os.path.abspath(path))
    return sorted(e for e in os.listdir(parent) if name in e)
