"""HF -> orbax -> HF: bit-identical tensors, same transformers logits, and orbax params equal `load_hf`."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from convert_helpers import assert_same_tensors, hf_logits, save_hf_model

from glm5_jax.convert import hf_to_orbax, load_model_config, orbax_to_hf
from glm5_jax.convert.synthetic import write_random_hub_checkpoint
from glm5_jax.hf.checkpoint import load_hf
from glm5_jax.hf.safetensors_io import INDEX_FILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def restore_state(ckpt_dir):
    """The documented restore path for training / generation code."""
    manager = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
    return manager.restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_orbax_hf_is_bit_identical(tmp_path, dtype):
    src = save_hf_model(str(tmp_path / "hf"), "glm", dtype)
    hf_to_orbax(src, str(tmp_path / "orbax"), dtype=dtype)
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"), shard_size="100KB")
    assert assert_same_tensors(src, str(tmp_path / "back")) == 82
    index = json.load(open(tmp_path / "back" / INDEX_FILE))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert index["metadata"]["total_size"] == sum(
        os.path.getsize(tmp_path / "back" / s) for s in shards) - sum(
        8 + int.from_bytes(open(tmp_path / "back" / s, "rb").read(8), "little") for s in shards)

    cfg_src, variables = load_hf(src, dtype=dtype)
    state = restore_state(tmp_path / "orbax")
    assert load_model_config(str(tmp_path / "orbax")).replace(dtype=dtype) == cfg_src
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(variables))
    flat_got = dict(jax.tree_util.tree_leaves_with_path(state))
    assert flat_ref.keys() == flat_got.keys()
    for path, ref in flat_ref.items():
        got = flat_got[path]
        assert got.dtype == ref.dtype and got.shape == ref.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=jax.tree_util.keystr(path))

    if dtype == "float32":
        tokens = np.random.default_rng(0).integers(0, 128, (1, 24))
        np.testing.assert_array_equal(hf_logits(str(tmp_path / "back"), tokens), hf_logits(src, tokens))


def test_cli_end_to_end_with_mtp_and_sharded_input(tmp_path):
    """Synthetic checkpoint with the MTP layer, several input shards, bf16: CLI both ways."""
    hf_config = json.load(open(os.path.join(os.path.dirname(__file__), "tiny_glm5_config.json")))
    src = str(tmp_path / "hf")
    write_random_hub_checkpoint(src, hf_config, dtype=np.dtype("bfloat16"), max_shard_bytes=200_000)
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "glm5_jax.convert", *args], env=env, capture_output=True,
                              text=True, timeout=120)

    r = cli("hf-to-orbax", f"--hf_dir={src}", f"--out_dir={tmp_path / 'orbax'}")
    assert r.returncode == 0, r.stderr
    assert "hf-to-orbax:" in r.stderr and "tensors" in r.stderr and "peak RSS" in r.stderr and "MB/s" in r.stderr
    cfg = load_model_config(str(tmp_path / "orbax"))
    assert cfg.num_nextn_predict_layers == 1 and cfg.runtime.param_dtype == "bfloat16"
    assert "mtp" in restore_state(tmp_path / "orbax")["params"]
    r = cli("orbax-to-hf", f"--ckpt_dir={tmp_path / 'orbax'}", f"--out_dir={tmp_path / 'back'}", "--shard_size=300KB")
    assert r.returncode == 0, r.stderr
    assert assert_same_tensors(src, str(tmp_path / "back")) > 82
    r = cli("orbax-to-hf", f"--ckpt_dir={tmp_path / 'orbax'}", f"--out_dir={tmp_path / 'back'}")
    assert r.returncode != 0 and "already exists" in r.stderr and "--overwrite" in r.stderr


def test_deepseek_v32_checkpoint(tmp_path):
    """Half-split indexer RoPE, YaRN and n_group > 1 survive the round trip; the exported model runs in HF."""
    src = save_hf_model(str(tmp_path / "hf"), "deepseek_v32", "float32")
    hf_to_orbax(src, str(tmp_path / "orbax"), dtype="float32")
    cfg = load_model_config(str(tmp_path / "orbax"))
    assert not cfg.indexer_rope_interleave and cfg.n_group == 4 and cfg.rope_scaling_dict["rope_type"] == "yarn"
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    assert assert_same_tensors(src, str(tmp_path / "back")) > 0
    assert json.load(open(tmp_path / "back" / "config.json"))["model_type"] == "deepseek_v32"
    tokens = np.random.default_rng(1).integers(0, 128, (1, 24))
    np.testing.assert_array_equal(hf_logits(str(tmp_path / "back"), tokens), hf_logits(src, tokens))


def test_leaf_writer_batches_and_metadata(tmp_path):
    """Every add flushing (the last one included) still commits all leaves and the metadata once."""
    from glm5_jax.convert.orbax_io import LeafWriter, leaf_metadata, read_custom_metadata, restore_leaf, state_dir
    writer = LeafWriter(str(tmp_path), {"model_config": {"x": 1}}, flush_bytes=1)
    for i in range(3):
        writer.add("params", ("block", f"w{i}"), jax.numpy.full((4, 2), i, jax.numpy.bfloat16))
    writer.finalize()
    assert read_custom_metadata(str(tmp_path))["model_config"] == {"x": 1}
    meta = leaf_metadata(state_dir(str(tmp_path)))
    assert sorted(meta) == [("params", "block", f"w{i}") for i in range(3)]
    w2 = restore_leaf(state_dir(str(tmp_path)), "params", ("block", "w2"), *meta[("params", "block", "w2")])
    np.testing.assert_array_equal(w2, np.full((4, 2), 2, np.float32))
