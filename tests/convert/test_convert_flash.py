"""GLM-5.3-Flash (glm5_next) hub checkpoint -> orbax -> hub: the language model's tensors bit-identical
(KDA, pooled indexer, hyper-connection tensors included), the vision tower skipped by name."""
import jax
import numpy as np
import orbax.checkpoint as ocp
from convert_helpers import assert_same_tensors

from glm5_jax.convert import hf_to_orbax, load_model_config, orbax_to_hf
from glm5_jax.hf.checkpoint import load_hf
from glm5_jax.hf.config import read_config_json
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint
from hf_reference_flash import build_flash_model


def test_flash_hf_orbax_hf_is_bit_identical_on_the_language_model(tmp_path, caplog):
    src = tmp_path / "hf"
    build_flash_model().save_pretrained(src)
    language = tmp_path / "language"          # the source without its vision tower: what comes back
    language.mkdir()
    ckpt = SafetensorsCheckpoint(str(src))
    from safetensors.numpy import save_file
    save_file({k: ckpt.raw(k) for k in ckpt.keys() if not k.startswith("model.visual.")},
              str(language / "model.safetensors"))
    hf_to_orbax(str(src), str(tmp_path / "orbax"), dtype="float32")
    assert "vision-tower tensors" in caplog.text
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    n = assert_same_tensors(str(language), str(tmp_path / "back"))
    assert n > 100 and any(".hc_attn_fn" in k for k in SafetensorsCheckpoint(str(tmp_path / "back")).keys())
    assert read_config_json(str(tmp_path / "back"))["model_type"] == "glm5_next"

    cfg, variables = load_hf(str(src))
    assert load_model_config(str(tmp_path / "orbax")) == cfg
    state = ocp.CheckpointManager(str(tmp_path / "orbax")).restore(
        0, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    ref, got = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (variables, state))
    assert ref.keys() == got.keys()
    for path in ref:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(ref[path]))
