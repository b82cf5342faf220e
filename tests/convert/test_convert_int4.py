"""orbax-to-hf --int4 writes the routed experts in compressed-tensors' pack-quantized INT4 layout: the
compressed-tensors library decompresses them to exactly our dequantised weights; hf-to-orbax reads the
export back, and re-exporting that gives the same packed words."""
import json
import os

import numpy as np
import pytest
import torch

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.convert import hf_to_orbax, load_model_config, orbax_to_hf
from glm5_jax.convert.synthetic import write_random_hub_checkpoint
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint
from glm5_jax.quant import int4

ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402

GROUP = 8
CONFIG = json.load(open(os.path.join(os.path.dirname(__file__), "tiny_glm5_config.json")))
CONFIG = {**CONFIG, "moe_intermediate_size": 64, "num_hidden_layers": 2}     # expert widths multiple of 8 G


def our_dequantized(w_OI):
    """Our INT4 routine on a hub [out, in] weight (groups along `in`), back in hub layout."""
    q, scale = int4.quantize(np.asarray(w_OI, np.float32).T, GROUP)
    return np.asarray(int4.dequantize(q, scale, GROUP)).T


def test_int4_export_decompresses_in_compressed_tensors_and_imports_back(tmp_path):
    src, orbax, out = (str(tmp_path / n) for n in ("hf", "orbax", "int4"))
    write_random_hub_checkpoint(src, CONFIG, dtype=np.dtype(np.float32))
    hf_to_orbax(src, orbax, dtype="float32")
    orbax_to_hf(orbax, out, int4=True, int4_group_size=GROUP)

    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    config = ct_quant.QuantizationConfig.model_validate(qc)          # the library accepts our config
    scheme = config.config_groups["group_0"]
    assert scheme.weights.group_size == GROUP and scheme.weights.num_bits == 4

    source, exported = SafetensorsCheckpoint(src), SafetensorsCheckpoint(out)
    experts = [k for k in source.keys() if ".mlp.experts." in k]
    assert len(experts) == 3 * 4 * 2                                 # 3 linears x 4 experts x (1 MoE + MTP)
    for key in experts:
        base = key[: -len("weight")]
        assert key not in exported and exported.dtype(base + "weight_packed") == np.int32
        state = {s: torch.from_numpy(np.array(exported.raw(base + s), np.float32)
                                     if s == "weight_scale" else np.array(exported.raw(base + s)))
                 for s in ("weight_packed", "weight_scale", "weight_shape")}
        theirs = PackedQuantizationCompressor.decompress(state, scheme)["weight"].numpy()
        np.testing.assert_array_equal(theirs, our_dequantized(source.raw(key)), err_msg=key)
    for key in source.keys():                                         # everything else untouched
        if ".mlp.experts." not in key:
            np.testing.assert_array_equal(exported.raw(key), source.raw(key), err_msg=key)

    back = str(tmp_path / "orbax_back")
    hf_to_orbax(out, back, dtype="float32")
    cfg = load_model_config(back)
    assert cfg.quant == "int4_qat" and cfg.quant_group_size == GROUP
    again = str(tmp_path / "int4_again")
    orbax_to_hf(back, again, int4=True)                              # the imported group size is kept
    second = SafetensorsCheckpoint(again)
    assert sorted(second.keys()) == sorted(exported.keys())
    for key in exported.keys():
        np.testing.assert_array_equal(second.raw(key), exported.raw(key), err_msg=key)


def test_int4_export_rejects_fp8_together(tmp_path):
    with pytest.raises(CheckpointError, match="choose one"):
        orbax_to_hf(str(tmp_path / "x"), str(tmp_path / "y"), int4=True, fp8=True)
