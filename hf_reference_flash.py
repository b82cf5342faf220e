"""Tiny random HF GLM-5.3-Flash (transformers' glm5_next) models: the numerical ground truth for the KDA
layers, the pooled indexer, the hyper-connections and the clamped SwiGLU.

Saved with save_pretrained as `Glm5NextForConditionalGeneration` (language model + a one-block vision
tower, which the loader skips). Shared by tests/ (at the repository root, like hf_reference.py)."""
import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from hf_reference import hf_logits, perturbed

# 5 layers: KDA, KDA, KDA (dense FFN), MLA, KDA (MoE); pools of 4 tokens, 2 pools + the tail per query
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=0, qk_nope_head_dim=24, v_head_dim=20, index_n_heads=16, index_head_dim=32,
            index_topk=8, index_kpool=4, num_hidden_layers=5, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, linear_head_dim=16, linear_num_heads=4, hc_mult=4, hc_sinkhorn_iters=20,
            swiglu_limit=0.05, max_position_embeddings=512, pad_token_id=0)
# swiglu_limit 0.05: with std-0.02 random weights the products are ~0.1, so the clamp really bites
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32, patch_size=14)


def build_flash_model(seed: int = 0, **text_overrides):
    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config={**TEXT, **text_overrides}, vision_config=VISION)
    cfg._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(cfg)
    # every weight off its initial value: vectors (norms, hc mixers' base / scale, A_log, dt_bias), the pool
    # offsets and gate (zeros / ones), the conv taps
    return perturbed(model, model.model.language_model.layers, also=("kpool", "conv1d"))


flash_logits = hf_logits      # (model, ids, attention_mask=None) -> logits [B, T, V]
