"""Timing of one HF transformers GlmMoeDsaForCausalLM train step (torch CPU, eager attention, AdamW).

The baseline of bench/train_step.py: the same architecture built from ``ModelConfig.to_hf()`` with random
weights, forward with ``labels`` (next-token loss), backward, ``torch.optim.AdamW.step``.
"""
from __future__ import annotations

import statistics
import time

import numpy as np


def hf_step_seconds(model_cfg, batch: int, seq_len: int, steps: int, warmup: int, threads: int) -> list[float]:
    """Wall-clock seconds of `steps` timed train steps after `warmup` untimed ones."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    hf_cfg = GlmMoeDsaConfig(**model_cfg.to_hf(), attn_implementation="eager")
    model = GlmMoeDsaForCausalLM(hf_cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch, seq_len)))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def median(xs):
    return statistics.median(xs)
