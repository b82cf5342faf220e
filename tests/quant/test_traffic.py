"""Decode bytes per token against a hand count for the tiny model and GLM-5's expert share."""
from configs.glm5_744b import model_config
from glm5_jax.cost.decode_traffic import decode_bytes_per_token
from tests.quant.quant_helpers import TINY_Q


def test_tiny_model_routed_expert_bytes_by_hand():
    cfg = TINY_Q
    routed = 1 * 2 * 3 * 64 * 64          # 1 MoE layer x K=2 experts x 3 matrices x D x F
    bf16, q = decode_bytes_per_token(cfg, "bf16"), decode_bytes_per_token(cfg, "int4")
    assert bf16["routed_experts"] == 2 * routed
    assert q["routed_experts"] == routed // 2 + routed // 8 * 2      # nibbles + one bf16 scale per 8
    assert q["other_weights"] == bf16["other_weights"] > 0


def test_glm5_int4_experts_cut_decode_weight_reads():
    cfg = model_config()
    bf16, q = decode_bytes_per_token(cfg, "bf16"), decode_bytes_per_token(cfg, "int4")
    routed = 75 * 8 * 3 * 6144 * 2048      # 75 MoE layers, top-8
    assert bf16["routed_experts"] == 2 * routed and q["routed_experts"] == routed // 2 + routed // 32 * 2
    assert 0.3 < q["total"] / bf16["total"] < 0.7
