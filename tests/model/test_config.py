"""ModelConfig: HF config.json in and out, validation messages, and GLM-5's size.

Background: docs/architecture.md#notation-and-sizes.
"""
import dataclasses
import json
import os

import pytest
from transformers import GlmMoeDsaConfig

from configs.glm5_744b import model_config
from glm5_jax import ConfigError, ModelConfig, count_params
from glm5_jax.hf.config import config_from_hf, config_to_hf
from glm5_jax.model.config import RUNTIME_FIELDS

# docs/architecture.md#notation-and-sizes: the reconstructed zai-org/GLM-5 config.json
GLM5_CONFIG_JSON = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
    "attention_dropout": 0.0, "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "head_dim": 64, "hidden_size": 6144,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048, "indexer_rope_interleave": True,
    "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 202752,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 2048,
    "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_interleave": True, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "transformers_version": "5.0.2.dev0", "use_cache": True, "v_head_dim": 256,
    "vocab_size": 154880}

IMPL_FIELDS = ("runtime", "mtp_use_normed_hidden", "bos_token_id")


def architecture(cfg):
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in IMPL_FIELDS}


def test_glm5_config_json_gives_the_744b_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM5_CONFIG_JSON))
    assert architecture(config_from_hf(tmp_path)) == architecture(model_config())


def test_to_hf_round_trips_and_transformers_accepts_it():
    glm52_pattern = ("full",) * 3 + ("shared", "shared", "shared", "full") * 18 + ("shared",) * 3   # GLM-5.2 style
    cfg = model_config().replace(indexer_types=glm52_pattern)
    hf = config_to_hf(cfg)
    assert architecture(config_from_hf(hf)) == architecture(cfg)
    hf_cfg = GlmMoeDsaConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert hf_cfg.indexer_types == list(cfg.indexer_types)
    assert hf_cfg.qk_head_dim == 256 and hf_cfg.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]
    assert architecture(config_from_hf(hf_cfg.to_dict())) == architecture(cfg)


def test_index_sharing_schedule_follows_hf():
    hf = dict(GLM5_CONFIG_JSON, num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3)
    ours = config_from_hf(hf).layer_indexer_types
    assert ours == tuple(GlmMoeDsaConfig(num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3).indexer_types)
    assert ours[:7] == ("full", "full", "full", "shared", "shared", "shared", "full")


def test_glm52_1m_config_is_glm5_with_hf_index_share_rope_and_positions():
    import configs.glm52_744b_1m as glm52

    cfg = glm52.get_config()
    hf_types = GlmMoeDsaConfig(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3).indexer_types
    assert cfg.model.layer_indexer_types == tuple(hf_types)
    assert "".join("F" if t == "full" else "S" for t in hf_types) == "FFF" + "SSSF" * 18 + "SSS"
    assert hf_types.count("full") == 21
    assert (cfg.model.rope_theta, cfg.model.max_position_embeddings) == (8e6, 1_048_576)
    assert cfg.data.seq_len == 1_048_576
    # only the indexer sharing, RoPE and positions differ from GLM-5
    same = dict(indexer_types=None, rope_theta=1e6, max_position_embeddings=202752)
    assert architecture(cfg.model.replace(**same)) == architecture(model_config())
    sizes = cfg.mesh.axis_sizes(2048)
    assert sizes["context"] * 4096 == cfg.data.seq_len       # 4,096 tokens per chip


@pytest.mark.parametrize("change,field", [
    (dict(n_group=3), "n_group"), (dict(topk_group=0), "topk_group"), (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(indexer_types=("shared",) * 78), "indexer_types"), (dict(indexer_types=("full",) * 5), "indexer_types"),
    (dict(attention_impl="cuda"), "attention_impl"), (dict(index_head_dim=32), "index_head_dim"),
    (dict(projection_impl="tpu"), "projection_impl"), (dict(attention_block=384), "attention_block"),
    (dict(grad_reduce_dtype="float16"), "grad_reduce_dtype"),
    (dict(moe_a2a_chunk_by="rows"), "moe_a2a_chunk_by"), (dict(kda_chunk=24), "kda_chunk"),
    (dict(decode_cache_read="pallas"), "decode_cache_read"), (dict(decode_cache_read="gather"), "decode_cache_read"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim"), (dict(first_k_dense_replace=99), "first_k_dense_replace"),
])
def test_validation_names_the_field(change, field):
    owner = "RuntimeConfig" if field in RUNTIME_FIELDS else "ModelConfig"
    with pytest.raises(ConfigError, match=rf"{owner}\.{field}="):
        model_config().replace(**change)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="llama"), "model_type 'llama'"), (dict(rope_parameters={"rope_type": "default"}), "rope_theta"),
    (dict(hidden_act="gelu"), "hidden_act"), (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(rope_parameters={"rope_theta": 1e6, "rope_type": "longrope"}), "longrope"),
])
def test_from_hf_rejects_unsupported_configs(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**GLM5_CONFIG_JSON, **change})


