"""The GLM-5 network: `ModelConfig`, `Transformer` (MLA + DSA attention, MoE, MTP), the decode cache.

Model code names only logical axes ("batch", "heads", "exp", ...); `glm5_jax.parallel` maps them to a mesh.
"""
