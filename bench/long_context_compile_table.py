"""How the compiled GLM-5 train step grows with the sequence length T: attention core vs lightning indexer.

Reads `compile_report.json` files written by `train.py --compile_only` (one per T, see
bench/long_context_compile.sh) and prints, per T, the per-chip memory and, per token of a chip's share of
the batch, the HLO FLOPs of the attention core, the indexer's scores + top-k and the indexer KL, with
each one's share of the step's HLO FLOPs. With a fixed k = ``index_topk`` keys per query the core's
FLOPs per token stay flat (linear in T overall); the indexer scores every earlier key, so its FLOPs per
token grow with T (quadratic overall).

    python bench/long_context_compile_table.py /tmp/lc/s3_t*/compile_report.json \\
        --out=bench/results/long_context_compile.json --plot=bench/results/long_context_compile.png

Columns come from the reports' ``breakdown`` (glm5_jax.cost.categories; compiler-visible + Pallas kernel
FLOPs as declared by each kernel's cost estimate) and ``per_device_bytes``.
"""
import argparse
import json
import os
import sys

PARTS = ("attention_core", "indexer_topk", "indexer_kl")


def tokens_per_chip(report) -> float:
    return report["batch_size"] * report["seq_len"] / report["num_devices"]


def row(report, path) -> dict:
    n_tok = tokens_per_chip(report)
    total = report["hlo_flops"]
    out = {"report": path, "seq_len": report["seq_len"], "topology": report["topology"],
           "mesh": report["mesh"], "batch_size": report["batch_size"],
           "num_hidden_layers": report["num_hidden_layers"], "tokens_per_chip": n_tok,
           "gib_per_chip": report["per_device_bytes"]["total"] / 2**30, "fits": report["fits"],
           "step_flops_per_token": total / n_tok, "estimated_step_seconds": report["estimated_step_seconds"]}
    for part in PARTS:
        b = report["breakdown"][part]
        out[part] = {"flops_per_token": b["hlo_flops"] / n_tok, "share": b["hlo_flops"] / total,
                     "model_flops_per_token": b["model_flops"] / n_tok, "hbm_bytes_per_token": b["bytes_accessed"] / n_tok}
    return out


def table(rows) -> str:
    head = ("| T | mesh (fsdp x context x expert) | tokens / chip | GiB / chip | attention core GFLOP/token (share) "
            "| indexer top-k GFLOP/token (share) | indexer KL GFLOP/token (share) | step GFLOP/token |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r["mesh"]
        cells = [f"{r['seq_len']:,}", f"{m['fsdp']} x {m['context']} x {m['expert']}", f"{r['tokens_per_chip']:,.0f}",
                 f"{r['gib_per_chip']:.1f}" + ("" if r["fits"] else " (does not fit)")]
        cells += [f"{r[p]['flops_per_token'] / 1e9:.1f} ({100 * r[p]['share']:.1f}%)" for p in PARTS]
        cells.append(f"{r['step_flops_per_token'] / 1e9:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth(rows) -> str:
    """Per-token FLOPs at the longest T over those at the shortest, next to T's own ratio."""
    a, b = rows[0], rows[-1]
    ratio = b["seq_len"] / a["seq_len"]
    parts = ", ".join(f"{p} {b[p]['flops_per_token'] / a[p]['flops_per_token']:.2f}x"
                      for p in PARTS if a[p]["flops_per_token"] > 0)
    return f"T {a['seq_len']:,} -> {b['seq_len']:,} ({ratio:.1f}x): FLOPs per token: {parts}"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = [r["seq_len"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p, label in zip(PARTS, ("attention core", "indexer scores + top-k", "indexer KL")):
        ax.plot(T, [r[p]["flops_per_token"] / 1e9 for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("HLO GFLOP per token per chip")
    ax.set_title("GLM-5 train step compiled for v5p: per-token FLOPs vs T")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="compile_report.json files, one per sequence length")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of per-token FLOPs vs T here")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append((json.load(f), path))
    layers = {r["num_hidden_layers"] for r, _ in reports}
    if len(layers) != 1:
        sys.exit(f"the reports have different layer counts {sorted(layers)}: compare like with like")
    rows = sorted((row(r, os.path.relpath(path)) for r, path in reports), key=lambda r: r["seq_len"])
    print(table(rows))
    if len(rows) > 1:
        print(growth(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