def test_from_hf_reports_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no HF config"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        config_from_hf(tmp_path)


def test_glm5_parameter_counts():
    """743.91B main stack, 41.78B active incl. embedding and head (39.88B without), MTP 9.95B
    (docs/architecture.md#notation-and-sizes)."""
    counts = count_params(model_config())
    assert round(counts["total"] / 1e9, 2) == 743.91
    assert round(counts["active"] / 1e9, 2) == 41.78
    assert round(counts["active_without_embeddings"] / 1e9, 2) == 39.88
    assert round(counts["mtp"] / 1e9, 2) == 9.95


def test_dtypes_given_as_jax_or_numpy_dtypes():
    import jax.numpy as jnp
    import numpy as np

    cfg = model_config().replace(dtype=jnp.bfloat16, param_dtype=np.float32)
    assert (cfg.runtime.dtype, cfg.runtime.param_dtype) == ("bfloat16", "float32")
    assert cfg == model_config().replace(dtype="bfloat16", param_dtype="float32")
    with pytest.raises(ConfigError, match=r"RuntimeConfig\.dtype=.*not a dtype"):
        model_config().replace(dtype=object())
    with pytest.raises(ConfigError, match=r"RuntimeConfig\.dtype='int8'"):
        model_config().replace(dtype=jnp.int8)


def test_runtime_fields_live_apart_from_the_architecture():
    """Implementation switches are a RuntimeConfig inside ModelConfig, read as cfg.runtime.<name>; the flat
    names still replace, --set and load from stored dicts, and a removed switch fails naming what replaces it."""
    from glm5_jax.model.config import RuntimeConfig
    from glm5_jax.train.experiment import apply_overrides, load_config_file

    cfg = model_config()
    assert cfg.runtime == RuntimeConfig(dtype="bfloat16", param_dtype="float32")
    moved = cfg.replace(attention_impl="pallas", remat_policy="none")
    assert moved.runtime == cfg.runtime.replace(attention_impl="pallas", remat_policy="none")
    assert moved.runtime.attention_impl == "pallas" and architecture(moved) == architecture(cfg)
    assert not hasattr(moved, "attention_impl")            # read through cfg.runtime only
    flat = ModelConfig.from_fields({"attention_impl": "reference", "remat_policy": "none"})
    assert flat.runtime == RuntimeConfig(attention_impl="reference", remat_policy="none")
    with pytest.raises(TypeError):
        ModelConfig(attention_impl="reference")            # the constructor takes runtime=RuntimeConfig(...)
    with pytest.raises(ConfigError, match="sparse_xla_form was removed"):
        ModelConfig.from_fields({"sparse_xla_form": "gather"})
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.py")
    exp = apply_overrides(load_config_file(tiny), ["model.attention_impl=pallas_interpret",
                                                    "model.runtime.mla_form=mha"])
    assert (exp.model.runtime.attention_impl, exp.model.runtime.mla_form) == ("pallas_interpret", "mha")
    with pytest.raises(ValueError, match="sparse_xla_form.*removed.*attention_impl"):
        apply_overrides(exp, ["model.sparse_xla_form=gather"])
    with pytest.raises(ConfigError, match="sparse_xla_form was removed"):
        model_config().replace(sparse_xla_form="gather")
    with pytest.raises(ConfigError, match=r"RuntimeConfig\.moe_ep='nccl': must be one of"):
        model_config().replace(moe_ep="nccl")


def test_runtime_switches_take_the_kernels_implementation_names():
    """The RuntimeConfig switches accept exactly the names each hot spot's ops.py dispatches on."""
    import typing

    from glm5_jax.model.config import AttentionImpl, MoeImpl, ProjectionImpl, QuantMatmul
    from pallas_kernels import impls
    from pallas_kernels.grouped_matmul import ops as gmm_ops
    from pallas_kernels.int4_matmul import ops as int4_ops
    from pallas_kernels.lightning_indexer import ops as indexer_ops
    from pallas_kernels.sparse_mla import ops as sparse_ops

    assert set(typing.get_args(AttentionImpl)) == set(sparse_ops.IMPLS) == set(indexer_ops.IMPLS)
    assert set(typing.get_args(MoeImpl)) == set(gmm_ops.IMPLS) | {impls.BLOCKED}
    assert set(typing.get_args(QuantMatmul)) == set(int4_ops.IMPLS)
    assert set(typing.get_args(ProjectionImpl)) == {impls.XLA, impls.CPU_TRANSPOSED_GRAD}
