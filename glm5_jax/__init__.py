"""glm5-jax: GLM-5 (MLA + DeepSeek Sparse Attention + MoE + MTP) in pure-functional JAX/Flax."""
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.model import Transformer
from glm5_jax.param_count import count_params
from glm5_jax.hf_checkpoint import load_hf

__all__ = ["ConfigError", "ModelConfig", "Transformer", "count_params", "load_hf"]
