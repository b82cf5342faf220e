"""Plot RL reward curves from one or more RL workdirs' rl_metrics.jsonl (sampled exact match on held-out
prompts, and the training batches' mean reward) against wall-clock seconds since version 0.

    python bench/plot_rl.py async=/tmp/rl_bench/async sync=/tmp/rl_bench/sync --out=bench/results/rl_reward.png
"""
import argparse
import json
import os


def read_rl_metrics(workdir: str) -> list[dict]:
    path = workdir if workdir.endswith(".jsonl") else os.path.join(workdir, "rl_metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(runs: dict[str, list[dict]], out: str, target: float | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for (label, records), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        ev = [(r["elapsed"], r["eval_exact_match"]) for r in records if "eval_exact_match" in r]
        tr = [(r["elapsed"], r["mean_reward"]) for r in records if "mean_reward" in r]
        axes[0].plot(*zip(*ev), "o-", color=color, label=f"{label}: eval (sampled, 512 prompts)")
        axes[0].plot(*zip(*tr), "-", color=color, alpha=0.35, label=f"{label}: training batch reward")
        axes[1].plot([r["version"] for r in records if "eval_exact_match" in r], [e for _, e in ev], "o-",
                     color=color, label=label)
    if target is not None:
        for ax in axes:
            ax.axhline(target, color="grey", ls=":", lw=1)
    axes[0].set_xlabel("seconds since version 0 (2 CPU cores, learner + generator processes)")
    axes[1].set_xlabel("policy version")
    for ax in axes:
        ax.set_ylabel("exact match")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("GRPO + GLM-5 double-sided IS on sort-6 (noisy-teacher SFT start)")
    fig.tight_layout()
    fig.savefig(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="label=workdir (or label=path/to/rl_metrics.jsonl)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", type=float, default=None)
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, _, path = item.rpartition("=")      # labels may contain "=", paths do not
        runs[label] = read_rl_metrics(path or label)
    plot(runs, args.out, args.target)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
