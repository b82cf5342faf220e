"""glm5-jax: GLM-5 (MLA + DeepSeek Sparse Attention + MoE + MTP) in pure-functional JAX/Flax.

The package face: the names most users need. Each job lives in its own subpackage (`model`, `parallel`,
`hf`, `checkpoint`, `cost`, `data`, `train`, `generate`, `serve`, `rl`, `convert`, `quant`).
"""
from glm5_jax.hf.checkpoint import load_hf
from glm5_jax.model.config import ConfigError, ModelConfig, RuntimeConfig
from glm5_jax.model.param_count import count_params
from glm5_jax.model.transformer import Transformer

__all__ = ["ConfigError", "ModelConfig", "RuntimeConfig", "Transformer", "count_params", "load_hf"]
