"""GLM-5.3-Flash decoding over the cache (MLA latent rows + KDA conv / recurrent state) equals the full
forward and transformers' greedy generate."""
import jax
import jax.numpy as jnp
import numpy as np
import torch

from glm5_jax import load_hf
from glm5_jax.generate.decoding import generate
from hf_reference_flash import build_flash_model, flash_logits


def test_greedy_generate_equals_transformers_and_the_full_forward(tmp_path):
    """Prompts of 23 and 14 tokens, prefilled 5 at a time (the 23-token row's last chunk would overlap its
    predecessor: recurrent layers prefill whole chunks instead), then 6 greedy tokens."""
    model = build_flash_model()
    model.save_pretrained(tmp_path)
    cfg, variables = load_hf(str(tmp_path))
    T, N = 23, 6
    ids = np.random.default_rng(5).integers(1, cfg.vocab_size, (2, T))
    lengths = np.array([T, 14])
    res = generate(cfg, variables, ids, lengths, max_new_tokens=N, temperature=0.0, prefill_chunk=5)
    for b, L in enumerate(lengths):
        ours = np.asarray(res.tokens[b])
        with torch.no_grad():
            hf = model.generate(torch.as_tensor(ids[b:b + 1, :L]), max_new_tokens=N, do_sample=False)[0, L:].numpy()
        np.testing.assert_array_equal(ours, hf)
        # greedy logprobs are the model's own: those of the full forward over prompt + generated tokens
        full = flash_logits(model, np.concatenate([ids[b, :L], ours])[None])[0, L - 1:L - 1 + N]
        want = np.asarray(jax.nn.log_softmax(jnp.asarray(full), -1))[np.arange(N), ours]
        np.testing.assert_allclose(np.asarray(res.logprobs[b]), want, atol=1e-5, rtol=0)
