"""GLM-5.3-Flash's model FLOPs: attention counted on the MLA layers only, the KDA recurrence on the rest,
the pooled indexer's scores over pools (hand computation)."""
import importlib.util
import os

import pytest

from glm5_jax.cost.flops import mean_visible_keys, train_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_flash():
    spec = importlib.util.spec_from_file_location("tiny_flash", os.path.join(ROOT, "configs", "tiny_flash.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().model


def test_flash_attention_and_indexer_flops_by_hand():
    cfg = _tiny_flash()      # 8 layers: 2 MLA (H 4, d_qk 32, d_v 32), 6 KDA (4 heads of 32); pools of 16
    T = 256
    got = train_flops_per_token(cfg, T, sparse=True, indexer_loss="none")
    mla = 2 * 4 * (32 + 32) * mean_visible_keys(T, 64 + 15) * 2
    kda = 2 * 4 * 4 * 32 * 32 * 6
    assert got["attention"] == pytest.approx(3 * (mla + kda))
    assert got["indexer_scores"] == pytest.approx(2 * 16 * 24 * 2 * mean_visible_keys(T, None) / 16)
