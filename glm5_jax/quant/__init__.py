"""INT4 weight quantisation: one rounding routine (`int4`) shared by QAT, the offline quantiser and
INT4 inference (`experts`), and decode memory traffic (`traffic`)."""
from glm5_jax.quant.experts import EXPERT_WEIGHTS, Int4Weight, expert_weight, quantize_params

__all__ = ["EXPERT_WEIGHTS", "Int4Weight", "expert_weight", "quantize_params"]
