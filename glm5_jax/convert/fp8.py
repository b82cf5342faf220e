"""GLM-5-FP8 / DeepSeek-V3.2 FP8 layout: which weights are quantised, and block quantisation.

Background: docs/architecture.md#fp8-block-quantisation.

Quantised: every 2-D linear weight of attention (q_a/q_b/kv_a/kv_b/o_proj), indexer ``wq_b`` and ``wk``,
dense FFN, routed and shared experts, as ``float8_e4m3fn`` under ``.weight`` plus a float32
``.weight_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]`` with
``W[r, c] = W8[r, c] * scale_inv[r // 128, c // 128]``. Kept in bf16/fp32: embeddings, lm_head, norms,
router, correction bias, indexer ``weights_proj`` and the MTP ``eh_proj``.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np

BLOCK = (128, 128)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)     # 448
_QUANTISED = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|self_attn\.indexer\.(wq_b|wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$")


def is_quantised(hub_key: str) -> bool:
    return bool(_QUANTISED.match(hub_key))


def modules_to_not_convert(num_layers_with_mtp: int) -> list[str]:
    """As the hub writes it, including the ``indexers_proj`` misnomer for ``indexer.weights_proj``.

    Background: docs/architecture.md#fp8-scale-and-module-name-quirks.
    """
    names = ["lm_head", "model.embed_tokens"]
    for i in range(num_layers_with_mtp):
        names += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.self_attn.indexers_proj"]
    return names


def quantization_config(num_layers_with_mtp: int) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK), "modules_to_not_convert": modules_to_not_convert(num_layers_with_mtp)}


def scale_shape(shape_OI, block=BLOCK) -> tuple[int, int]:
    return (-(-shape_OI[0] // block[0]), -(-shape_OI[1] // block[1]))


def quantise_blocks(w_OI: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(W8 float8_e4m3fn [out, in], scale_inv float32 [ceil(out/br), ceil(in/bc)]) with each block's
    absolute maximum mapped to 448; all-zero blocks get scale 1."""
    br, bc = block
    rows, cols = w_OI.shape
    sr, sc = scale_shape(w_OI.shape, block)
    padded = np.zeros((sr * br, sc * bc), np.float32)
    padded[:rows, :cols] = w_OI
    blocks = padded.reshape(sr, br, sc, bc)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX)
    w8 = q.reshape(sr * br, sc * bc)[:rows, :cols].astype(ml_dtypes.float8_e4m3fn)
    return w8, scale
