"""DeepSeek-V3.2 (half-split indexer RoPE, YaRN, n_group 4) and DeepSeek-V3 (no indexer) checkpoints
load into the same model and match their transformers classes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from glm5_jax import Transformer, load_hf
from hf_reference import BASE, assert_no_boundary_ties, hf_logits

YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
FAMILY = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
              n_group=4, topk_group=2, rope_parameters=YARN)


@pytest.mark.parametrize("config_cls,model_cls", [(DeepseekV32Config, DeepseekV32ForCausalLM),
                                                  (DeepseekV3Config, DeepseekV3ForCausalLM)])
def test_deepseek_family_matches_hf(tmp_path, config_cls, model_cls):
    torch.manual_seed(0)
    kwargs = {**BASE, **FAMILY}
    if config_cls is DeepseekV32Config:
        kwargs["index_topk"] = 8
    else:
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("index_")}
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    cfg, variables = load_hf(str(tmp_path))
    assert cfg.rope_scaling_dict["rope_type"] == "yarn" and cfg.softmax_scale != cfg.qk_head_dim ** -0.5
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    if cfg.use_indexer:
        assert not cfg.indexer_rope_interleave        # DeepSeek-V3.2's indexer RoPE is half-split
        assert_no_boundary_ties(model, ids)
    ours = jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(ours), hf_logits(model, ids), atol=1e-4, rtol=0)
