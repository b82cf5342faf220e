"""The instructions behind a compiled step's FLOPs and HBM bytes, per category: re-reads a compile's HLO
(train.py --compile_only writes DIR/compiled_step.hlo.gz) with glm5_jax.cost.hlo_cost, filing every instruction
under (category, its op_name cut to the last --depth scopes), and prints the largest per category.

    python bench/hlo_top_ops.py DIR/compiled_step.hlo.gz --categories=routed_experts,indexer_kl [--top=15]

Answers "which op makes this category's bytes": the per-category totals in compile_report.json come from
the same counter (loop trip counts applied), so the rows of a category add up to its total.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_jax.cost.categories import categorize  # noqa: E402
from glm5_jax.cost.hlo_cost import CONSERVATIVE, hlo_cost  # noqa: E402

# autodiff / tracing wrappers that say nothing about which op it is
_WRAPPERS = re.compile(r"^(jit\([^)]*\)/)+")


def short_name(op_name: str, depth: int) -> str:
    parts = _WRAPPERS.sub("", op_name).split("/")
    return "/".join(parts[-depth:])


def top_ops(hlo_text: str, categories: list[str], depth: int = 4, rules=CONSERVATIVE) -> dict:
    """{category: [(short op name, bytes, flops), ...] sorted by bytes}, under the reports' cost rules (their
    kernels' grid bytes and collectives' HBM passes: glm5_jax.cost.hlo_cost.CostRules)."""
    cost = hlo_cost(hlo_text, categorize=lambda n: f"{categorize(n)}\x00{short_name(n, depth)}", rules=rules)
    out: dict = {}
    for field in ("bytes", "flops", "kernel_flops"):
        for key, v in cost.by_category.get(field, {}).items():
            cat, _, name = key.partition("\x00")
            if cat in categories:
                row = out.setdefault(cat, {}).setdefault(name, {"bytes": 0.0, "flops": 0.0})
                row["bytes" if field == "bytes" else "flops"] += v
    return {cat: sorted(([n, r["bytes"], r["flops"]] for n, r in rows.items()), key=lambda r: -r[1])
            for cat, rows in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hlo", help="compiled_step.hlo.gz (or plain text)")
    ap.add_argument("--categories", default="routed_experts,indexer_kl,attention_core")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--depth", type=int, default=4, help="op_name scopes kept in a row's name")
    ap.add_argument("--out", default="", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    opener = gzip.open if args.hlo.endswith(".gz") else open
    with opener(args.hlo, "rt") as f:
        text = f.read()
    rows = top_ops(text, args.categories.split(","), args.depth)
    for cat, ops in rows.items():
        total_b, total_f = sum(r[1] for r in ops), sum(r[2] for r in ops)
        print(f"\n{cat}: {total_b / 1e12:.2f} TB, {total_f:.3g} FLOPs per chip per step")
        print(f"| op (last {args.depth} scopes) | TB | share | FLOPs |\n|---|---|---|---|")
        for name, b, fl in ops[:args.top]:
            print(f"| `{name[-110:]}` | {b / 1e12:.3f} | {b / max(total_b, 1):.1%} | {fl:.3g} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
