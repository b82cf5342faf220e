"""Serving over the latent cache: `engine` (continuous batching, prefix reuse), `api` (OpenAI-compatible
HTTP + token in / token out), `router` (session-affine routing over replicas); `python -m glm5_jax.serve`."""
