"""Generation throughput: our jitted latent-cache decode vs transformers' `generate`, same weights, same run.

Model: configs/bench_small.py (random weights built by transformers, loaded into ours with load_hf).
Prompt 512 random tokens, 128 new tokens, greedy, no EOS; batch 1 and 8. tokens/s counts new tokens over
the whole call (prefill included) for both. Ours runs in bf16 (weights cast once) and fp32; HF in fp32
(torch CPU, eager attention, its default cache).

``bandwidth_fraction``: decode on a CPU is bound by memory reads, so it compares the bytes a decode step
must read -- the weights it touches (dense parts, the lm head, and per MoE layer the experts that the
batch can route to: min(E, B * top_k)) plus the cache entries DSA reads (every visible indexer key, the
selected latent rows) -- times decode steps/s (from the call with 128 new tokens minus the one with 1)
against the read bandwidth of a large array reduction measured in the same run.

    python bench/decode.py --out=bench/results/decode.json
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glm5_jax import load_hf  # noqa: E402
from glm5_jax.experiment import load_config_file  # noqa: E402
from glm5_jax.generate import prepare_generate  # noqa: E402
from glm5_jax.kv_cache import cache_bytes_per_token  # noqa: E402
from glm5_jax.layer_plan import layer_kinds  # noqa: E402


def read_bandwidth(nbytes=1 << 30, reps=5):
    """Best-of bytes/s of summing a large fp32 array (numpy and jitted XLA; the faster counts)."""
    x = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    best = 0.0
    for fn in (lambda: np.add.reduce(x), jax.jit(jnp.sum).lower(x).compile()):
        arg = () if fn.__class__.__name__ == "function" else (jnp.asarray(x),)
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*arg))
            best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def weight_bytes_per_step(cfg, params, batch, itemsize):
    """Bytes of weights one decode step reads (embedding: only the batch's rows)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = 0
    expert_names = ("gate_proj", "up_proj", "down_proj")
    n_moe = sum(k.mlp == "moe" for k in layer_kinds(cfg))
    for path, x in leaves:
        keys = [getattr(p, "key", "") for p in path]
        if keys[0] == "mtp":
            continue                                     # plain decoding does not run the MTP module
        if keys[0] == "embed":
            total += batch * x.shape[-1] * itemsize
        elif "moe" in keys and keys[-1] in expert_names and "shared_expert" not in keys:
            per_expert = x.size // (n_moe * cfg.n_routed_experts) if x.ndim == 4 else x.size // cfg.n_routed_experts
            layers = x.size // (per_expert * cfg.n_routed_experts)
            total += layers * min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok) * per_expert * itemsize
        else:
            total += x.size * itemsize
    return total


def cache_bytes_per_step(cfg, batch, length, itemsize):
    """DSA decode reads every visible indexer key and the selected latent rows (shared layers reuse)."""
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    selected = min(cfg.index_topk, length)
    per_row = sum((length * cfg.index_head_dim if t == "full" else 0) + selected * width
                  for t in cfg.layer_indexer_types)
    return batch * per_row * itemsize


def time_ours(cfg, variables, prompt, n_new, reps):
    lengths = np.full((prompt.shape[0],), prompt.shape[1], np.int32)
    fn, args = prepare_generate(cfg, variables, prompt, lengths, max_new_tokens=n_new, temperature=0.0)
    compiled = fn.lower(*args).compile()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    assert int(out.lengths.min()) == n_new
    return best, np.asarray(out.tokens)


def time_hf(model, prompt, n_new, threads):
    import torch
    torch.set_num_threads(threads)
    ids = torch.as_tensor(prompt, dtype=torch.long)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)   # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t0
    return seconds, out[:, prompt.shape[1]:].numpy()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/bench_small.py")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf_threads", type=int, default=2)
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg32 = load_config_file(args.config).model.replace(dtype="float32", param_dtype="float32")
    torch.manual_seed(0)
    hf_model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg32.to_hf(), attn_implementation="eager")).eval()
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        cfg_loaded, variables32 = load_hf(d, dtype="float32")
    cfg32 = cfg32.replace(num_nextn_predict_layers=cfg_loaded.num_nextn_predict_layers,
                          mtp_depth=cfg_loaded.mtp_depth)
    cfg16 = cfg32.replace(dtype="bfloat16", param_dtype="bfloat16")
    variables16 = {**variables32, "params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), variables32["params"])}

    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; cache bytes per token (bf16) "
          f"{cache_bytes_per_token(cfg16)}; prompt {args.prompt_len}, new tokens {args.new_tokens}")
    rows = []
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        prompt = rng.integers(2, cfg32.vocab_size, (batch, args.prompt_len)).astype(np.int32)
        row = {"batch": batch}
        for name, cfg, variables in (("bf16", cfg16, variables16), ("fp32", cfg32, variables32)):
            total, tokens = time_ours(cfg, variables, prompt, args.new_tokens, args.reps)
            prefill, _ = time_ours(cfg, variables, prompt, 1, args.reps)
            steps_per_sec = (args.new_tokens - 1) / max(total - prefill, 1e-9)
            itemsize = 2 if name == "bf16" else 4
            step_bytes = (weight_bytes_per_step(cfg, variables["params"], batch, itemsize) +
                          cache_bytes_per_step(cfg, batch, args.prompt_len + args.new_tokens // 2, itemsize))
            row[f"ours_{name}_tokens_per_sec"] = batch * args.new_tokens / total
            row[f"ours_{name}_decode_steps_per_sec"] = steps_per_sec
            row[f"ours_{name}_bytes_per_step"] = step_bytes
            row[f"ours_{name}_bandwidth_fraction"] = step_bytes * steps_per_sec / bandwidth
            row[f"ours_{name}_prefill_s"] = prefill
            if name == "fp32":
                fp32_tokens = tokens
        row["ours_tokens_per_sec"] = row["ours_bf16_tokens_per_sec"]
        row["bandwidth_fraction"] = row["ours_bf16_bandwidth_fraction"]
        if not args.skip_hf:
            seconds, hf_tokens = time_hf(hf_model, prompt, args.new_tokens, args.hf_threads)
            row["hf_tokens_per_sec"] = batch * args.new_tokens / seconds
            row["ratio"] = row["ours_tokens_per_sec"] / row["hf_tokens_per_sec"]
            row["fp32_greedy_agrees_with_hf"] = float(np.mean(fp32_tokens == hf_tokens))
        rows.append(row)
        print_row(row)
    result = {"config": args.config, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "read_bandwidth_bytes_per_sec": bandwidth, "cache_bytes_per_token": cache_bytes_per_token(cfg16),
              "cache_bytes_per_token_glm5_bf16": _glm5_cache_bytes(), "hf_threads": args.hf_threads, "rows": rows}
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _glm5_cache_bytes():
    from configs.glm5_744b import model_config
    return cache_bytes_per_token(model_config(), "bfloat16")


def print_row(r):
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)


def print_table(rows):
    print(f"{'batch':>5} {'ours bf16 tok/s':>16} {'ours fp32 tok/s':>16} {'HF tok/s':>9} {'ratio':>6} "
          f"{'decode steps/s':>15} {'bw fraction':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ours_bf16_tokens_per_sec']:>16.1f} {r['ours_fp32_tokens_per_sec']:>16.1f} "
              f"{r.get('hf_tokens_per_sec', float('nan')):>9.1f} {r.get('ratio', float('nan')):>6.2f} "
              f"{r['ours_bf16_decode_steps_per_sec']:>15.1f} {r['bandwidth_fraction']:>12.2f}")


if __name__ == "__main__":
    main()
