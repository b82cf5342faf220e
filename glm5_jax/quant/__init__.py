"""INT4 weight quantisation: the one rounding routine (`int4`) shared by QAT, the offline quantiser
(`glm5_jax.model.moe.int4_weights.quantize_params`) and INT4 inference."""
