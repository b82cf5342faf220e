"""Batched generation over the latent decode cache (`decoding`); ``python -m glm5_jax.generate`` runs it on a
checkpoint."""
from glm5_jax.generate.decoding import GenerationResult, Sampler, decode_config, generate, prepare_generate

__all__ = ["GenerationResult", "Sampler", "decode_config", "generate", "prepare_generate"]
