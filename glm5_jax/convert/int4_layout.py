"""Routed experts as INT4 in the compressed-tensors "pack-quantized" layout (what vLLM and llm-compressor
read), quantised with our one INT4 routine (glm5_jax/quant/int4.py), and its import.

Each routed-expert linear ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`` is stored as
``weight_packed`` int32 [out, in/8] (eight consecutive input channels per word, value + 8 in bits
4j..4j+3 for the j-th), ``weight_scale`` [out, in/G] and ``weight_shape`` int64 [2]; the weight is
``(nibble - 8) * scale`` per group of G input channels. Everything else stays dense.

`DecompressedView` presents such a checkpoint to the importer as if the experts were dense fp32 weights
(the exact dequantised values, so re-quantising them gives back the same packed words).
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.quant import int4

EXPERT_KEY = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
SCALE_NUMPY = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def is_packed(hub_key: str) -> bool:
    return bool(EXPERT_KEY.match(hub_key))


def sibling(weight_key: str, suffix: str) -> str:
    return weight_key[: -len("weight")] + suffix


def tensor_specs(weight_key: str, shape_OI, group_size: int, scale_dtype: str):
    """(key, dtype, shape) of the three tensors that replace ``weight_key``."""
    out, inp = shape_OI
    return [(sibling(weight_key, "weight_packed"), np.dtype(np.int32), (out, inp // int4.PER_WORD)),
            (sibling(weight_key, "weight_scale"), SCALE_NUMPY[scale_dtype], (out, inp // group_size)),
            (sibling(weight_key, "weight_shape"), np.dtype(np.int64), (2,))]


def compress(w_OI: np.ndarray, group_size: int, scale_dtype: str):
    """Hub [out, in] weight -> (weight_packed int32 [out, in/8], weight_scale [out, in/G], weight_shape)."""
    q_KN, scale_gN = int4.quantize(np.asarray(w_OI, np.float32).T, group_size, scale_dtype)   # groups along `in`
    q_OI = np.asarray(q_KN).T.astype(np.int64) + 8
    out, inp = q_OI.shape
    nibbles = q_OI.reshape(out, inp // int4.PER_WORD, int4.PER_WORD)
    words = (nibbles << (4 * np.arange(int4.PER_WORD))).sum(-1).astype(np.uint32).view(np.int32)
    scale = np.asarray(scale_gN).T.astype(SCALE_NUMPY[scale_dtype])
    return np.ascontiguousarray(words), np.ascontiguousarray(scale), np.array([out, inp], np.int64)


def decompress(packed_Ow: np.ndarray, scale_Og: np.ndarray, shape) -> np.ndarray:
    """Inverse of `compress` up to quantisation: the dequantised fp32 [out, in] weight."""
    out, inp = (int(s) for s in shape)
    if packed_Ow.shape != (out, inp // int4.PER_WORD) or inp % scale_Og.shape[-1] or scale_Og.shape[0] != out:
        raise CheckpointError(f"INT4 pack-quantized tensors: packed {list(packed_Ow.shape)} / scale "
                              f"{list(scale_Og.shape)} do not fit weight_shape {[out, inp]}")
    words = packed_Ow.view(np.uint32)[:, :, None] >> (4 * np.arange(int4.PER_WORD, dtype=np.uint32))
    q = (words & 0xF).astype(np.float32).reshape(out, inp) - 8
    return q * np.repeat(scale_Og.astype(np.float32), inp // scale_Og.shape[-1], axis=1)


def quantization_config(group_size: int) -> dict:
    """compressed-tensors ``quantization_config``: symmetric INT4, per-group weights, routed experts only."""
    scheme = {"targets": [EXPERT_TARGET], "format": "pack-quantized",
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"},
              "input_activations": None, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": [], "kv_cache_scheme": None}


def check_config(qc: dict) -> int:
    """The group size of a compressed-tensors config we can import; errors name what is unsupported."""
    groups = qc.get("config_groups") or {}
    fmt = qc.get("format")
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (group.get("format") or fmt) != "pack-quantized" or w.get("num_bits") != 4 or w.get("type") != "int" \
                or not w.get("symmetric", True) or w.get("strategy") != "group":
            raise CheckpointError(f"quantization_config.config_groups.{name}: only symmetric per-group INT4 "
                                  f"pack-quantized weights are supported, got format={group.get('format') or fmt} "
                                  f"weights={w}")
    sizes = {g["weights"]["group_size"] for g in groups.values()}
    if len(sizes) != 1:
        raise CheckpointError(f"quantization_config: expected one group_size, got {sorted(sizes)}")
    return sizes.pop()


class DecompressedView:
    """A `SafetensorsCheckpoint` look-alike in which every pack-quantized linear appears as its dense
    fp32 ``.weight``; other tensors pass through."""

    def __init__(self, ckpt):
        self.ckpt, self.dir = ckpt, ckpt.dir
        self.packed = {k[: -len("_packed")] for k in ckpt.keys() if k.endswith(".weight_packed")}
        hidden = {sibling(w, s) for w in self.packed for s in SUFFIXES}
        self._keys = [k for k in ckpt.keys() if k not in hidden] + sorted(self.packed)

    def keys(self):
        return self._keys

    def __contains__(self, name):
        return name in self.packed or (name in self.ckpt and not name.rsplit(".", 1)[-1] in SUFFIXES)

    def shape(self, name):
        if name in self.packed:
            return tuple(int(s) for s in self.ckpt.raw(sibling(name, "weight_shape")))
        return self.ckpt.shape(name)

    def dtype(self, name):
        return np.dtype(np.float32) if name in self.packed else self.ckpt.dtype(name)

    def read_rows(self, name, rows: slice, out=None):
        if name not in self.packed:
            return self.ckpt.read_rows(name, rows, out)
        shape = self.shape(name)
        packed = self.ckpt.read_rows(sibling(name, "weight_packed"), rows)
        scale = self.ckpt.read_rows(sibling(name, "weight_scale"), rows)
        w = decompress(packed, scale, (packed.shape[0], shape[1]))
        if out is None:
            return w
        out[...] = w
        return out
