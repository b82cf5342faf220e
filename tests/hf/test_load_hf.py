"""load_hf: sharded checkpoints, FP8 blocks, and clear errors for broken checkpoints."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_jax import load_hf
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.hf.safetensors_io import dequantize_fp8
from hf_reference import build_hf_model


@pytest.fixture(scope="module")
def single_and_sharded(tmp_path_factory):
    model = build_hf_model("shared_index")
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="100KB")
    return single, sharded


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(single_and_sharded):
    single, sharded = single_and_sharded
    assert os.path.exists(sharded / "model.safetensors.index.json")
    (_, a), (_, b) = load_hf(str(single)), load_hf(str(sharded))
    import jax
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(single_and_sharded, tmp_path):
    path = _copy(single_and_sharded[0], tmp_path / "c")
    _rewrite(path, lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.self_attn\.kv_b_proj\.weight'"):
        load_hf(str(path))


def test_unexpected_tensor_is_named(single_and_sharded, tmp_path):
    path = _copy(single_and_sharded[0], tmp_path / "c")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.self_attn\.extra\.weight"):
        load_hf(str(path))


def test_shape_mismatch_with_config_is_named(single_and_sharded, tmp_path):
    path = _copy(single_and_sharded[0], tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    config["q_lora_rank"] = 40
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_a_proj\.weight: shape \[48, 64\] in the checkpoint, config\.json implies \[40, 64\]"):
        load_hf(str(path))


def test_index_naming_a_missing_shard(single_and_sharded, tmp_path):
    path = _copy(single_and_sharded[1], tmp_path / "c")
    victim = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))[-1]
    os.remove(path / victim)
    with pytest.raises(CheckpointError, match=f"names shard '{victim}', which does not exist"):
        load_hf(str(path))


def test_truncated_file(single_and_sharded, tmp_path):
    path = _copy(single_and_sharded[0], tmp_path / "c")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf(str(path))
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header length"):
        load_hf(str(path))


def test_fp8_block_dequantisation_against_hand_computation():
    """W = W8 * scale_inv[r // 128, c // 128] with ceil blocks at the ragged edge.

    Background: docs/architecture.md#fp8-block-quantisation.
    """
    rng = np.random.default_rng(0)
    import ml_dtypes
    w8 = rng.normal(size=(130, 200)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=(2, 2)).astype(np.float32)
    out = dequantize_fp8(w8, scale, (128, 128))
    assert out[129, 199] == np.float32(w8[129, 199]) * scale[1, 1]
    assert out[127, 128] == np.float32(w8[127, 128]) * scale[0, 1]
    assert out[128, 0] == np.float32(w8[128, 0]) * scale[1, 0]
    with pytest.raises(CheckpointError, match=r"FP8 scale shape \[1, 2\].*expected \[2, 2\]"):
        dequantize_fp8(w8, scale[:1], (128, 128), "x.weight")
