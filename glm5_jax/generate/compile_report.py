"""Ahead-of-time compile of the multi-step decode program for a TPU topology, from a CPU host (nothing allocated).

    python -m glm5_jax.generate.compile_report --topology=v5p:4x4x4 --mesh=expert:8,tensor:8 --batch=1 \\
        --context=8192 --experts=int4 [--steps=8] --out=bench/results/decode_744b.json
    python -m glm5_jax.generate.compile_report --points=FILE.json --out=...    (a list of such points)

(a point may also name ``cache_write`` and ``cache_read``: the decode program's RuntimeConfig.decode_cache_write,
default "rows", and decode_cache_read, default "slice"; "pallas" reads the stacked cache in place; ``attention``,
its decode_attention with a stacked cache read: "xla" (default) or "pallas", the fused gather + attention kernel;
``moe_ep``, the decode MoE dispatch: "gather" (default) or "a2a_decode"; ``a2a_exchange``, how "a2a_decode" moves
the rows: "slots" (default) or "ragged", a ragged all-to-all; ``program``, what is compiled: "decode_steps"
(default, the multi-step greedy decode program) or "serve_step", the server's one-token step (each row sampled
with its own temperature / top-p / top-k, its top log-probs; ``steps`` is then 1); and ``capacity``, the
dispatch's moe_capacity_factor (default 2.0; the samplers' default keeps every assignment,
`settings.no_drop_capacity`). ``--tpu_flags`` names the libtpu flag set of glm5_jax/platforms/tpu_flags.py every
point of the run compiles under (default "collective_overlap": the all-to-alls and all-reduces asynchronous,
overlapping the work that does not wait for them; "none": libtpu's defaults, every collective synchronous); each
record keeps it and the LIBTPU_INIT_ARGS it set.

Each point lowers `glm5_jax.generate.decode_program` (``steps`` greedy decode steps in one program over a
cache of ``context`` slots, abstract params sharded by the sampling rules of glm5_jax/parallel/sampling.py),
compiles it with libtpu for the topology and appends one record to the JSON list ``--out``:

* ``memory_gib``: per chip, XLA's memory analysis (arguments + outputs - aliased + temps); ``fits`` against the
  chip's HBM (v5p: 95.74 GiB).
* ``estimated_step_seconds``: glm5_jax.cost.hlo_cost on the compiled HLO under the training reports'
  conservative rules (``cost_model``; docs/cost_model.md: kernels on the cores their parallel grid axes can
  use, per grid step and per op fixed costs, collectives by their busiest link; every op at max(FLOPs /
  achievable FLOP/s, bytes / achievable HBM bytes/s), loop bodies x trip counts, plus the exposed
  communication of the ICI model), divided by ``steps``; ``tokens_per_second_per_chip`` = batch / chips / that.
* ``hbm_roofline_seconds``: the bytes a decode step must read per chip, by hand (`step_read_bytes`), over the
  chip's achievable HBM bandwidth: the resident weights a step touches (every non-expert weight shard; the
  local routed experts the step's tokens choose, expected under uniform routing; the embedding rows of its
  tokens) and the cache rows it reads (every indexer key of its rows, and the ``index_topk`` selected latent
  rows per layer).
* ``communication_seconds``: every collective per step in the ICI model (``exposed_...``: what the schedule
  does not hide); ``top_categories``: the step's roofline seconds per category (glm5_jax.cost.categories).
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import os
import runpy
import time

import flax.linen as nn
import jax
import numpy as np

from glm5_jax import storage
from glm5_jax.cost.categories import categorize
from glm5_jax.cost.chips import chip_of_topology, topology_devices
from glm5_jax.cost.hlo_cost import hlo_cost
from glm5_jax.cost.step_model import StepCostModel, cost_model_record, step_timing
from glm5_jax.generate.decode_program import decode_rules, lower_decode, lower_serve_step
from glm5_jax.generate.settings import decode_model_config
from glm5_jax.model.moe.decode_dispatch import touched_share
from glm5_jax.parallel.axes import BATCH, CACHE_SEQ
from glm5_jax.parallel.mesh import build_mesh, check_mesh_fits_model
from glm5_jax.parallel.sampling import axis_shards, parse_mesh_spec
from glm5_jax.parallel.shard_map import logical_mesh_axes
from glm5_jax.platforms import tpu_flags

GIB = 2 ** 30
# decode_steps: the multi-step greedy decode program (decode_program.lower_decode); serve_step: the server's
# one-token step with per-row sampling and top log-probs (decode_program.lower_serve_step)
PROGRAMS = ("decode_steps", "serve_step")
DEFAULT_CONFIG = "configs/glm5_744b.py"
log = logging.getLogger("glm5_jax.decode_compile")


def model_from_file(path: str):
    """The ModelConfig of a config file: its ``model_config()``, else ``get_config().model``."""
    scope = runpy.run_path(path)
    return scope["model_config"]() if "model_config" in scope else scope["get_config"]().model


# the training reports' conservative rules (docs/cost_model.md); the routed experts run at the INT4 kernel's
# declared blocks (the expected used blocks of the decode dispatch, moe/decode_dispatch.py), not a training
# capacity buffer
COST_MODEL = StepCostModel()
EXPERT_LOAD = "the expert kernel's declared blocks (expected used blocks of the decode dispatch)"


def _leaf_bytes(x) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def step_read_bytes(cfg, variables, cache, mesh, rules, batch: int, context: int) -> dict:
    """Bytes one decode step must read per chip (module docstring): {"weights", "routed_experts", "embedding",
    "cache", "total"}. ``variables`` / ``cache``: the abstract sharded inputs."""
    n_ep = mesh.shape["expert"]
    row_shards = axis_shards(mesh, BATCH, rules) if batch % axis_shards(mesh, BATCH, rules) == 0 else 1
    rows = batch // row_shards                                   # rows whose attention runs on a chip
    # tokens a chip's experts see: its expert group's rows (all of them when the batch is replicated)
    seen = rows * (n_ep if row_shards > 1 and "expert" in _batch_axes(mesh, rules) else 1)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = touched_share(seen, K, E)                          # chance a given expert is chosen by some token
    weights = routed = embedding = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(variables)[0]:
        keys = [str(getattr(p, "key", "")) for p in path]
        nbytes = _leaf_bytes(x)
        if "mtp" in keys:                                         # the decode step runs no MTP module
            continue
        if keys[-2] == "moe" and keys[-1].startswith(("gate_proj", "up_proj", "down_proj")):   # routed, not shared
            routed += nbytes * touched
        elif "embed" in keys:
            embedding += rows * cfg.hidden_size * x.dtype.itemsize
        else:
            weights += nbytes
    slots = context // axis_shards(mesh, CACHE_SEQ, rules)
    selected = min(cfg.index_topk, context) / axis_shards(mesh, CACHE_SEQ, rules)
    itemsize = np.dtype(cfg.jnp_dtype).itemsize
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    n_full = sum(t == "full" for t in cfg.layer_indexer_types)
    cache_bytes = rows * itemsize * (cfg.num_hidden_layers * selected * latent + n_full * slots * cfg.index_head_dim)
    out = {"weights": weights, "routed_experts": routed, "embedding": embedding, "cache": cache_bytes}
    out["total"] = sum(out.values())
    return {k: int(v) for k, v in out.items()}


def _batch_axes(mesh, rules):
    with nn.logical_axis_rules(rules), jax.set_mesh(mesh):
        return tuple(a for a in logical_mesh_axes(BATCH) if mesh.shape[a] > 1)


def compile_point(cfg, topology: str, mesh_spec: str, batch: int, context: int, experts: str, steps: int,
                  quant_matmul: str = "pallas", devices=None, cache_write: str = "rows", hlo_path=None,
                  cache_read: str = "slice", moe_ep: str = "gather", attention: str = "xla",
                  a2a_exchange: str = "slots", program: str = "decode_steps", capacity: float | None = None) -> dict:
    """Lower + compile one decode point; the report record (module docstring). ``hlo_path``: also write the
    compiled HLO there (gzip)."""
    devices = topology_devices(topology) if devices is None else devices
    mesh_cfg = parse_mesh_spec(mesh_spec)
    mesh = build_mesh(mesh_cfg, devices=devices)
    sizes = {a: int(n) for a, n in zip(mesh.axis_names, mesh.devices.shape)}
    check_mesh_fits_model(sizes, cfg, batch if batch % (sizes["data"] * sizes["fsdp"] * sizes["expert"]) == 0
                          else sizes["data"] * sizes["fsdp"] * sizes["expert"])
    if context % sizes["context"]:
        raise ValueError(f"context={context} does not split over context={sizes['context']}")
    if program not in PROGRAMS:
        raise ValueError(f"program={program!r}: choose one of {PROGRAMS}")
    if program == "serve_step":
        steps = 1
    cfg = decode_model_config(cfg, experts, quant_matmul=quant_matmul, cache_write=cache_write, cache_read=cache_read,
                              moe_ep=moe_ep, attention=attention, a2a_exchange=a2a_exchange)
    if capacity is not None:
        cfg = cfg.replace(moe_capacity_factor=capacity)
    rules = decode_rules(batch, mesh, mesh_cfg.rules)
    chip = chip_of_topology(topology)
    n = len(devices)
    header = {"topology": topology, "chips": n, "mesh": {a: s for a, s in sizes.items() if s > 1}, "batch": batch,
              "context": context, "experts": experts, "steps": steps, "cache_write": cache_write,
              "cache_read": cfg.runtime.decode_cache_read, "attention": cfg.runtime.decode_attention, "moe_ep": moe_ep,
              **({"a2a_exchange": a2a_exchange} if moe_ep == "a2a_decode" else {}),
              **({"program": program} if program != "decode_steps" else {}),
              **({"capacity": capacity} if capacity is not None else {}),
              "hbm_limit_gib": chip.hbm_bytes / GIB}
    t0 = time.perf_counter()
    if program == "serve_step":
        lowered, (variables, _, _, cache) = lower_serve_step(cfg, mesh, rules, batch, context)
    else:
        lowered, (variables, _, _, cache) = lower_decode(cfg, mesh, rules, batch, context, steps)
    t_lower = time.perf_counter() - t0
    reads = step_read_bytes(cfg, variables, cache, mesh, rules, batch, context)
    roofline = reads["total"] / chip.achievable_hbm_bandwidth
    header |= {"hbm_roofline_seconds": roofline, "hbm_roofline_bytes": reads}
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {**header, "fits": False, "compile_error": str(e).splitlines()[0][:2000],
                "compile_seconds": round(time.perf_counter() - t0 - t_lower, 1)}
    t_compile = time.perf_counter() - t0 - t_lower
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    hlo_text = compiled.as_text()
    if hlo_path:
        storage.write_atomically(hlo_path, gzip.compress(hlo_text.encode()))
    return {**header, "fits": total <= chip.hbm_bytes, "memory_gib": total / GIB,
            "memory_detail_gib": {"arguments": mem.argument_size_in_bytes / GIB, "temp": mem.temp_size_in_bytes / GIB},
            **step_costs(hlo_text, topology, mesh, batch, steps, roofline),
            "lower_seconds": round(t_lower, 1), "compile_seconds": round(t_compile, 1)}


def step_costs(hlo_text: str, topology: str, mesh, batch: int, steps: int, roofline: float) -> dict:
    """The HLO-derived keys of a record: per decode step (the program's cost / ``steps``)."""
    n = mesh.devices.size
    chip = chip_of_topology(topology)
    timing, comm_model = step_timing(topology, mesh, COST_MODEL)
    rules = dataclasses.replace(COST_MODEL.rules, cores_per_chip=chip.tensor_cores)
    hlo = hlo_cost(hlo_text, categorize=categorize, timing=timing, num_partitions=n, top=8, rules=rules)
    per_step = lambda v: v / steps
    step = per_step(hlo.roofline_seconds + hlo.exposed_comm_seconds)
    cats = sorted(hlo.by_category.get("seconds", {}).items(), key=lambda kv: -kv[1])
    return {
        "estimated_step_seconds": step,
        "tokens_per_second_per_chip": batch / n / step if step else None,
        "over_hbm_roofline": step / roofline if roofline else None,
        "roofline_seconds": per_step(hlo.roofline_seconds),
        "communication_seconds": per_step(hlo.comm_seconds),
        "exposed_communication_seconds": per_step(hlo.exposed_comm_seconds),
        "hbm_bytes_per_step": per_step(hlo.bytes_accessed),
        "flops_per_step": per_step(hlo.total_flops),
        "top_categories": [{"category": c, "seconds": per_step(s)} for c, s in cats[:6] if s > 0],
        "top_instructions": [{"name": t.name, "category": t.category, "opcode": t.opcode,
                              "seconds": per_step(t.seconds), "op_name": t.op_name[-120:]}
                             for t in hlo.top_instructions],
        "loop_trip_counts": [t for _, t in hlo.loops],
        "uncounted_custom_calls": hlo.uncounted_custom_calls,
        "cost_model": {**cost_model_record(COST_MODEL, chip, comm_model), "expert_load": EXPERT_LOAD},
    }


def table(records) -> str:
    """The report's markdown table."""
    lines = ["| topology | mesh | batch | context | experts | cache read | MoE dispatch | fits | GiB / chip "
             "| step ms (est.) | HBM roofline ms | est. / roofline | comm ms (exposed) | tokens/s/chip "
             "| top categories (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        mesh = ",".join(f"{a}:{s}" for a, s in r["mesh"].items())
        if "estimated_step_seconds" not in r:
            lines.append(f"| {r['topology']} | {mesh} | {_batch(r)} | {r['context']} | {r['experts']} "
                         f"| {_cache_read(r)} | {_dispatch(r)} | no "
                         f"| - | - | {r['hbm_roofline_seconds'] * 1e3:.2f} | - | - | - | {r.get('compile_error', '')[:60]} |")
            continue
        cats = ", ".join(f"{c['category']} {c['seconds'] * 1e3:.2f}" for c in r["top_categories"][:3])
        lines.append(f"| {r['topology']} | {mesh} | {_batch(r)} | {r['context']} | {r['experts']} "
                     f"| {_cache_read(r)} | {_dispatch(r)} | {r['fits']} | "
                     f"{r['memory_gib']:.1f} | {r['estimated_step_seconds'] * 1e3:.2f} | "
                     f"{r['hbm_roofline_seconds'] * 1e3:.2f} | {r['over_hbm_roofline']:.2f}x | "
                     f"{r['communication_seconds'] * 1e3:.2f} ({r['exposed_communication_seconds'] * 1e3:.2f}) | "
                     f"{r['tokens_per_second_per_chip']:.3g} | {cats} |")
    return "\n".join(lines) + "\n"


def _batch(record) -> str:
    """The table's batch cell: the batch; "server step" for the server's one-token program, "capacity F" for a
    point's own dispatch capacity."""
    notes = (["server step"] if record.get("program") == "serve_step" else []) + \
        ([f"capacity {record['capacity']:g}"] if record.get("capacity") is not None else [])
    return f"{record['batch']}" + (f" ({', '.join(notes)})" if notes else "")


def _cache_read(record) -> str:
    """The table's cache-read cell: the decode_cache_read, and "+ fused attention" with the fused kernel."""
    read = record.get("cache_read", "slice")
    return read + (" + fused attention" if record.get("attention", "xla") != "xla" else "")


def _dispatch(record) -> str:
    """The table's MoE-dispatch cell: the moe_ep, and a ragged exchange's "(ragged)"."""
    ep = record.get("moe_ep", "gather")
    return ep + (" (ragged)" if record.get("a2a_exchange", "slots") != "slots" else "")


def append_records(path: str, records) -> list:
    old = json.loads(storage.read_text(path)) if storage.exists(path) else []
    out = old + list(records)
    storage.write_atomically(path, json.dumps(out, indent=1).encode())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--topology")
    ap.add_argument("--mesh")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--context", type=int)
    ap.add_argument("--experts", choices=("int4", "bf16"), default="int4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--points", help="a JSON list of {topology, mesh, batch, context, experts[, steps]}")
    ap.add_argument("--quant_matmul", default="pallas", help="the INT4 matmul impl (pallas on TPU)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hlo_dir", help="also write each point's compiled HLO there (gzip)")
    ap.add_argument("--tpu_flags", default="collective_overlap",
                    help="the libtpu flag set every point compiles under (glm5_jax/platforms/tpu_flags.py; set before "
                         "libtpu starts, so one per run): 'collective_overlap' makes the all-to-alls and "
                         "all-reduces asynchronous, so they overlap the work that does not wait for them")
    args = ap.parse_args(argv)
    init_args = tpu_flags.apply(args.tpu_flags)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.points:
        points = json.loads(storage.read_text(args.points))
    else:
        points = [dict(topology=args.topology, mesh=args.mesh, batch=args.batch, context=args.context,
                       experts=args.experts)]
    cfg = model_from_file(args.config)
    records = []
    for p in points:
        log.info("compiling %s", p)
        r = compile_point(cfg, p["topology"], p["mesh"], p["batch"], p["context"], p["experts"],
                          p.get("steps", args.steps), quant_matmul=args.quant_matmul,
                          cache_write=p.get("cache_write", "rows"), cache_read=p.get("cache_read", "slice"),
                          moe_ep=p.get("moe_ep", "gather"), attention=p.get("attention", "xla"),
                          a2a_exchange=p.get("a2a_exchange", "slots"), program=p.get("program", "decode_steps"),
                          capacity=p.get("capacity"),
                          hlo_path=args.hlo_dir and storage.join(args.hlo_dir, f"point{len(records)}.hlo.gz"))
        r = {**r, "tpu_flags": args.tpu_flags, "libtpu_init_args": init_args}
        records.append(r)
        append_records(args.out, [r])
        print(table([r]), flush=True)
    print(table(records))


if __name__ == "__main__":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    main()
