"""A tiny GLM-5 whose expert widths INT4 can pack with small groups, and a numpy INT4 oracle."""
import numpy as np
import ml_dtypes

from tests.generate.tiny_models import TINY

GROUP = 8
# experts' input widths (hidden 64, moe_intermediate 64) are multiples of 8 * GROUP
TINY_Q = TINY.replace(moe_intermediate_size=64, quant_group_size=GROUP, num_hidden_layers=2,
                      indexer_types=("full", "shared"), mtp_depth=1)


def numpy_fake_quantize(w_KN, group, scale_dtype=ml_dtypes.bfloat16):
    """Independent INT4 oracle: amax/7 per group rounded to the scale dtype, round-half-even, clip."""
    w = np.asarray(w_KN, np.float32)
    *lead, K, N = w.shape
    g = w.reshape(*lead, K // group, group, N)
    scale = (np.abs(g).max(axis=-2, keepdims=True) / np.float32(7)).astype(scale_dtype).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale == 0, 0, np.clip(np.round(g / scale), -8, 7))
    return (q * scale).reshape(w.shape).astype(np.float32)
