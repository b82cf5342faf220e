"""Timing of one HF transformers GlmMoeDsaForCausalLM train step (torch CPU, AdamW).

The baseline of bench/train_step.py: the same architecture built from ``config_to_hf(ModelConfig)`` with random
weights in the config's dtype, forward with ``labels`` (next-token loss), backward,
``torch.optim.AdamW.step``. Attention is transformers' default for this model, "sdpa"
(torch.nn.functional.scaled_dot_product_attention); bench/train_step.py --hf_attn=eager times the eager
form instead (both give the same loss).
"""
from __future__ import annotations

import time

import numpy as np

from glm5_jax.hf.config import config_to_hf


class HFStep:
    """The HF model, its AdamW and a fixed random batch; calling it runs one train step -> seconds."""

    def __init__(self, model_cfg, batch: int, seq_len: int, threads: int, attn_implementation: str = "sdpa"):
        import torch
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        hf_cfg = GlmMoeDsaConfig(**config_to_hf(model_cfg), attn_implementation=attn_implementation)
        self.model = GlmMoeDsaForCausalLM(hf_cfg).to(getattr(torch, model_cfg.runtime.dtype)).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.ids = torch.as_tensor(np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch, seq_len)))
        self.loss = None

    def __call__(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        self.loss = loss.item()
        return seconds
