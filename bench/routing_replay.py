"""Train / inference mismatch with and without routing replay, in RL runs: the multi-turn number-guessing task
played through the policy server (configs/rl_guess.py, the default) or the single-turn sorting task
(configs/rl_sort.py).

    python bench/routing_replay.py --out=bench/results/routing_replay.json [--config=configs/rl_guess.py]
        [--workdir=/tmp/glm5_replay_bench] [--versions=20]

Every arm starts from one SFT checkpoint and runs lockstep with tau = 0 (batch o sampled under exactly version
o: the same episodes, prompts and keys in every arm, whatever the timing). The sampler differs from the
fp32 learner by its compute dtype (bf16) and, in the INT4 arms, by its routed experts (the versions carry
INT4-packed experts, the one rounding QAT uses). With replay the generator records each token's experts and
DSA top-k (rl.replay_experts, rl.replay_topk) and the learner's forward takes them over.

Per version the learner logs, over the batch's loss tokens: mean |log pi_learner - log pi_sampler|
(logp_abs_diff), mean |r - 1| of the importance ratio r (ratio_dev), its max (ratio_max_dev), the fraction of
tokens the double-sided IS keeps (keep_fraction), and the batch's mean reward. Prints a table, writes --out
and a plot of the mismatch beside the reward curve.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glm5_jax.rl.run import Supervisor, child_env  # noqa: E402

REPLAY = ["rl.replay_experts=True", "rl.replay_topk=True"]
BF16 = ["rl.sampler_dtype=bfloat16"]
INT4 = BF16 + ["rl.handoff_int4_experts=True"]
ARMS = {   # label -> overrides
    "fp32 sampler": [],
    "bf16 sampler": BF16,
    "bf16 sampler + replay": BF16 + REPLAY,
    "INT4-expert bf16 sampler": INT4,
    "INT4-expert bf16 sampler + replay": INT4 + REPLAY,
}
KEYS = ("logp_abs_diff", "ratio_dev", "ratio_max_dev", "keep_fraction", "mean_reward")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_arm(config, workdir, overrides):
    shutil.rmtree(workdir, ignore_errors=True)
    start = time.time()
    Supervisor(config, workdir, overrides, num_generators=1).run()
    metrics = [m for m in read_jsonl(os.path.join(workdir, "rl_metrics.jsonl")) if "logp_abs_diff" in m]
    return {"wall_seconds": time.time() - start, "per_version": [{k: m.get(k) for k in ("version", *KEYS)}
                                                                  for m in metrics],
            **{f"mean_{k}": float(np.mean([m[k] for m in metrics])) for k in KEYS}}


def plot(results, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=120)
    for label, arm in results["arms"].items():
        v = [m["version"] for m in arm["per_version"]]
        for ax, key in zip(axes, ("logp_abs_diff", "ratio_max_dev", "mean_reward")):
            ax.plot(v, [m[key] for m in arm["per_version"]], "-" if "replay" in label else "--", label=label)
    for ax, title in zip(axes, ("mean |log pi_learner - log pi_sampler|", "max |r - 1| per batch",
                                "training batch reward")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("policy version")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Routing + DSA top-k replay: train / inference mismatch beside the reward ({results['config']}, "
                 "lockstep)")
    fig.tight_layout()
    fig.savefig(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "routing_replay.json"))
    parser.add_argument("--workdir", default="/tmp/glm5_replay_bench")
    parser.add_argument("--config", default="configs/rl_guess.py")
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated labels of ARMS to run")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(args.workdir, "jax_cache")
    sft = [f"sft_workdir={os.path.join(args.workdir, 'sft')}"]
    common = sft + [f"rl.num_versions={args.versions}", "rl.lockstep=True", "rl.tau=0", "rl.eval_every=0"]
    config = os.path.join(ROOT, args.config)
    subprocess.check_call([sys.executable, "-m", "glm5_jax.rl.sft", f"--config={config}",
                           f"--workdir={args.workdir}", *[f"--set={s}" for s in sft]], env=child_env(), cwd=ROOT)
    results = {"config": args.config, "versions": args.versions, "lockstep": True, "tau": 0, "arms": {}}
    for label in args.arms.split(","):
        arm = run_arm(config, os.path.join(args.workdir, label.replace(" ", "_").replace("+", "plus")),
                      common + ARMS[label])
        results["arms"][label] = {"overrides": ARMS[label], **arm}
        print(f"{label}: " + ", ".join(f"{k} {arm[f'mean_{k}']:.3g}" for k in KEYS), flush=True)

    print(f"\n| sampler (learner fp32) | replay | mean abs dlogp | mean abs(r-1) | max abs(r-1) | IS keep | reward |")
    print("|---|---|---|---|---|---|---|")
    for label, arm in results["arms"].items():
        print(f"| {label.replace(' + replay', '')} | {'yes' if 'replay' in label else 'no'} | "
              f"{arm['mean_logp_abs_diff']:.2e} | {arm['mean_ratio_dev']:.2e} | {arm['mean_ratio_max_dev']:.2e} | "
              f"{arm['mean_keep_fraction']:.4f} | {arm['mean_mean_reward']:.3f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
