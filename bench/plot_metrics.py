"""Plot a training run's loss curves: train loss and eval loss vs step from <workdir>/metrics.jsonl.

    python bench/plot_metrics.py /tmp/tiny_run/metrics.jsonl --out=bench/results/tiny_loss.png
    python bench/plot_metrics.py /tmp/tiny_run                # a workdir; writes <workdir>/loss.png
"""
import argparse
import json
import os


def read_metrics(path: str) -> list[dict]:
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def plot(records: list[dict], out: str, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for key, label, style in (("lm_loss", "train LM loss", "-"), ("loss", "train total loss", ":"),
                              ("eval_loss", "eval LM loss", "o-")):
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, style, label=label, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="metrics.jsonl, or the run's workdir")
    p.add_argument("--out", default=None, help="PNG to write (default: loss.png next to metrics.jsonl)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    records = read_metrics(args.metrics)
    if not records:
        raise SystemExit(f"{args.metrics}: no metrics")
    base = args.metrics if os.path.isdir(args.metrics) else os.path.dirname(os.path.abspath(args.metrics))
    out = args.out or os.path.join(base, "loss.png")
    plot(records, out, args.title)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
