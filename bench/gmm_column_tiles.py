"""The megablox grouped matmuls of a compiled step at their compiled output-column tile and at another,
under the cost model's conservative rules (docs/cost_model.md): re-reads a `--compile_only` work dir (no
compile) and prices each `gmm` call by its grid as compiled and by the same grid with ``--tn``-wide column
tiles (megablox splits only its column tiles over v5p's two TensorCores; a narrower tile re-reads the lhs
once more per tile), with the formula the HLO walk applies to every kernel (`KernelGrid`: its busiest core's
share x 2 x max(FLOPs / peak, grid bytes / HBM rate) + 0.35 us per step on that core).

    python bench/gmm_column_tiles.py --config=configs/glm5_744b_pretrain.py --workdir=DIR \
        --set=model.attention_impl=pallas [--tn=1024] [--json=OUT]
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # configs/ import each other
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from glm5_jax.cost.chips import chip_of_topology  # noqa: E402
from glm5_jax.cost.hlo_cost import CONSERVATIVE, KernelGrid, StepTiming, hlo_cost, kernel_grid  # noqa: E402
from glm5_jax.cost.hlo_cost.kernels import dynamic_grid_bound  # noqa: E402
from glm5_jax.cost.hlo_cost.parsing import parse_computations  # noqa: E402
from glm5_jax.train import compile_report  # noqa: E402


def kernel_seconds(grid: KernelGrid, dynamic: float, flops: float, timing: StepTiming, cores: int) -> float:
    share = grid.busiest_core_share(cores, dynamic)
    base = max(flops / timing.peak_flops, grid.window_bytes(dynamic) / timing.hbm_bandwidth)
    return base * cores * share + grid.steps(dynamic) * share * CONSERVATIVE.grid_step_seconds


def column_tiles(config: str, workdir: str, overrides: list[str], tn: int) -> list[dict]:
    report, cfg, trainer, mesh, text = compile_report.load_compiled_step(config, workdir, overrides)
    chip = chip_of_topology(report["topology"])
    load = compile_report.grouped_matmul_load(cfg, trainer, "busiest")
    timing = StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, lambda op: 0.0)
    cost = hlo_cost(text, timing=timing, grouped_matmul_load=load, rules=CONSERVATIVE, top=10**6)
    comps, _ = parse_computations(text)
    where = {name: comp for comp, instrs in comps.items() for name in instrs}
    rows = {}
    for t in cost.top_instructions:
        if t.opcode != "custom-call" or "jit(gmm)" not in t.op_name:
            continue
        _, _, operands, _, attrs = comps[where[t.name]][t.name]
        grid = kernel_grid(attrs)
        shapes = [comps[where[t.name]][o][0] if o in comps[where[t.name]] else "" for o in operands]
        dynamic = dynamic_grid_bound(shapes, attrs, load)
        (lhs, _, _), (rhs, _, _), (out, _, _) = grid.windows       # bf16 [tm, tk], [tk, tn], [tm, tn] blocks
        tm = math.isqrt(lhs * out // (2 * rhs))                    # lhs x out / rhs = 2 tm^2
        compiled_tn = out // (2 * tm)
        width = grid.bounds[0] * compiled_tn
        other = KernelGrid((width // tn,) + grid.bounds[1:], grid.parallel,
                           ((lhs, 2, True), (rhs * tn // compiled_tn, 2, True), (out * tn // compiled_tn, 1, True)))
        flops = t.flops / t.executions
        row = rows.setdefault((width, compiled_tn), {"width": width, "compiled_tn": compiled_tn, "tn": tn,
                                                     "calls_per_step": 0.0, "seconds": 0.0, "seconds_at_tn": 0.0})
        row["calls_per_step"] += t.executions
        row["seconds"] += t.executions * kernel_seconds(grid, dynamic, flops, timing, chip.tensor_cores)
        row["seconds_at_tn"] += t.executions * kernel_seconds(other, dynamic, flops, timing, chip.tensor_cores)
    return sorted(rows.values(), key=lambda r: r["width"])


def main():
    parser = compile_report.compiled_step_parser(__doc__.splitlines()[0])
    parser.add_argument("--tn", type=int, default=1024)
    args = parser.parse_args()
    rows = column_tiles(args.config, args.workdir, args.overrides, args.tn)
    print(f"| gmm output width | compiled column tile | calls / step | s / step | s / step at {args.tn} |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['compiled_tn']} | {r['calls_per_step']:.0f} | {r['seconds']:.3f} | "
              f"{r['seconds_at_tn']:.3f} |")
    print(f"| all | | {sum(r['calls_per_step'] for r in rows):.0f} | {sum(r['seconds'] for r in rows):.3f} | "
          f"{sum(r['seconds_at_tn'] for r in rows):.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
