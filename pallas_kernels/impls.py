"""Implementation names, defined once: every kernel's ``ops.py`` dispatches on these, and the model's
`RuntimeConfig` switches (attention_impl, moe_impl, quant_matmul, projection_impl) take the same values."""
REFERENCE = "reference"            # the readable XLA oracle (reference.py)
XLA = "xla"                        # the tuned XLA form
PALLAS = "pallas"                  # the Pallas TPU kernel, compiled by Mosaic
PALLAS_INTERPRET = "pallas_interpret"   # the same kernel in the Pallas interpreter (CPU tests)
RAGGED_DOT = "ragged_dot"          # grouped matmul: jax.lax.ragged_dot
GMM = "gmm"                        # grouped matmul: the megablox Pallas kernel
GMM_INTERPRET = "gmm_interpret"    # ... in the Pallas interpreter
AUTO = "auto"                      # grouped matmul: GMM when lowered for TPU, else RAGGED_DOT
BLOCKED = "blocked"                # routed experts as padded row blocks for XLA:CPU (glm5_jax.model.moe.blocked)
CPU_TRANSPOSED_GRAD = "cpu_transposed_grad"   # projections' weight gradient from a materialised x^T (XLA:CPU)

PALLAS_IMPLS = (PALLAS, PALLAS_INTERPRET)      # a pallas_call: must run per shard on a multi-device mesh
GMM_IMPLS = (GMM, GMM_INTERPRET)
