"""Train-step throughput and MFU of our Trainer vs HF transformers' GlmMoeDsaForCausalLM on CPU.

One step = forward + backward + optimizer update (AdamW) of configs/bench_small.py on random tokens,
timed in steady state (median of --steps after warm-up) at each sequence length. Our step and HF's
alternate (ours, ours+MTP, HF, ours, ...), so both medians see the same machine state. MFU uses
glm5_jax.cost.flops.train_flops_per_token (6 x active matmul params + attention over the attended keys +
indexer) and the fp32 matmul peak measured in the same run. HF runs in the config's dtype (fp32) with
transformers' default "sdpa" attention (--hf_attn) and --hf_threads torch threads (2: the cores XLA uses here).

    python bench/train_step.py --out=bench/results/train_step.json          # T = 1024, 4096
    python bench/train_step.py --quick --seq_lens=128 --steps=1 --warmup=1   # smoke run, tiny dims
    python bench/train_step.py --set=model.moe_impl=ragged_dot               # try a model setting

Speed settings of configs/bench_small.py (XLA:CPU; timings of fwd+bwd at B=2, measured before
XLA:CPU tuning was retired as a goal; the CPU step is now a regression check):
- moe_impl="blocked" (glm5_jax/model/moe/blocked.py): a loop over 128-row expert blocks with a hand-written
  backward (one MoE layer ~6x faster than ragged_dot on XLA:CPU).
- mla_form="absorbed" with attention_impl="xla" (pallas_kernels/sparse_mla/ops.py): the leading causal
  128-query blocks that score <= 4k keys attend through the top-k mask in the absorbed form
  (masked_dense.py), the rest over their k gathered latent rows with the probabilities kept for the
  backward while they fit a memory budget (gather_saved.py; T=4096 25.5 vs 27.3 s/step against rerunning
  each chunk's forward). The split: T=4096 22.7 vs 24.9 s/step for gathering every query. The attention
  probabilities double as the indexer KL target; the KL's selected-key scores have a hand-written VJP
  (indexer_kl/selected_scores.py: one layer's KL at T=4096 185 -> 141 ms forward+backward).
- projection_impl="cpu_transposed_grad": the projections' weight gradients in the layout XLA:CPU
  multiplies fastest.
- remat_policy="dots_attention_saveable": keeps projection outputs, the top-k selection and the
  attention cores' named results, so the backward never reruns an attention forward (8% faster step than
  "dots_with_no_batch_dims_saveable" at 3 layers, T=1024, when measured on the gather form).
bench/version_ab.py times this step at two git revisions in alternating processes (a code change's cost).
HF's GlmMoeDsaForCausalLM has no MTP module, so the ratio and MFU time our step on that same model
(MTP off); the config's MTP module (one more decoder block and LM head) is timed as a second run,
reported as ours_mtp_tokens_per_sec.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.hf_step import HFStep  # noqa: E402
from bench.timing import interleaved_seconds  # noqa: E402
from glm5_jax.cost.flops import measure_matmul_peak, train_flops_per_token  # noqa: E402
from glm5_jax.data import Batch  # noqa: E402
from glm5_jax.parallel.mesh import build_mesh  # noqa: E402
from glm5_jax.train.experiment import apply_overrides, load_config_file  # noqa: E402
from glm5_jax.train.stage import stage_spec  # noqa: E402
from glm5_jax.train.step import Trainer  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "bench_small.py")
QUICK = ["model.vocab_size=512", "model.hidden_size=64", "model.num_hidden_layers=3", "model.intermediate_size=128",
         "model.num_attention_heads=2", "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.moe_intermediate_size=32",
         "model.index_topk=32", "data.vocab_size=512"]


def random_batch(batch, seq_len, vocab, seed=0):
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, seq_len), dtype=np.int32)
    return Batch(tokens=tokens, positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy(),
                 segment_ids=np.ones((batch, seq_len), np.int32))


class OursStep:
    """A Trainer, its state and a fixed random batch; calling it runs one train step -> seconds."""

    def __init__(self, exp_cfg):
        self.trainer = Trainer(exp_cfg, build_mesh(exp_cfg.mesh))
        self.state = self.trainer.init_state(exp_cfg.train.seed)
        self.batch = self.trainer.put_batch(random_batch(exp_cfg.data.batch_size, exp_cfg.data.seq_len,
                                                         exp_cfg.model.vocab_size))
        self.loss = None

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.state, metrics = self.trainer.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        seconds = time.perf_counter() - t0
        self.loss = float(metrics["loss"])
        if not np.isfinite(self.loss):
            raise RuntimeError(f"non-finite loss {self.loss}")
        return seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--seq_lens", default="1024,4096")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    p.add_argument("--quick", action="store_true", help="tiny dims, for a smoke run")
    p.add_argument("--skip_hf", action="store_true", help="time our step only")
    p.add_argument("--hf_threads", type=int, default=2, help="torch.set_num_threads for the HF baseline")
    p.add_argument("--hf_attn", default="sdpa", choices=["sdpa", "eager"],
                   help="HF attn_implementation (sdpa: transformers' default for this model)")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    base = apply_overrides(load_config_file(args.config), (QUICK if args.quick else []) + args.set)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    peak = measure_matmul_peak(dtype=jnp.float32)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    rows = []
    for T in seq_lens:
        exp_cfg = apply_overrides(base, [f"data.seq_len={T}"]).validate()
        tokens = exp_cfg.data.batch_size * T
        flops = train_flops_per_token(exp_cfg.model, T, sparse=stage_spec(exp_cfg.train.stage).attention_mode == "sparse")
        has_mtp = exp_cfg.model.num_nextn_predict_layers > 0
        same_as_hf = apply_overrides(exp_cfg, ["model.mtp_depth=0", "model.num_nextn_predict_layers=0"]) \
            if has_mtp else exp_cfg
        steps = {"ours": OursStep(same_as_hf)}
        if has_mtp:
            steps["ours_mtp"] = OursStep(exp_cfg)
        if not args.skip_hf:
            steps["hf"] = HFStep(exp_cfg.model, exp_cfg.data.batch_size, T, args.hf_threads, args.hf_attn)
        times = interleaved_seconds(steps, args.steps, args.warmup)
        del steps
        median = {name: statistics.median(ts) for name, ts in times.items()}
        row = {"T": T, "batch": exp_cfg.data.batch_size, "flops_per_token": flops["total"],
               "ours_step_s": median["ours"], "ours_tokens_per_sec": tokens / median["ours"], "step_seconds": times}
        if has_mtp:
            row.update(ours_mtp_step_s=median["ours_mtp"], ours_mtp_tokens_per_sec=tokens / median["ours_mtp"])
        if not args.skip_hf:
            row.update(hf_step_s=median["hf"], hf_tokens_per_sec=tokens / median["hf"],
                       ratio_vs_hf=median["hf"] / median["ours"])
        rows.append(row)
        print(f"T={T}: {flops['total'] / 1e6:.1f} MFLOP/token (matmul {flops['matmul'] / 1e6:.1f}, attention "
              f"{flops['attention'] / 1e6:.1f}, indexer {flops['indexer'] / 1e6:.1f})", flush=True)
    # the peak again after the runs (the larger counts: a probe can only under-measure); MFU from it
    peak = max(peak, measure_matmul_peak(dtype=jnp.float32))
    for row in rows:
        row["mfu"] = row["ours_tokens_per_sec"] * row["flops_per_token"] / (peak * jax.device_count())
    print(f"fp32 matmul peak (best of the probes before and after): {peak / 1e9:.1f} GFLOP/s")
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"peak_flops": peak, "config": os.path.basename(args.config), "quick": args.quick,
                       "overrides": args.set, "hf_attn_implementation": None if args.skip_hf else args.hf_attn,
                       "hf_threads": args.hf_threads, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


def print_table(rows):
    cell = lambda r, k, fmt: format(r[k], fmt) if k in r else "-"  # noqa: E731
    print(f"{'T':>6} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8} {'MFU':>6} {'ours s/step':>12} {'HF s/step':>10} "
          f"{'ours+MTP tok/s':>15}")
    for r in rows:
        print(f"{r['T']:>6} {cell(r, 'ours_tokens_per_sec', '.0f'):>11} {cell(r, 'hf_tokens_per_sec', '.0f'):>9} "
              f"{cell(r, 'ratio_vs_hf', '.2f'):>8} {r['mfu']:>6.1%} {cell(r, 'ours_step_s', '.3f'):>12} "
              f"{cell(r, 'hf_step_s', '.3f'):>10} {cell(r, 'ours_mtp_tokens_per_sec', '.0f'):>15}")


if __name__ == "__main__":
    main()
