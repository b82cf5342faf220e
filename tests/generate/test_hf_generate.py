"""Greedy tokens equal transformers' greedy `generate` on a tiny converted checkpoint (with its cache)."""
import numpy as np
import torch

from glm5_jax import load_hf
from glm5_jax.generate.decoding import generate
from hf_reference import build_hf_model


def test_greedy_tokens_equal_hf_generate(tmp_path):
    model = build_hf_model("shared_index")
    model.save_pretrained(tmp_path)
    cfg, variables = load_hf(str(tmp_path))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 7), rng.integers(0, cfg.vocab_size, 13)]
    prompts[0][2] = 0                               # a real token equal to pad_token_id: the mask keeps it
    N = 16                                          # 13 + 16 > index_topk = 8: decode-time DSA selects
    want = []
    for p in prompts:                               # HF one row at a time (its batched path left-pads)
        with torch.no_grad():
            # without an explicit mask transformers infers one from pad_token_id and would drop token 0
            out = model.generate(torch.as_tensor(p[None]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].numpy())
    batch = np.zeros((2, 13), np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    ours = generate(cfg, variables, batch, [7, 13], max_new_tokens=N, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours.tokens), np.stack(want))
