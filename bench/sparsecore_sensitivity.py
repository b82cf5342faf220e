"""How the estimated step depends on the SparseCores' collective rate: re-read a compiled step (a
`--compile_only` work dir, compiled with the `sparsecore_offload` flag set) under the report's cost model
(glm5_jax.cost.step_model.StepCostModel) with the collectives the SparseCores run (`CollectiveOp.offloaded`:
reduce-scatters alone, then with the all-gathers and all-reduces; the all-to-all stays on the TensorCore)
taking `factor` x the time the link-load model gives them, and print the exposed communication and the
estimated step per factor.

How fast the SparseCores drive the links is not public. The public v5p / v6e recipes tell libtpu's
scheduler to expect an offloaded reduce-scatter to take 3x its estimate and an all-gather 1x
(`--xla_tpu_sparse_core_reduce_scatter_latency_multiplier=3`, `..._all_gather_latency_multiplier=1`): the
reports' headline takes 3x for reduce-scatters (glm5_jax.cost.chips), and 1x here is the full link rate.
No compile: needs the work dir's `compiled_step.hlo.gz`.

    python bench/sparsecore_sensitivity.py --config=configs/glm5_744b_pretrain.py --workdir=DIR \
        [--set=model.attention_impl=pallas] [--factors=1,2,3] [--json=OUT]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # configs/ import each other
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from glm5_jax.train import compile_report  # noqa: E402
from glm5_jax.cost.step_model import StepCostModel  # noqa: E402

OFFLOADED_KINDS = ("reduce-scatter", "all-gather", "all-reduce")


def sensitivity(config: str, workdir: str, overrides: list[str], factors: list[float]) -> list[dict]:
    report, cfg, trainer, mesh, text = compile_report.load_compiled_step(config, workdir, overrides)
    topology = report["topology"]
    rows = []
    for slowed in (("reduce-scatter",), OFFLOADED_KINDS):
        for factor in factors:
            model = StepCostModel(sparsecore_rate=factor, sparsecore_kinds=slowed)
            cost, step, comm, _ = compile_report.estimate_step(cfg, topology, trainer, mesh, text, model)
            if comm is None:
                raise ValueError(f"{topology}: no ICI link facts, so no communication time to scale")
            rows.append({"slowed": "+".join(slowed), "factor": factor, "comm_seconds": cost.comm_seconds,
                         "exposed_seconds": cost.exposed_comm_seconds, "roofline_seconds": cost.roofline_seconds,
                         "step_seconds": step})
    return rows


def main():
    parser = compile_report.compiled_step_parser(__doc__.splitlines()[0])
    parser.add_argument("--factors", default="1,2,3")
    args = parser.parse_args()
    rows = sensitivity(args.config, args.workdir, args.overrides, [float(f) for f in args.factors.split(",")])
    print("| collectives slowed | factor | comm total s | exposed s | roofline s | est. step s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['slowed']} | {r['factor']:g}x | {r['comm_seconds']:.2f} | {r['exposed_seconds']:.2f} | "
              f"{r['roofline_seconds']:.2f} | {r['step_seconds']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
