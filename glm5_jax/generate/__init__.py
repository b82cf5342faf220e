"""Batched generation over the latent decode cache (`decoding`), on a sampling mesh (`on_mesh`);
``python -m glm5_jax.generate`` runs it on a checkpoint."""
from glm5_jax.generate.decoding import GenerationResult, Sampler, decode_config, generate, prepare_generate
from glm5_jax.generate.on_mesh import generate_on_mesh

__all__ = ["GenerationResult", "Sampler", "decode_config", "generate", "generate_on_mesh", "prepare_generate"]
