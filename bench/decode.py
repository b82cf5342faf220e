"""Generation throughput: our jitted latent-cache decode vs transformers' `generate`, same weights, same run.

Model: configs/bench_small.py (random weights built by transformers, loaded into ours with load_hf).
Prompt 512 random tokens, 128 new tokens, greedy, no EOS; batch 1 and 8. tokens/s counts new tokens over
the whole call (prefill included) for both. Both sides run in the dtype(s) named by --dtypes, chosen before
the run (each dtype is one row per batch: ours and HF with the same weights cast to it). HF uses its
defaults: "sdpa" attention (--hf_attn) and its default cache, torch threads = --hf_threads (2, the cores XLA uses here).

Timing: after one untimed call of each (ours compiles; HF's first generate), the three calls -- ours with
128 new tokens, ours with 1 (its prefill), HF's generate -- alternate for --reps rounds, so every median
sees the same machine state; each side reports the median of the same number of runs.

``bandwidth_fraction``: decode on a CPU is bound by memory reads, so it compares the bytes a decode step
must read -- the weights it touches (dense parts, the lm head, and per MoE layer the experts that the
batch can route to: min(E, B * top_k)) plus the cache entries DSA reads (every visible indexer key, the
selected latent rows) -- times decode steps/s (from the median call with 128 new tokens minus the median
with 1) against the read bandwidth of a large array reduction measured in the same run.

    python bench/decode.py --out=bench/results/decode.json                        # float32, batch 1 and 8
    python bench/decode.py --dtypes=float32,bfloat16 --out=bench/results/decode.json
    python bench/decode.py --batches=1 --prompt_len=32 --new_tokens=8 --reps=1    # smoke run
"""
import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import interleaved_seconds  # noqa: E402
from glm5_jax import load_hf  # noqa: E402
from glm5_jax.generate.decoding import prepare_generate  # noqa: E402
from glm5_jax.hf.config import config_to_hf
from glm5_jax.model.kv_cache import cache_bytes_per_token  # noqa: E402
from glm5_jax.model.layer_plan import layer_kinds  # noqa: E402
from glm5_jax.train.experiment import load_config_file  # noqa: E402

ITEMSIZE = {"float32": 4, "bfloat16": 2}


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


class OursDecode:
    """Our generate, compiled for one prompt batch; calling it runs it -> seconds (tokens kept)."""

    def __init__(self, cfg, variables, prompt, n_new):
        lengths = np.full((prompt.shape[0],), prompt.shape[1], np.int32)
        fn, self.args = prepare_generate(cfg, variables, prompt, lengths, max_new_tokens=n_new, temperature=0.0)
        self.compiled = fn.lower(*self.args).compile()
        self.n_new, self.tokens = n_new, None

    def __call__(self) -> float:
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.compiled(*self.args))
        seconds = time.perf_counter() - t0
        if int(out.lengths.min()) != self.n_new:
            raise RuntimeError(f"a row stopped before {self.n_new} new tokens")
        self.tokens = np.asarray(out.tokens)
        return seconds


