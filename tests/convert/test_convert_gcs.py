"""hf-to-orbax and orbax-to-hf between a local directory and gs:// (a GCS emulator): bit-identical tensors,
and an output directory is taken as complete only once its commit file is there."""
import json

import jax
import numpy as np
import pytest
from convert_helpers import assert_same_tensors, save_hf_model

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.inference import load_for_inference
from glm5_jax.convert import hf_to_orbax, orbax_to_hf
from glm5_jax.hf.checkpoint import load_hf


def _files(directory):
    return sorted(storage.join(d, n)[len(directory) + 1:] for d, _, names in storage.walk(directory) for n in names)


def test_local_to_gcs_and_back_is_bit_identical(tmp_path, gcs_dir):
    src = save_hf_model(str(tmp_path / "hf"), "glm", "bfloat16")
    hf_to_orbax(src, storage.join(gcs_dir, "orbax"), dtype="bfloat16")                 # local -> gs://
    orbax_to_hf(storage.join(gcs_dir, "orbax"), storage.join(gcs_dir, "hf"), shard_size="100KB")   # gs -> gs
    hf_to_orbax(storage.join(gcs_dir, "hf"), str(tmp_path / "orbax"), dtype="bfloat16")            # gs -> local
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))                                    # local -> local
    assert assert_same_tensors(src, storage.join(gcs_dir, "hf")) == 82
    assert assert_same_tensors(src, str(tmp_path / "back")) == 82

    # the orbax checkpoint on gs:// restores to the same arrays as the HF source
    _, want = load_hf(src, dtype="bfloat16")
    _, got, _ = load_for_inference(storage.join(gcs_dir, "orbax"))
    want, got = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (want, got))
    assert want.keys() == got.keys()
    for path, a in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(a), err_msg=jax.tree_util.keystr(path))

    # nothing but the outputs: the temporary prefixes are gone
    assert sorted(storage.listdir(gcs_dir)) == ["hf", "orbax"]
    hf_files = _files(storage.join(gcs_dir, "hf"))
    index = json.loads(storage.read_text(storage.join(gcs_dir, "hf", "model.safetensors.index.json")))
    assert "config.json" in hf_files and set(index["weight_map"].values()) <= set(hf_files)
    with pytest.raises(CheckpointError, match="already exists"):
        orbax_to_hf(storage.join(gcs_dir, "orbax"), storage.join(gcs_dir, "hf"))
