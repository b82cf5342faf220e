"""GLM-5.3-Flash (glm5_next) config.json -> ModelConfig: nested and flat forms, defaults, refusals."""
import json

import pytest
from transformers import Glm5NextConfig

from glm5_jax.hf.config import config_from_hf
from hf_reference_flash import TEXT


def _nested():
    return Glm5NextConfig(text_config=TEXT).to_dict()


def test_nested_and_flat_forms_give_one_config():
    nested = config_from_hf(_nested())
    flat = config_from_hf({**TEXT, "model_type": "glm5_next"})
    assert nested == flat
    assert nested.layer_attention_types == ("kda", "kda", "kda", "mla", "kda")      # i % 4 == 3: MLA
    assert (nested.first_k_dense_replace, nested.index_kpool, nested.hc_mult, nested.swiglu_limit) == (3, 4, 4, 0.05)
    assert (nested.qk_rope_head_dim, nested.latent_norm_eps, nested.num_nextn_predict_layers) == (0, 1e-5, 0)
    assert (nested.linear_num_heads, nested.linear_head_dim, nested.linear_conv_kernel_dim) == (4, 16, 4)


def test_real_model_defaults():
    """Glm5NextTextConfig's defaults: 45 layers, 3:1 KDA / MLA, 288 experts, hc_mult 4, pools of 16."""
    cfg = config_from_hf(json.loads(Glm5NextConfig().to_json_string()))
    assert cfg.num_hidden_layers == 45 and cfg.layer_attention_types.count("mla") == 11
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.index_kpool, cfg.index_topk) == (288, 8, 16, 2048)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.swiglu_limit, cfg.linear_lower_bound) == (4, 20, 10.0, -5.0)


def test_linear_attn_config_dict_form():
    flat = {**TEXT, "model_type": "glm5_next", "linear_attn_config": {"head_dim": 8, "num_heads": 2,
                                                                      "short_conv_kernel_size": 3}}
    cfg = config_from_hf(flat)
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (8, 2, 3)


@pytest.mark.parametrize("change, match", [(dict(qk_rope_head_dim=8), "NoPE"),
                                           (dict(layer_types=["sliding_attention"] * 5), "layer_types"),
                                           (dict(index_topk_freq=2), "shared indexer")])
def test_unsupported_fields_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**TEXT, "model_type": "glm5_next", **change})


def test_glm53_flash_config_is_the_hub_default():
    """configs/glm53_flash.py's model is what Glm5NextConfig() describes (how it runs aside); ~313B parameters."""
    import importlib.util
    import os

    from glm5_jax.model.param_count import count_params
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "glm53_flash.py")
    spec = importlib.util.spec_from_file_location("glm53_flash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ours = module.model_config()
    hub = config_from_hf(json.loads(Glm5NextConfig().to_json_string()))
    assert ours.replace(runtime=hub.runtime) == hub
    assert round(count_params(ours)["total"] / 1e9) == 313
    module.get_config()      # the pod run's config validates


def test_flash_parameters_carry_only_ruled_logical_axes():
    """Every GLM-5.3-Flash parameter names logical axes both rule tables map (the new kda_qkv, hc_embed too)."""
    import flax.linen as nn
    import jax

    from glm5_jax.model.param_count import abstract_variables
    from glm5_jax.parallel import axes
    from glm5_jax.parallel.mesh import DEFAULT_RULES
    from glm5_jax.parallel.sampling import SAMPLING_RULES

    cfg = config_from_hf({**TEXT, "model_type": "glm5_next"})
    specs = jax.tree.leaves(nn.get_partition_spec(abstract_variables(cfg)),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    named = {n for spec in specs for n in spec if n is not None}
    assert {axes.KDA_QKV, axes.HC_EMBED} <= named <= set(axes.ALL)
    for rules in (DEFAULT_RULES, SAMPLING_RULES):
        assert sorted(name for name, _ in rules) == sorted(axes.ALL)