class HFDecode:
    """transformers' greedy `generate` of exactly n_new tokens; calling it -> seconds (tokens kept)."""

    def __init__(self, model, prompt, n_new):
        import torch
        self.model, self.n_new, self.tokens = model, n_new, None
        self.ids = torch.as_tensor(prompt, dtype=torch.long)

    def __call__(self) -> float:
        import torch
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model.generate(self.ids, max_new_tokens=self.n_new, min_new_tokens=self.n_new,
                                      do_sample=False, pad_token_id=0)
            seconds = time.perf_counter() - t0
        self.tokens = out[:, self.ids.shape[1]:].numpy()
        return seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/bench_small.py")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--dtypes", default="float32", help="comma-separated; both sides run in each")
    p.add_argument("--reps", type=int, default=3, help="timed rounds (ours, ours prefill, HF alternate)")
    p.add_argument("--hf_threads", type=int, default=2, help="torch.set_num_threads for HF")
    p.add_argument("--hf_attn", default="sdpa", choices=["sdpa", "eager"],
                   help="HF attn_implementation (sdpa: transformers' default for this model)")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    for dtype in dtypes:
        if dtype not in ITEMSIZE:
            raise SystemExit(f"--dtypes: {dtype!r} is not one of {sorted(ITEMSIZE)}")

    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.set_num_threads(args.hf_threads)
    cfg32 = load_config_file(args.config).model.replace(dtype="float32", param_dtype="float32")
    torch.manual_seed(0)
    hf_model32 = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**config_to_hf(cfg32), attn_implementation=args.hf_attn)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf_model32.save_pretrained(d)
        cfg_loaded, variables32 = load_hf(d, dtype="float32")
    cfg32 = cfg32.replace(num_nextn_predict_layers=cfg_loaded.num_nextn_predict_layers,
                          mtp_depth=cfg_loaded.mtp_depth)

    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; cache bytes per token (bf16) "
          f"{cache_bytes_per_token(cfg32, 'bfloat16')}; prompt {args.prompt_len}, new tokens {args.new_tokens}; "
          f"HF attention {hf_model32.config._attn_implementation}, {args.hf_threads} torch threads")
    rows = []
    for dtype in dtypes:
        cfg = cfg32.replace(dtype=dtype, param_dtype=dtype)
        variables = {**variables32, "params": jax.tree.map(lambda x: x.astype(dtype), variables32["params"])}
        hf_model = copy.deepcopy(hf_model32).to(getattr(torch, dtype))      # cast from the fp32 weights
        rng = np.random.default_rng(0)
        for batch in [int(b) for b in args.batches.split(",")]:
            prompt = rng.integers(2, cfg.vocab_size, (batch, args.prompt_len)).astype(np.int32)
            calls = {"ours": OursDecode(cfg, variables, prompt, args.new_tokens),
                     "ours_prefill": OursDecode(cfg, variables, prompt, 1)}
            if not args.skip_hf:
                calls["hf"] = HFDecode(hf_model, prompt, args.new_tokens)
            times = interleaved_seconds(calls, args.reps, warmup=1)
            median = {name: statistics.median(ts) for name, ts in times.items()}
            steps_per_sec = (args.new_tokens - 1) / max(median["ours"] - median["ours_prefill"], 1e-9)
            step_bytes = (weight_bytes_per_step(cfg, variables["params"], batch, ITEMSIZE[dtype]) +
                          cache_bytes_per_step(cfg, batch, args.prompt_len + args.new_tokens // 2, ITEMSIZE[dtype]))
            row = {"batch": batch, "dtype": dtype, "ours_tokens_per_sec": batch * args.new_tokens / median["ours"],
                   "ours_decode_steps_per_sec": steps_per_sec, "ours_prefill_s": median["ours_prefill"],
                   "ours_bytes_per_step": step_bytes, "bandwidth_fraction": step_bytes * steps_per_sec / bandwidth,
                   "seconds": times}
            if not args.skip_hf:
                row["hf_tokens_per_sec"] = batch * args.new_tokens / median["hf"]
                row["ratio"] = row["ours_tokens_per_sec"] / row["hf_tokens_per_sec"]
                row["greedy_agrees_with_hf"] = float(np.mean(calls["ours"].tokens == calls["hf"].tokens))
            rows.append(row)
            print_row(row)
    result = {"config": args.config, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "reps": args.reps, "statistic": "median", "read_bandwidth_bytes_per_sec": bandwidth,
              "cache_bytes_per_token": cache_bytes_per_token(cfg32, "bfloat16"),
              "cache_bytes_per_token_glm5_bf16": _glm5_cache_bytes(), "hf_threads": args.hf_threads,
              "hf_attn_implementation": hf_model32.config._attn_implementation, "rows": rows}
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
    print("| batch | dtype | ours tok/s | HF tok/s | ratio | ours decode steps/s | ours prefill s | "
          "bandwidth fraction |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['dtype']} | {r['ours_tokens_per_sec']:.1f} | "
              f"{r.get('hf_tokens_per_sec', float('nan')):.1f} | {r.get('ratio', float('nan')):.2f} | "
              f"{r['ours_decode_steps_per_sec']:.1f} | {r['ours_prefill_s']:.2f} | {r['bandwidth_fraction']:.2f} |")


if __name__ == "__main__":
    main()
