"""One decoder layer's top-level ops in a compiled decode step: what each part of the layer costs in the cost model.

    python bench/decode_layer_ops.py DIR/point0.hlo.gz --topology=v5p:4x4x4 --mesh=expert:8,tensor:8 \\
        [--steps=16] [--category=projections] [--out=FILE.json]

Reads the compiled HLO a decode compile report writes (``python -m glm5_jax.generate.compile_report ...
--hlo_dir=DIR``), costs it with glm5_jax.cost.hlo_cost under the report's rules (every top-level instruction at
its roofline plus the 1 us an op and 0.35 us a Pallas grid step of docs/cost_model.md), takes the loop body that
costs the most per step (the MoE layers' scan) and files each of its top-level instructions under the part of the
layer its op_name metadata names (`part_of`). Prints, per layer: ops and us by part; with ``--category`` every
instruction the report files under that category (glm5_jax.cost.categories) with its bytes and modelled us.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_jax.cost.categories import categorize  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# (part, op_name pattern), first match wins; collectives and copies go by opcode first (`part_of`)
PARTS = (
    ("norms (RMSNorm x4, the indexer key's LayerNorm)", r"_norm/"),
    ("rope (pair swap, tables)", r"\.\.\.d,de->\.\.\.e|/(cos|sin)$"),
    ("indexer scores + top-k", r"lightning_indexer"),
    ("latent gather + attention", r"attention_core"),
    ("shared expert", r"shared_expert"),
    ("MoE dispatch + routed experts", r"/moe/shard_map/"),
    ("MoE router (+ shared gate/up)", r"/moe/"),
    ("projection matmuls", r"[a-z]+,[a-z]+->[a-z]+/dot_general"),
    ("concat / casts in attention", r"/attention/"),
    ("scan: layer slices, output rows, counter", r"dynamic_update|dynamic_index_in_dim|dynamic_slice|decoder/(while/body/)?add$"),
    ("residual add", r"layer_\d+/add$"),
    ("XLA-inserted converts / broadcasts", r"^(convert|broadcast)\.\d+$"),
)


def part_of(opcode: str, op_name: str) -> str:
    """The part of a decoder layer an instruction belongs to (`PARTS`), from its opcode and op_name."""
    if opcode in COLLECTIVES or opcode.endswith(("-start", "-done")) and opcode.split("-")[0] in ("all", "reduce"):
        return "collectives"
    if opcode in ("copy", "copy-start"):
        return "copies (layout, memory space)"
    for part, pattern in PARTS:
        if re.search(pattern, op_name):
            return part
    return "other"


def layer_rows(hlo_text: str, topology: str, mesh_spec: str):
    """(the top-level instructions of the dearest loop body, its executions per program): hlo_cost's
    TopInstruction rows under the decode compile report's rules."""
    from glm5_jax.cost.chips import chip_of_topology, topology_devices
    from glm5_jax.cost.hlo_cost import hlo_cost
    from glm5_jax.cost.step_model import step_timing
    from glm5_jax.generate.compile_report import COST_MODEL
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import parse_mesh_spec

    mesh = build_mesh(parse_mesh_spec(mesh_spec), devices=topology_devices(topology))
    timing, _ = step_timing(topology, mesh, COST_MODEL)
    rules = dataclasses.replace(COST_MODEL.rules, cores_per_chip=chip_of_topology(topology).tensor_cores)
    hlo = hlo_cost(hlo_text, categorize=categorize, timing=timing, num_partitions=mesh.devices.size, top=10 ** 9,
                   rules=rules)
    rows = hlo.top_instructions
    per_body: dict = {}
    for r in rows:
        per_body[r.computation] = per_body.get(r.computation, 0.0) + r.seconds
    body = max(per_body, key=per_body.get)
    body_rows = [r for r in rows if r.computation == body]
    return body_rows, body_rows[0].executions


def summarise(rows, executions: float) -> dict:
    """{part: {"ops", "us"}} per execution of the body (one layer), dearest first."""
    out: dict = {}
    for r in rows:
        row = out.setdefault(part_of(r.opcode, r.op_name), {"ops": 0, "us": 0.0})
        row["ops"] += 1
        row["us"] += r.seconds / executions * 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hlo", help="a compiled decode HLO (compile_report --hlo_dir: pointN.hlo.gz, or plain text)")
    ap.add_argument("--topology", default="v5p:4x4x4")
    ap.add_argument("--mesh", default="expert:8,tensor:8")
    ap.add_argument("--steps", type=int, default=16, help="decode steps in the program (the report's point)")
    ap.add_argument("--category", default="", help="also list this category's instructions of the layer")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    opener = gzip.open if args.hlo.endswith(".gz") else open
    with opener(args.hlo, "rt") as f:
        rows, executions = layer_rows(f.read(), args.topology, args.mesh)
    layers = executions / args.steps
    parts = summarise(rows, executions)
    total_ops, total_us = sum(p["ops"] for p in parts.values()), sum(p["us"] for p in parts.values())
    print(f"one layer of the dearest loop ({layers:g} layers a step): {total_ops} top-level ops, {total_us:.1f} us "
          f"({total_us * layers / 1e3:.2f} ms a step)\n")
    print("| part | ops | us |\n|---|---|---|")
    for name, p in parts.items():
        print(f"| {name} | {p['ops']} | {p['us']:.1f} |")
    listed = []
    if args.category:
        listed = sorted((r for r in rows if r.category == args.category), key=lambda r: -r.seconds)
        print(f"\n{args.category}: {len(listed)} ops a layer\n| instruction | opcode | source | KB | us |\n|---|---|---|---|---|")
        for r in listed:
            source = re.sub(r"^.*?layer_\d+/", "", r.op_name)[-70:]
            print(f"| {r.name} | {r.opcode} | `{source}` | {r.bytes / executions / 1e3:.1f} "
                  f"| {r.seconds / executions * 1e6:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"layers_per_step": layers, "parts": parts,
                       "instructions": [{"name": r.name, "opcode": r.opcode, "category": r.category,
                                         "op_name": r.op_name, "bytes": r.bytes / executions,
                                         "us": r.seconds / executions * 1e6} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    main()
