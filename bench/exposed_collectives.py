"""Where a compiled step's communication is exposed: re-read a `--compile_only` work dir under the report's
cost model (glm5_jax.cost.step_model.StepCostModel) and list the groups of async collectives that the overlap
rule leaves partly exposed (glm5_jax.cost.hlo_cost `ExposedGroup`): per group, the computation it is in (a
loop body runs once per layer), how often it runs per step, its collectives' seconds against the compute
scheduled beside them, and its largest collectives. Synchronous collectives are exposed in full and are not
listed (the report's collective table has them). No compile: needs the work dir's `compiled_step.hlo.gz`.

    python bench/exposed_collectives.py --config=configs/glm5_744b_pretrain.py --workdir=DIR \
        [--set=model.attention_impl=pallas] [--top=8] [--json=OUT]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # configs/ import each other
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from glm5_jax.train import compile_report  # noqa: E402


def exposed_groups(config: str, workdir: str, overrides: list[str]):
    """(estimated step s, total exposed s, [ExposedGroup, most exposed per step first])."""
    report, cfg, trainer, mesh, text = compile_report.load_compiled_step(config, workdir, overrides)
    cost, step, _, _ = compile_report.estimate_step(cfg, report["topology"], trainer, mesh, text)
    return step, cost.exposed_comm_seconds, cost.exposed_groups


def main():
    parser = compile_report.compiled_step_parser(__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--members", type=int, default=6, help="collectives listed per group")
    args = parser.parse_args()
    step, exposed, groups = exposed_groups(args.config, args.workdir, args.overrides)
    print(f"estimated step {step:.3f} s, communication exposed {exposed:.3f} s; async groups with exposed time:")
    print("| computation | runs / step | exposed ms / run | collectives ms / run | compute ms / run | exposed s / step "
          "| largest collectives (ms) |")
    print("|---|---|---|---|---|---|---|")
    for g in groups[:args.top]:
        members = ", ".join(f"{name} {s * 1e3:.2f}" for name, s in g.collectives[:args.members])
        print(f"| {g.computation} | {g.executions:g} | {g.exposed_seconds * 1e3:.2f} "
              f"| {g.collective_seconds * 1e3:.2f} | {g.compute_seconds * 1e3:.2f} "
              f"| {g.exposed_seconds * g.executions:.3f} | {members} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_seconds": step, "exposed_seconds": exposed,
                       "groups": [{"computation": g.computation, "executions": g.executions,
                                   "exposed_seconds": g.exposed_seconds, "collective_seconds": g.collective_seconds,
                                   "compute_seconds": g.compute_seconds, "collectives": list(g.collectives)}
                                  for g in groups]}, f, indent=1)


if __name__ == "__main__":
    main()
