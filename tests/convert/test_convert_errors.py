"""Every bad input fails with a message naming the problem and leaves nothing behind."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from convert_helpers import GLM_KW, siblings

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.convert import hf_to_orbax, orbax_to_hf
from glm5_jax.convert.synthetic import write_random_hub_checkpoint
from glm5_jax.hf.safetensors_io import INDEX_FILE

CONFIG = {**GLM_KW, "model_type": "glm_moe_dsa", "num_nextn_predict_layers": 1, "eos_token_id": 1,
          "pad_token_id": None}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "hf")
    write_random_hub_checkpoint(path, CONFIG, dtype=np.float32, max_shard_bytes=100_000)
    return path


@pytest.fixture(scope="module")
def good_fp8_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good_fp8") / "hf")
    write_random_hub_checkpoint(path, CONFIG, dtype=np.float32, fp8=True)
    return path


def _shard_of(hf_dir, key):
    return os.path.join(hf_dir, json.load(open(os.path.join(hf_dir, INDEX_FILE)))["weight_map"][key])


def _edit_index(hf_dir, fn):
    path = os.path.join(hf_dir, INDEX_FILE)
    index = json.load(open(path))
    fn(index["weight_map"])
    json.dump(index, open(path, "w"))


def _rewrite_header(shard, fn):
    """Rewrite a shard's JSON header through `fn` (data section unchanged)."""
    raw = open(shard, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    open(shard, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def missing_tensor(d):
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    _rewrite_header(_shard_of(d, key), lambda h: h.pop(key))
    _edit_index(d, lambda m: m.pop(key))
    return f"missing, e.g. ['{key}']"


def unexpected_tensor(d):
    shard = _shard_of(d, "model.norm.weight")
    def add(h):
        h["model.layers.1.mlp.extra.weight"] = dict(h["model.norm.weight"])
    _rewrite_header(shard, add)
    _edit_index(d, lambda m: m.__setitem__("model.layers.1.mlp.extra.weight", os.path.basename(shard)))
    return "model.layers.1.mlp.extra.weight"


def shape_mismatch(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["intermediate_size"] = 80
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return "model.layers.0.mlp.gate_proj.weight: shape [96, 64] in the checkpoint, config.json implies [80, 64]"


def dtype_mismatch(d):
    _rewrite_header(_shard_of(d, "model.norm.weight"), lambda h: h["model.norm.weight"].__setitem__("dtype", "I32"))
    return "model.norm.weight: dtype int32"


def missing_config(d):
    os.remove(os.path.join(d, "config.json"))
    return "missing config.json"


def invalid_config(d):
    open(os.path.join(d, "config.json"), "w").write("{not json")
    return "invalid JSON"


def unsupported_config(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return "model_type 'llama'"


def missing_shard(d):
    shard = _shard_of(d, "lm_head.weight")
    os.remove(shard)
    return f"names shard {os.path.basename(shard)!r}, which does not exist"


def truncated_data(d):
    shard = _shard_of(d, "lm_head.weight")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    return "truncated"


def corrupt_header(d):
    shard = _shard_of(d, "lm_head.weight")
    raw = bytearray(open(shard, "rb").read())
    raw[8:20] = b"\xff" * 12
    open(shard, "wb").write(bytes(raw))
    return "corrupt safetensors header"


BAD = [missing_tensor, unexpected_tensor, shape_mismatch, dtype_mismatch, missing_config, invalid_config,
       unsupported_config, missing_shard, truncated_data, corrupt_header]


@pytest.mark.parametrize("breaker", BAD, ids=[b.__name__ for b in BAD])
def test_bad_hf_input_is_refused_and_writes_nothing(good_dir, tmp_path, breaker):
    bad = str(tmp_path / "bad")
    shutil.copytree(good_dir, bad)
    message = breaker(bad)
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match=None) as err:
        hf_to_orbax(bad, out, dtype="float32")
    assert message in str(err.value)
    assert siblings(out) == []


def test_fp8_scale_shape_mismatch(good_fp8_dir, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(good_fp8_dir, bad)
    key = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    # the weight [48, 64] has one 128x128 block; declare a [2, 1] scale over 8 bytes appended to the shard
    shard = _shard_of(bad, key)
    raw = open(shard, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    end = len(raw) - 8 - n
    header[key] = {"dtype": "F32", "shape": [2, 1], "data_offsets": [end, end + 8]}
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    open(shard, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n:] + b"\0" * 8)
    with pytest.raises(CheckpointError) as err:
        hf_to_orbax(bad, str(tmp_path / "out"), dtype="float32")
    assert f"{key}: FP8 scale shape [2, 1] does not match weight [48, 64]" in str(err.value)
    assert siblings(str(tmp_path / "out")) == []


def test_existing_output_needs_overwrite(good_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="already exists; pass --overwrite"):
        hf_to_orbax(good_dir, str(out), dtype="float32")
    assert (out / "keep.txt").exists()
    hf_to_orbax(good_dir, str(out), dtype="float32", overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "0").is_dir()
    assert siblings(str(out)) == ["out"]
    with pytest.raises(CheckpointError, match="already exists"):
        orbax_to_hf(str(out), good_dir)
    with pytest.raises(CheckpointError, match="is a Hugging Face checkpoint, not an orbax one; convert it first"):
        orbax_to_hf(good_dir, str(tmp_path / "back"))
    assert siblings(str(tmp_path / "back")) == []


def test_cli_reports_error_with_nonzero_exit(good_dir, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(good_dir, bad)
    missing_tensor(bad)
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "glm5_jax.convert", "hf-to-orbax", f"--hf_dir={bad}",
                        f"--out_dir={tmp_path / 'out'}"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "error:" in r.stderr and "model.layers.1.mlp.experts.2.up_proj.weight" in r.stderr
    assert siblings(str(tmp_path / "out")) == []
