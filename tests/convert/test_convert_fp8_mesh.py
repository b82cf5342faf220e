"""FP8 import against a dequantised reference, FP8 export -> import, and mesh-sharded conversion."""
import json
import math
import os

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from convert_helpers import GLM_KW

from glm5_jax.convert import hf_to_orbax, orbax_to_hf
from glm5_jax.convert.hub_reader import HubReader, read_leaf_slice
from glm5_jax.convert.mesh import leaf_sharding, parse_mesh
from glm5_jax.convert.plan import build_plan
from glm5_jax.convert.synthetic import write_random_hub_checkpoint
from glm5_jax.hf.config import config_from_hf
from glm5_jax.hf.layout import to_ours
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint

# hidden 160 and q_lora 136: several 128-blocks per weight with ragged edges
FP8_CONFIG = {**GLM_KW, "model_type": "glm_moe_dsa", "hidden_size": 160, "q_lora_rank": 136,
              "num_nextn_predict_layers": 1, "eos_token_id": 1, "pad_token_id": None}
QUANTISED_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                      "o_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight", "gate_proj.weight",
                      "up_proj.weight", "down_proj.weight")


def restore_state(ckpt_dir):
    manager = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
    return manager.restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


def quantise_by_loop(w):
    """Reference 128x128 block quantisation written per block (independent of glm5_jax.convert.fp8)."""
    rows, cols = w.shape
    scale = np.ones((math.ceil(rows / 128), math.ceil(cols / 128)), np.float32)
    w8 = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(block).max() / 448.0
            w8[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return w8, scale


def write_fp8_from(src_dir, out_dir):
    """Quantise every quantisable weight of a bf16/fp32 hub checkpoint; returns {key: dequantised fp32}."""
    from glm5_jax.convert.safetensors_writer import ShardedSafetensorsWriter, ShardLayout
    src = SafetensorsCheckpoint(src_dir)
    arrays, reference = {}, {}
    for key in sorted(src.keys()):
        w = np.asarray(src.raw(key), np.float32)
        if key.endswith(QUANTISED_SUFFIXES) and "mlp.gate." not in key and ".layers." in key:
            w8, scale = quantise_by_loop(w)
            arrays[key], arrays[key[:-len("weight")] + "weight_scale_inv"] = w8, scale
            reference[key] = w8.astype(np.float32) * np.kron(scale, np.ones((128, 128), np.float32))[:w.shape[0], :w.shape[1]]
        else:
            arrays[key] = reference[key] = w
    os.makedirs(out_dir)
    config = json.load(open(os.path.join(src_dir, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["lm_head", "model.layers.1.self_attn.indexers_proj"]}
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"))
    layout = ShardLayout([(k, a.dtype, a.shape) for k, a in arrays.items()], 2**20)
    writer = ShardedSafetensorsWriter(out_dir, layout)
    for k, a in arrays.items():
        writer.write(k, a)
    writer.close()
    return reference


def test_fp8_import_matches_dequantised_reference_and_export_round_trips(tmp_path):
    write_random_hub_checkpoint(str(tmp_path / "bf16"), FP8_CONFIG, dtype=np.float32)
    reference = write_fp8_from(str(tmp_path / "bf16"), str(tmp_path / "fp8"))
    assert any(k.endswith("kv_a_proj_with_mqa.weight_scale_inv") for k in SafetensorsCheckpoint(str(tmp_path / "fp8")).keys())
    hf_to_orbax(str(tmp_path / "fp8"), str(tmp_path / "orbax"), dtype="float32")
    cfg = config_from_hf(FP8_CONFIG)
    state = restore_state(tmp_path / "orbax")
    for leaf in build_plan(cfg):
        got = state[leaf.collection]
        for p in leaf.path:
            got = got[p]
        src = leaf.sources[0]
        first = reference[src.keys()[0]]
        want = to_ours(first, src.layout, src.heads)
        got0 = np.asarray(got)[0] if leaf.stacked else np.asarray(got)
        got0 = got0[0] if src.experts else got0
        np.testing.assert_array_equal(got0, want, err_msg=leaf.name)

    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "fp8_out"), fp8=True)
    out = SafetensorsCheckpoint(str(tmp_path / "fp8_out"))
    fp8_in = SafetensorsCheckpoint(str(tmp_path / "fp8"))
    assert set(out.keys()) == set(fp8_in.keys())
    config = json.load(open(tmp_path / "fp8_out" / "config.json"))
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert "model.layers.1.self_attn.indexers_proj" in config["quantization_config"]["modules_to_not_convert"]
    assert out.raw("model.layers.1.self_attn.indexer.weights_proj.weight").dtype == np.float32
    assert out.raw("model.layers.3.eh_proj.weight").dtype == np.float32
    assert out.raw("model.layers.1.mlp.experts.3.down_proj.weight").dtype == ml_dtypes.float8_e4m3fn
    for key in out.keys():       # re-quantising dequantised FP8 reproduces the bytes
        assert out.raw(key).tobytes() == fp8_in.raw(key).tobytes(), key
    hf_to_orbax(str(tmp_path / "fp8_out"), str(tmp_path / "orbax2"), dtype="float32")
    again = restore_state(tmp_path / "orbax2")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, again)


def test_mesh_conversion_gives_the_same_values(tmp_path):
    write_random_hub_checkpoint(str(tmp_path / "hf"), FP8_CONFIG, dtype=np.float32, fp8=True)
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "single"), dtype="float32")
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "mesh"), dtype="float32", mesh="fsdp:2,expert:2,tensor:2")
    single, sharded = restore_state(tmp_path / "single"), restore_state(tmp_path / "mesh")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), single, sharded)
    experts = sharded["params"]["decoder"]["segment_1"]["layer_0"]["moe"]["gate_proj"]
    assert len(experts.sharding.device_set) == 8 and not experts.sharding.is_fully_replicated


def test_each_device_reads_only_its_slice(tmp_path):
    """Every shard of a mesh sharding built from hub slices equals the same slice of the whole leaf."""
    write_random_hub_checkpoint(str(tmp_path / "hf"), FP8_CONFIG, dtype=np.float32, fp8=True)
    reader = HubReader(SafetensorsCheckpoint(str(tmp_path / "hf")))
    mesh = parse_mesh("fsdp:2,expert:2,tensor:2")
    for leaf in build_plan(config_from_hf(FP8_CONFIG)):
        whole = read_leaf_slice(reader, leaf, (), np.float32)
        sharding = leaf_sharding(mesh, leaf.shape, leaf.logical_axes)
        for index in sharding.devices_indices_map(leaf.shape).values():
            np.testing.assert_array_equal(read_leaf_slice(reader, leaf, index, np.float32), whole[index], leaf.name)
