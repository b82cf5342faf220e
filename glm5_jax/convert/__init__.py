"""Checkpoint conversion between the Hugging Face hub layout and our orbax checkpoint, both ways, streaming.

    python -m glm5_jax.convert hf-to-orbax --hf_dir=D --out_dir=O [--dtype=bfloat16] [--mesh=fsdp:4,expert:2] [--overwrite]
    python -m glm5_jax.convert orbax-to-hf --ckpt_dir=O --out_dir=D2 [--shard_size=5GB] [--fp8] [--dtype=...]
                                           [--tokenizer=T] [--overwrite]

Hub side (docs/architecture.md#checkpoint-layout-hf-keys): ``config.json``, ``model-0000i-of-0000n.safetensors`` (or
one ``model.safetensors``),
``model.safetensors.index.json``, the tokenizer files (glm5_jax/convert/tokenizer_files.py); PyTorch ``[out, in]``
weights, per-expert keys, MTP as layer ``num_hidden_layers``. Reads GLM-5 (``glm_moe_dsa``), DeepSeek-V3.2
(``deepseek_v32``) and DeepSeek-V3, in bf16/fp16/fp32 or the block-FP8 layout (``weight_scale_inv``, 128x128 blocks,
docs/architecture.md#fp8-block-quantisation).

Orbax side (a `CheckpointManager` directory, step 0)::

    O/0/state/                     PyTree {"params": {...}, "moe_bias": {...}} exactly as Transformer(cfg) uses
                                   (layers stacked per scanned segment, experts stacked [E, in, out])
    O/0/_CHECKPOINT_METADATA       custom_metadata = {"hf_config": source config.json,
                                   "model_config": ModelConfig fields, "hf_dtypes": {leaf name: hub dtype}}

Restore: ``ocp.CheckpointManager(O).restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))``
with ``abstract = {"params": ..., "moe_bias": ...}`` of ShapeDtypeStructs carrying the target shardings;
`load_model_config(O)` gives the ModelConfig. Router weights and the correction bias stay fp32
(docs/architecture.md#routing-bias-is-a-buffer-fp32).

Both directions validate everything before writing, write into a temporary sibling directory and
rename it into place only on success, and print a progress bar and a summary line.
"""
from glm5_jax.convert.hf_to_orbax import hf_to_orbax
from glm5_jax.convert.orbax_to_hf import load_model_config, orbax_to_hf

__all__ = ["hf_to_orbax", "orbax_to_hf", "load_model_config"]
