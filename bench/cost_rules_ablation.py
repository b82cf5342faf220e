"""The estimated step under each of the cost model's conservative rules (docs/cost_model.md): re-read a
compiled step (a `--compile_only` work dir with its `compiled_step.hlo.gz`; no compile) under the
optimistic model, then each rule on its own on top of it, then the rules added one after another up to
the full conservative model, and the full model with the SparseCores' reduce-scatters at the link rate
(a sensitivity row). Prints a table (seconds, MFU) and writes JSON.

    python bench/cost_rules_ablation.py --config=configs/glm5_744b_pretrain.py --workdir=DIR \
        [--set=model.attention_impl=pallas] [--json=OUT]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # configs/ import each other
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from glm5_jax.cost.chips import chip_of_topology  # noqa: E402
from glm5_jax.cost.hlo_cost.rules import GRID_STEP_SECONDS, OP_FIXED_SECONDS  # noqa: E402
from glm5_jax.train import compile_report  # noqa: E402
from glm5_jax.cost.step_model import OPTIMISTIC, StepCostModel  # noqa: E402


def _rule(model: StepCostModel, name: str) -> StepCostModel:
    """``model`` with one conservative rule switched on."""
    r = model.rules
    rules = {"1 kernel core split": dataclasses.replace(r, kernel_core_split=True),
             "2a grid-step cost": dataclasses.replace(r, grid_step_seconds=GRID_STEP_SECONDS),
             "2b per-op fixed cost": dataclasses.replace(r, op_fixed_seconds=OP_FIXED_SECONDS),
             "3 kernel bytes by grid": dataclasses.replace(r, kernel_grid_bytes=True),
             "4b collectives' HBM passes": dataclasses.replace(r, collective_hbm_passes=True)}
    if name in rules:
        return dataclasses.replace(model, rules=rules[name])
    return {"4a all-to-all busiest link": dataclasses.replace(model, all_to_all_link_model="busiest_link"),
            "4c multi-dim rings per dimension": dataclasses.replace(model, ring_dims="per_dimension"),
            "5 SparseCore reduce-scatter 3x": dataclasses.replace(model, sparsecore_rate=None),
            "6 busiest chip's expert load": dataclasses.replace(model, expert_load="busiest")}[name]


RULES = ("1 kernel core split", "2a grid-step cost", "2b per-op fixed cost", "3 kernel bytes by grid",
         "4a all-to-all busiest link", "4b collectives' HBM passes", "4c multi-dim rings per dimension", "5 SparseCore reduce-scatter 3x",
         "6 busiest chip's expert load")


def ablation(config: str, workdir: str, overrides: list[str]) -> list[dict]:
    report, cfg, trainer, mesh, text = compile_report.load_compiled_step(config, workdir, overrides)
    topology, n = report["topology"], report["num_devices"]
    peak = chip_of_topology(topology).peak_flops
    rows = []

    def row(label: str, model: StepCostModel):
        hlo, seconds, _, _ = compile_report.estimate_step(cfg, topology, trainer, mesh, text, model)
        rows.append({"rules": label, "step_seconds": seconds, "roofline_seconds": hlo.roofline_seconds,
                     "exposed_comm_seconds": hlo.exposed_comm_seconds, "comm_seconds": hlo.comm_seconds,
                     "bytes_accessed": hlo.bytes_accessed,
                     "mfu": report["model_flops_per_step"] / (n * peak * seconds)})
        print(f"| {label} | {seconds:.3f} | {hlo.roofline_seconds:.3f} | {hlo.exposed_comm_seconds:.3f} | "
              f"{rows[-1]['mfu']:.1%} |", flush=True)

    print("| rules | est. step s | roofline s | exposed comm s | MFU |\n|---|---|---|---|---|")
    row("optimistic (before)", OPTIMISTIC)
    for name in RULES:
        row(f"optimistic + {name} alone", _rule(OPTIMISTIC, name))
    model = OPTIMISTIC
    for name in RULES:
        model = _rule(model, name)
        row(f"cumulative: + {name}", model)
    row("all, SparseCore at the link rate (sensitivity)", dataclasses.replace(model, sparsecore_rate=1.0))
    return rows


def main():
    args = compile_report.compiled_step_parser(__doc__.splitlines()[0]).parse_args()
    rows = ablation(args.config, args.workdir, args.overrides)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
