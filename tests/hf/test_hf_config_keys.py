"""config.json keys read as each transformers class reads them, and tensors transformers writes that carry
no parameter of ours: tiny models saved by transformers (every weight random, norms and routing bias
perturbed), loaded and compared with the reference's logits."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from glm5_jax import Transformer, load_hf
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.hf.config import config_from_hf, config_to_hf
from hf_reference import BASE, assert_no_boundary_ties, build_hf_model, hf_logits, perturbed

SMALL = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
             topk_group=1)


def _edit_config(hf_dir, **changes):
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _our_logits(cfg, variables, ids):
    return np.asarray(jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, jnp.asarray(ids)))


def _assert_matches_reference(model, hf_dir, ids):
    cfg, variables = load_hf(str(hf_dir))
    assert_no_boundary_ties(model, ids)
    np.testing.assert_allclose(_our_logits(cfg, variables, ids), hf_logits(model, ids), atol=1e-4, rtol=0)
    return cfg


def test_glm_rope_interleave_keys_are_ignored_like_the_reference(tmp_path):
    """GlmMoeDsaAttention and its indexer always apply interleaved RoPE; `false` in config.json changes nothing."""
    model = build_hf_model("shared_index", **SMALL, index_topk_freq=2)
    model.save_pretrained(tmp_path)
    _edit_config(tmp_path, rope_interleave=False, indexer_rope_interleave=False)
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    cfg = _assert_matches_reference(model, tmp_path, ids)
    assert cfg.rope_interleave and cfg.indexer_rope_interleave
    hf = config_to_hf(cfg)          # only `true`, what the reference runs (serving engines read the keys)
    assert hf["rope_interleave"] is True and hf["indexer_rope_interleave"] is True
    assert config_from_hf(hf) == cfg.replace(bos_token_id=hf["bos_token_id"])
    with pytest.raises(ValueError, match="attention RoPE is interleaved"):
        config_to_hf(cfg.replace(rope_interleave=False))


def test_deepseek_v32_ignores_index_sharing_keys_like_the_reference(tmp_path):
    """DeepseekV32Config has no cross-layer index sharing: index_topk_freq in its config.json changes nothing."""
    torch.manual_seed(0)
    model = perturbed(DeepseekV32ForCausalLM(DeepseekV32Config(**BASE, **SMALL, index_topk=8)))
    model.save_pretrained(tmp_path)
    _edit_config(tmp_path, index_topk_freq=2, index_skip_topk_offset=1, rope_interleave=False,
                 indexer_rope_interleave=True)
    ids = np.random.default_rng(1).integers(0, 300, (2, 24))
    cfg = _assert_matches_reference(model, tmp_path, ids)
    assert cfg.indexer_types is None and cfg.rope_interleave and not cfg.indexer_rope_interleave


def test_zero_shared_experts_load_and_round_trip(tmp_path):
    """n_shared_experts=0: transformers saves 0-size shared_experts tensors; they load (and add nothing), and
    hf-to-orbax -> orbax-to-hf writes them back."""
    from tests.convert.convert_helpers import assert_same_tensors

    from glm5_jax.convert import hf_to_orbax, orbax_to_hf
    from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint

    model = build_hf_model("shared_index", **SMALL, n_shared_experts=0)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    empty = [k for k in SafetensorsCheckpoint(str(src)).keys() if "shared_experts" in k]
    assert len(empty) == 3 * 2 and all(0 in SafetensorsCheckpoint(str(src)).shape(k) for k in empty)
    ids = np.random.default_rng(2).integers(0, 300, (2, 24))
    cfg = _assert_matches_reference(model, src, ids)
    assert cfg.n_shared_experts == 0
    hf_to_orbax(str(src), str(tmp_path / "orbax"), dtype="float32")
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    assert assert_same_tensors(str(src), str(tmp_path / "back")) == len(SafetensorsCheckpoint(str(src)).keys())
    with pytest.raises(CheckpointError, match=r"shared_experts.*n_shared_experts=0 implies \[(0, 64|64, 0)\]"):
        _resave(src, tmp_path / "bad", {empty[0]: torch.zeros(0, 32) if "down" not in empty[0] else torch.zeros(32, 0)})
        load_hf(str(tmp_path / "bad"))


def _resave(src, dst, changes):
    """A copy of the checkpoint at `src` with some tensors replaced or added (one safetensors file)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {**load_file(str(dst / "model.safetensors")), **changes}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_mtp_embedding_and_head_copies(tmp_path, family):
    """DeepSeek-V3.x hub checkpoints store the MTP layer's own copies of the embedding and head
    (model.layers.{L}.embed_tokens, .shared_head.head): accepted when equal to the main ones, written back by
    orbax-to-hf (the round trip is bit-identical), refused with both names when they differ."""
    from safetensors.torch import load_file
    from tests.convert.convert_helpers import assert_same_tensors
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from glm5_jax.convert import hf_to_orbax, orbax_to_hf

    torch.manual_seed(0)
    if family == "deepseek_v3":
        kwargs = {k: v for k, v in BASE.items() if not k.startswith("index_")}
        model = perturbed(DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs, **SMALL)))
    else:
        model = perturbed(DeepseekV32ForCausalLM(DeepseekV32Config(**BASE, **SMALL, index_topk=8)))
    model.save_pretrained(tmp_path / "no_mtp")
    L, d = SMALL["num_hidden_layers"], BASE["hidden_size"]
    tensors = load_file(str(tmp_path / "no_mtp" / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for key, value in list(tensors.items()):     # the MTP block: the last (MoE) layer's tensors, perturbed
        if key.startswith(f"model.layers.{L - 1}."):
            noise = 0.02 * torch.randn(value.shape, generator=g)
            tensors[key.replace(f"layers.{L - 1}.", f"layers.{L}.")] = value + noise
    mtp = f"model.layers.{L}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{name}.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    tensors[f"{mtp}eh_proj.weight"] = 0.02 * torch.randn(d, 2 * d, generator=g)
    tensors[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{mtp}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    src = tmp_path / "hf"
    _resave(tmp_path / "no_mtp", src, tensors)
    _edit_config(src, num_nextn_predict_layers=1)

    cfg, variables = load_hf(str(src))
    assert cfg.num_nextn_predict_layers == 1
    np.testing.assert_array_equal(np.asarray(variables["params"]["lm_head"]).T, tensors["lm_head.weight"].numpy())
    hf_to_orbax(str(src), str(tmp_path / "orbax"), dtype="float32")
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    assert assert_same_tensors(str(src), str(tmp_path / "back")) == len(tensors)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == family

    head = tensors[f"{mtp}shared_head.head.weight"].clone()
    head[3, 5] += 0.5
    _resave(src, tmp_path / "differs", {f"{mtp}shared_head.head.weight": head})
    message = rf"{mtp}shared_head.head.weight differs from lm_head.weight \(max \|difference\| 0.5 in rows 0..299\)"
    with pytest.raises(CheckpointError, match=message):
        load_hf(str(tmp_path / "differs"))
    with pytest.raises(CheckpointError, match=message):
        hf_to_orbax(str(tmp_path / "differs"), str(tmp_path / "orbax_differs"), dtype="float32")
