"""Numerics against transformers that the tests do not pin down, on a tiny HF-saved GLM-5 (5 layers, DSA
top-8 over 48 tokens, norms and routing bias perturbed; hf_reference.py "shared_index"):

    python bench/hf_bf16_fp8.py

1. bf16: our logits (load_hf(dtype="bfloat16")) and transformers' (model.to(bfloat16)) against transformers'
   fp32 logits; both are bf16 approximations of one fp32 model, so their errors are compared with each other.
2. FP8: an orbax-to-hf --fp8 export loaded by transformers (needs `accelerate`; on a machine without a GPU
   transformers dequantises FP8 to bf16), its weights compared with our dequantisation of the same file.
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def logits_of(cfg, variables, ids):
    from glm5_jax import Transformer
    logits = jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, jnp.asarray(ids))
    return np.asarray(logits, np.float32)


def main():
    from glm5_jax import load_hf
    from glm5_jax.convert import hf_to_orbax, orbax_to_hf
    from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint
    from hf_reference import build_hf_model

    work = tempfile.mkdtemp()
    model = build_hf_model("shared_index")
    model.save_pretrained(f"{work}/hf")
    ids = np.random.default_rng(0).integers(0, 300, (2, 48))
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).logits.numpy()
        hf16 = model.to(torch.bfloat16)(torch.as_tensor(ids)).logits.float().numpy()
    ours16 = logits_of(*load_hf(f"{work}/hf", dtype="bfloat16"), ids)
    print(f"bf16 logits, {ids.size} positions, max |fp32 logit| {np.abs(ref).max():.3f}")
    for name, x, y in (("ours bf16 vs transformers fp32", ours16, ref), ("transformers bf16 vs fp32", hf16, ref),
                       ("ours bf16 vs transformers bf16", ours16, hf16)):
        print(f"  {name:34s} max |diff| {np.abs(x - y).max():.4f}  mean {np.abs(x - y).mean():.5f}  "
              f"argmax agree {np.mean(x.argmax(-1) == y.argmax(-1)):.3f}")

    hf_to_orbax(f"{work}/hf", f"{work}/orbax", dtype="float32", stream=open(os.devnull, "w"))
    orbax_to_hf(f"{work}/orbax", f"{work}/fp8", fp8=True, stream=open(os.devnull, "w"))
    try:
        from transformers import AutoModelForCausalLM
        fp8_model = AutoModelForCausalLM.from_pretrained(f"{work}/fp8", attn_implementation="eager")
    except ImportError as e:
        print(f"FP8 export in transformers: not run ({e})")
        return
    ours = SafetensorsCheckpoint(f"{work}/fp8")
    worst, equal, compared = 0.0, 0, 0
    for key, t in fp8_model.state_dict().items():
        if key.endswith(".weight") and key[: -len("weight")] + "weight_scale_inv" in ours.keys():
            mine = np.asarray(ours.get(key, (128, 128)), np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
            theirs = t.float().numpy()
            if mine.shape == theirs.shape:
                err = float(np.abs(mine - theirs).max())
                worst, equal, compared = max(worst, err), equal + (err == 0), compared + 1
    print(f"FP8 export in transformers ({next(fp8_model.parameters()).dtype}): {compared} quantised weights "
          f"compared with ours rounded to bf16: {equal} equal, max |diff| {worst:.4g}")


if __name__ == "__main__":
    main()
