"""Ahead-of-time compile of the real train step for a TPU topology, from a CPU host (no TPU, nothing allocated).

The mesh is built from `jax.experimental.topologies` device descriptions; the step is lowered with the
Trainer's abstract state and an abstract batch and compiled by libtpu. The report gives per-chip memory
(XLA's memory analysis) and whether it fits the chip's HBM, and a step-time estimate turned into an
implied MFU.

How the costs are obtained (glm5_jax.cost.hlo_cost on the compiled, partitioned HLO: per chip, every loop
body times its trip count; XLA's own ``cost_analysis()`` visits each loop body once, so it is printed as
``compiler_flops`` / ``compiler_bytes_accessed`` beside ours counted the same way, ``loop_once``):

* ``flops``: compiler-visible matmuls (dot / convolution / ragged-dot; elementwise work not counted);
  ``kernel_flops``: Mosaic custom calls (Pallas kernels by their declared ``pl.CostEstimate``, the
  ragged-dot lowering; the routed experts' grouped matmuls by the row tiles they visit for the mean routed
  rows of the step's token shards, ``grouped_matmul_load``); ``hlo_flops`` their sum; ``bytes_accessed``
  HBM bytes per instruction: arrays at their tiled sizes, nothing for arrays in VMEM, gathers / scatters /
  slices by the tiles they touch.
* ``breakdown``: those per category of the step (glm5_jax.cost.categories, from each instruction's
  op_name metadata) next to the model FLOPs of that category (glm5_jax.cost.flops.train_flops_by_category),
  with each category's roofline seconds.
* ``communication``: every collective with its bytes per chip and the mesh axes it spans, turned into
  seconds by the ICI link-load model of glm5_jax.cost.ici.
* ``estimated_step_seconds`` = ``roofline_seconds`` (each top-level op at max(its FLOPs / achievable
  FLOP/s, its HBM bytes / achievable HBM bandwidth), summed; rates from glm5_jax.cost.chips) + the
  exposed communication: a synchronous collective is exposed in full, an asynchronous one (start/done
  pair) hides behind the roofline time of the instructions the compiled schedule places between its start
  and its done (docs/cost_model.md).
  ``step_seconds_if_all_overlap`` = max(roofline, all communication) is the optimistic bound.
  ``cost_model``: the conservative rules the estimate is made under (`StepCostModel`, docs/cost_model.md:
  kernels by the TensorCores their parallel grid axes use, per-grid-step and per-op seconds, kernels'
  bytes by their grids, ring collectives' HBM passes, all-to-alls by their busiest link, multi-dim rings by
  their busiest dim, SparseCore reduce-scatters at the chip's rate, the busiest chip's expert load, the HBM
  limit); ``top_level_ops_per_step``, ``grid_steps_per_step`` and ``kernels_without_grid`` (kernels whose
  grid could not be read: charged as declared) go with them.
  ``top_instructions``: the compiled instructions with the most roofline seconds per step (loop trips
  multiplied in), with the JAX source each came from (its op_name): where to look first.
  ``mfu`` = model FLOPs / (chips x vendor peak x estimated_step_seconds); the model FLOPs exclude MTP.
* ``optimizer_state``: bytes of optimizer state (and params) per chip from the state's shardings, and
  over which mesh axes they are split (fsdp: ZeRO-style sharding of the AdamW moments).

``hlo_loop_trip_counts`` lists the loops found; a loop whose trip count could not be read is counted
once and shows as null there; ``uncounted_custom_calls`` names kernels whose cost is unknown.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import storage
from glm5_jax.cost.categories import CATEGORIES, EXPERT_PASSES, categorize, expert_pass
from glm5_jax.cost.chips import chip_of_topology, topology_devices
from glm5_jax.cost.flops import train_flops_by_category, train_flops_per_token
from glm5_jax.cost.hlo_cost import GroupedMatmulLoad, hlo_cost
from glm5_jax.cost.ici import collective_table
from glm5_jax.cost.step_model import StepCostModel, cost_model_record, step_timing
from glm5_jax.data.batch import Batch
from glm5_jax.model.moe.expert_parallel import expected_routed_rows
from glm5_jax.parallel.mesh import build_mesh, check_mesh_fits_model
from glm5_jax.platforms import skip_absent_tpu
from glm5_jax.train.step import Trainer

TOP_INSTRUCTIONS = 25     # the report's list of the dearest compiled instructions


log = logging.getLogger("glm5_jax.compile")


def abstract_batch(trainer: Trainer, batch_size: int, seq_len: int) -> Batch:
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=trainer.batch_sharding)
    return Batch(tokens=spec, segment_ids=spec, positions=spec)


def compile_train_step(exp_cfg, topology: str, hlo_path: str | None = None) -> dict:
    """Lower + compile one train step of `exp_cfg` on `topology`; returns the report dict. `hlo_path`:
    also write the compiled HLO text there (gzip), to re-read it without compiling again."""
    trainer, mesh, devices = _setup(exp_cfg, topology)
    hbm = chip_of_topology(topology).hbm_bytes
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    batch = abstract_batch(trainer, exp_cfg.data.batch_size, exp_cfg.data.seq_len)
    t0 = time.perf_counter()
    with trainer.context():
        lowered = trainer._step.lower(trainer.abstract_state, batch)
    t_lower = time.perf_counter() - t0
    log.info("lowered in %.1f s; compiling for %s (%d devices, mesh %s)", t_lower, topology, len(devices), sizes)
    header = {"topology": topology, "num_devices": len(devices), "mesh": sizes,
              "batch_size": exp_cfg.data.batch_size, "seq_len": exp_cfg.data.seq_len,
              "remat_policy": exp_cfg.model.runtime.remat_policy, "moe_ep": exp_cfg.model.runtime.moe_ep,
              "loss_chunk_tokens": exp_cfg.model.runtime.loss_chunk_tokens, "hbm_bytes_per_device": hbm,
              # the libtpu flags in effect (train.py sets them from train.tpu_flags before libtpu starts)
              "tpu_flags": exp_cfg.train.tpu_flags, "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "")}
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # the TPU compiler refuses programs that cannot fit HBM: report that instead of failing
        return {**header, "fits": False, "compile_error": str(e).splitlines()[0],
                "compile_error_detail": str(e)[:8000],      # the compiler's whole message (which buffer, where)
                "compile_seconds": round(time.perf_counter() - t0 - t_lower, 1)}
    t_compile = time.perf_counter() - t0 - t_lower
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    per_device = {
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "generated_code": int(mem.generated_code_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
    }
    # donated state: outputs alias arguments, so they are not counted twice
    per_device["total"] = (per_device["argument"] + per_device["output"] - per_device["alias"]
                           + per_device["temp"] + per_device["generated_code"])
    hlo_text = compiled.as_text()
    if hlo_path:
        storage.write_atomically(hlo_path, gzip.compress(hlo_text.encode()))
    report = {
        **header,
        "device_kind": getattr(devices[0], "device_kind", ""),
        "grad_accum": exp_cfg.train.grad_accum,
        "attention_impl": exp_cfg.model.runtime.attention_impl,
        "moe_impl": exp_cfg.model.runtime.moe_impl,
        "num_hidden_layers": exp_cfg.model.num_hidden_layers,
        "n_routed_experts": exp_cfg.model.n_routed_experts,
        "per_device_bytes": per_device,
        "fits": per_device["total"] <= hbm,
        # XLA's cost analysis as it comes: each loop body counted once (not used for the estimate)
        "compiler_flops": float(cost.get("flops", 0.0)),
        "compiler_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "compiler_optimal_seconds": float(cost.get("optimal_seconds", 0.0)),
        "lower_seconds": round(t_lower, 1),
        "compile_seconds": round(t_compile, 1),
    }
    return {**report, **analyse_step(exp_cfg, topology, trainer, mesh, hlo_text)}


def _setup(exp_cfg, topology: str):
    exp_cfg.validate()
    devices = topology_devices(topology)
    mesh = build_mesh(exp_cfg.mesh, devices=devices)
    check_mesh_fits_model(dict(zip(mesh.axis_names, mesh.devices.shape)), exp_cfg.model, exp_cfg.data.batch_size,
                          exp_cfg.data.seq_len)
    return Trainer(exp_cfg, mesh), mesh, devices


def analyse_step(exp_cfg, topology: str, trainer: Trainer, mesh, hlo_text: str,
                 cost_model: StepCostModel = StepCostModel()) -> dict:
    """The report's keys that come from the compiled HLO (module docstring), under ``cost_model``."""
    chip = chip_of_topology(topology)
    devices = list(mesh.devices.flat)
    hlo, step_seconds, comm_model, load = estimate_step(exp_cfg, topology, trainer, mesh, hlo_text, cost_model,
                                                        top=TOP_INSTRUCTIONS)
    # as XLA's cost analysis counts: loop bodies once, each kernel as it declares itself
    once = hlo_cost(hlo_text, num_partitions=len(devices), loop_trips=False)
    n = len(devices)
    tokens = exp_cfg.data.batch_size * exp_cfg.data.seq_len
    sparse = trainer.model_cfg.runtime.attention_mode == "sparse"
    params = trainer.abstract_state.params
    indexer_loss = trainer.model_cfg.runtime.indexer_loss     # the stage's: a dense step runs no indexer
    model_flops = tokens * train_flops_per_token(trainer.model_cfg, exp_cfg.data.seq_len, sparse=sparse,
                                                 params=params, indexer_loss=indexer_loss)["total"]
    by_cat = train_flops_by_category(trainer.model_cfg, exp_cfg.data.seq_len, sparse=sparse, params=params,
                                     indexer_loss=indexer_loss)
    comm_s = hlo.comm_seconds if comm_model is not None else 0.0
    comm_rows = collective_table(hlo.collectives, comm_model, mesh.axis_names, mesh.devices.shape)
    return {
        "cost_model": cost_model_record(cost_model, chip, comm_model),
        "optimizer_state": optimizer_state_bytes(trainer, mesh),
        # per chip, from the optimized HLO with loop bodies x trip counts (module docstring)
        "flops": hlo.flops,
        "kernel_flops": hlo.kernel_flops,
        "hlo_flops": hlo.total_flops,
        "bytes_accessed": hlo.bytes_accessed,
        "flops_source": "hlo_matmuls_and_kernel_cost_estimates_x_loop_trip_counts",
        "hlo_loop_trip_counts": [t for _, t in hlo.loops],
        "uncounted_custom_calls": hlo.uncounted_custom_calls,
        "kernels_without_grid": hlo.kernels_without_grid,
        "top_level_ops_per_step": hlo.top_level_ops,
        "grid_steps_per_step": hlo.grid_steps,
        # ours with every loop body counted once, the way XLA's cost_analysis() counts: the two side by side
        "loop_once": {"flops": once.total_flops, "bytes_accessed": once.bytes_accessed},
        "breakdown": breakdown(hlo, by_cat, tokens, n),
        "grouped_matmul_load": dataclasses.asdict(load),
        "routed_expert_passes": expert_passes(hlo_text, by_cat["routed_experts"] * tokens / n, len(devices), load),
        "communication": {
            "model": (f"glm5_jax.cost.ici ({topology.split(':')[0]} torus, link-load model: "
                      f"{chip.ici_link_bandwidth / 1e9:.0f} GB/s per link per direction x {chip.ici_fraction} "
                      f"achievable, {chip.ici_step_latency * 1e6:.1f} us per step)") if comm_model else None,
            "bytes_per_chip": sum(r["bytes_per_chip"] for r in comm_rows),
            "seconds": comm_s,
            "exposed_seconds": hlo.exposed_comm_seconds if comm_model is not None else None,
            "collectives": comm_rows,
        },
        # at the chip's achievable rates (glm5_jax.cost.chips): all FLOPs, all bytes, and each op at its own
        # roofline, summed
        "compute_seconds": hlo.total_flops / chip.achievable_flops,
        "memory_seconds": hlo.bytes_accessed / chip.achievable_hbm_bandwidth,
        "roofline_seconds": hlo.roofline_seconds,
        "estimated_step_seconds": step_seconds,
        "estimated_step_seconds_source":
            "sum over ops of max(op FLOPs / achievable FLOP/s, op HBM bytes / achievable HBM bytes/s) "
            "+ exposed communication",
        "step_seconds_if_all_overlap": max(hlo.roofline_seconds, comm_s),
        # where the roofline time goes: the dearest compiled instructions, loop trips multiplied in
        "top_instructions": [dataclasses.asdict(t) for t in hlo.top_instructions],
        "peak_flops_per_device": chip.peak_flops,
        "hbm_bytes_per_second": chip.hbm_bandwidth,
        "achievable_flops_per_device": chip.achievable_flops,
        "achievable_hbm_bytes_per_second": chip.achievable_hbm_bandwidth,
        # implied MFU: model FLOPs of one step over (chips x vendor peak x the estimated step time)
        "model_flops_per_step": model_flops,
        # executed matmul FLOPs (all chips) per model FLOP: remat recompute, MTP, capacity padding
        "flops_per_model_flop": hlo.total_flops * n / model_flops,
        "mfu": model_flops / (n * chip.peak_flops * step_seconds) if step_seconds > 0 else None,
    }


def estimate_step(exp_cfg, topology: str, trainer: Trainer, mesh, hlo_text: str,
                  cost_model: StepCostModel = StepCostModel(), top: int = 0):
    """(HloCost, estimated step seconds, CollectiveModel or None, GroupedMatmulLoad) of a compiled step
    under ``cost_model``: the roofline + the exposed communication."""
    chip = chip_of_topology(topology)
    timing, comm_model = step_timing(topology, mesh, cost_model)
    load = grouped_matmul_load(exp_cfg, trainer, cost_model.expert_load)
    rules = dataclasses.replace(cost_model.rules, cores_per_chip=chip.tensor_cores)
    hlo = hlo_cost(hlo_text, categorize=categorize, timing=timing, num_partitions=mesh.devices.size, top=top,
                   grouped_matmul_load=load, rules=rules)
    return hlo, hlo.roofline_seconds + (hlo.exposed_comm_seconds if comm_model is not None else 0.0), comm_model, load


def compiled_step_parser(description: str):
    """The arguments of a script that re-reads a `--compile_only` work dir: --config, --workdir, --set, --json."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--json")
    return parser


def load_compiled_step(config: str, workdir: str, overrides: list[str]):
    """(report, config, Trainer, mesh, compiled HLO text) of a `--compile_only` work dir, without compiling."""
    from glm5_jax.train.experiment import apply_overrides, load_config_file

    report = json.loads(storage.read_text(storage.join(workdir, "compile_report.json")))
    cfg = apply_overrides(load_config_file(config), overrides)
    trainer, mesh, _ = _setup(cfg, report["topology"])
    text = gzip.decompress(storage.read_bytes(storage.join(workdir, "compiled_step.hlo.gz"))).decode()
    return report, cfg, trainer, mesh, text


def reanalyse(exp_cfg, topology: str, workdir: str) -> dict:
    """Recompute the HLO-derived keys of DIR/compile_report.json from DIR/compiled_step.hlo.gz (no
    compile: for a change of the measuring modules) and rewrite the report."""
    path = storage.join(workdir, "compile_report.json")
    report = json.loads(storage.read_text(path))
    if report.get("topology") != topology:
        raise ValueError(f"{path} is for {report.get('topology')}, not {topology}")
    trainer, mesh, _ = _setup(exp_cfg, topology)
    hlo_text = gzip.decompress(storage.read_bytes(storage.join(workdir, "compiled_step.hlo.gz"))).decode()
    report.update(analyse_step(exp_cfg, topology, trainer, mesh, hlo_text))
    storage.write_atomically(path, json.dumps(report, indent=1).encode())
    return report


def breakdown(hlo, model_per_token: dict, tokens: int, n: int) -> dict:
    """Per category: HLO FLOPs (compiler-visible + kernels) and HBM bytes per chip next to the model
    FLOPs per chip, and their ratio."""
    out = {}
    for cat in CATEGORIES:
        flops = hlo.by_category["flops"].get(cat, 0.0)
        kernel = hlo.by_category["kernel_flops"].get(cat, 0.0)
        model = model_per_token.get(cat, 0.0) * tokens / n
        out[cat] = {"hlo_flops": flops + kernel, "kernel_flops": kernel,
                    "bytes_accessed": hlo.by_category["bytes"].get(cat, 0.0),
                    "roofline_seconds": hlo.by_category.get("seconds", {}).get(cat, 0.0), "model_flops": model,
                    "hlo_per_model_flop": (flops + kernel) / model if model else None}
    return out


def grouped_matmul_load(exp_cfg, trainer, expert_load: str = "mean") -> GroupedMatmulLoad:
    """What the routed experts' grouped matmuls hold for the step's micro-batch on its token shards
    (glm5_jax.model.moe.expert_parallel.expected_routed_rows: the mean over shards) and whether their
    groups are aligned. ``expert_load="busiest"``: a synchronous step waits for its busiest chip, whose
    buffer the router fills to moe_capacity_factor x the mean (the capacity drops the rest)."""
    micro = (exp_cfg.data.batch_size // exp_cfg.train.grad_accum, exp_cfg.data.seq_len)
    rt = trainer.model_cfg.runtime
    rows = expected_routed_rows(math.prod(trainer.batch_sharding.shard_shape(micro)), trainer.model_cfg)
    if rows is not None and expert_load == "busiest":
        rows *= max(1.0, rt.moe_capacity_factor)
    return GroupedMatmulLoad(rows, rt.moe_group_align > 1)


def expert_passes(hlo_text: str, model_flops: float, n: int, load: GroupedMatmulLoad | None = None) -> dict:
    """The routed experts' HLO FLOPs per chip by pass (step_categories.expert_pass) next to the model's:
    a third of the category's model FLOPs each for the forward, input and weight gradients, none for
    the remat recompute."""
    hlo = hlo_cost(hlo_text, categorize=expert_pass, num_partitions=n, grouped_matmul_load=load)
    out = {}
    for p in EXPERT_PASSES:
        flops = hlo.by_category["flops"].get(p, 0.0) + hlo.by_category["kernel_flops"].get(p, 0.0)
        model = 0.0 if p == "remat" else model_flops / 3
        out[p] = {"hlo_flops": flops, "model_flops": model, "hlo_per_model_flop": flops / model if model else None}
    return out


def optimizer_state_bytes(trainer: Trainer, mesh) -> dict:
    """Bytes per chip of the params and of the optimizer state (from each leaf's sharding), and the mesh
    axes the optimizer state is split over, with the share of its bytes split over each."""
    def per_chip(tree):
        total, by_axis, full = 0, {}, 0
        for leaf in jax.tree.leaves(tree):
            if not hasattr(leaf, "sharding") or not leaf.shape:
                continue
            nbytes = leaf.dtype.itemsize * int(np.prod(leaf.shape))
            shard = leaf.dtype.itemsize * int(np.prod(leaf.sharding.shard_shape(leaf.shape)))
            total, full = total + shard, full + nbytes
            for axes in getattr(leaf.sharding, "spec", ()):
                for a in (axes if isinstance(axes, tuple) else (axes,)):
                    if a is not None:
                        by_axis[a] = by_axis.get(a, 0) + nbytes
        return total, full, {a: v / full for a, v in sorted(by_axis.items())} if full else {}

    opt, opt_full, opt_axes = per_chip(trainer.abstract_state.opt_state)
    params, params_full, _ = per_chip(trainer.abstract_state.params)
    return {"optimizer_bytes_per_chip": opt, "optimizer_bytes_total": opt_full,
            "params_bytes_per_chip": params, "params_bytes_total": params_full,
            "optimizer_share_sharded_over": opt_axes,
            "sharded_over_fsdp": opt_axes.get("fsdp", 0.0) > 0.5}


def write_compile_report(exp_cfg, topology: str, workdir: str) -> dict:
    storage.makedirs(workdir)
    report = compile_train_step(exp_cfg, topology, hlo_path=storage.join(workdir, "compiled_step.hlo.gz"))
    path = storage.join(workdir, "compile_report.json")
    storage.write_atomically(path, json.dumps(report, indent=1).encode())
    if "compile_error" in report:
        log.info("%s: does not fit -> %s: %s", topology, path, report["compile_error"])
        return report
    gib = report["per_device_bytes"]["total"] / 2**30
    log.info("%s: %.2f GiB per chip of %.0f GiB (fits=%s); estimated step %.3g s, MFU %.3g -> %s", topology, gib,
             report["hbm_bytes_per_device"] / 2**30, report["fits"], report["estimated_step_seconds"],
             report["mfu"], path)
    return report


def markdown_tables(report: dict, top_collectives: int = 12, top_instructions: int = 15) -> str:
    """The breakdown and the dearest collectives of a report as markdown tables."""
    from glm5_jax.cost.categories import CATEGORY_TITLES

    lines = ["| category | HLO FLOPs / chip | of which kernels | model FLOPs / chip | HLO / model | HBM GB / chip "
             "| roofline s |", "|---|---|---|---|---|---|---|"]
    for cat, c in report["breakdown"].items():
        ratio = "-" if c["hlo_per_model_flop"] is None else f"{c['hlo_per_model_flop']:.2f}x"
        lines.append(f"| {CATEGORY_TITLES[cat]} | {c['hlo_flops']:.3g} | {c['kernel_flops']:.3g} | "
                     f"{c['model_flops']:.3g} | {ratio} | {c['bytes_accessed'] / 1e9:.1f} | "
                     f"{c.get('roofline_seconds', 0.0):.3f} |")
    n = report["num_devices"]
    lines.append(f"| **total** | {report['hlo_flops']:.3g} | {report['kernel_flops']:.3g} | "
                 f"{report['model_flops_per_step'] / n:.3g} (w/o MTP) | {report['flops_per_model_flop']:.2f}x | "
                 f"{report['bytes_accessed'] / 1e9:.1f} | {report.get('roofline_seconds', 0.0):.3f} |")
    if "loop_once" in report:
        once = report["loop_once"]
        lines += ["", "| every loop body once | HLO FLOPs / chip | HBM GB / chip |", "|---|---|---|",
                  f"| XLA cost_analysis() | {report['compiler_flops']:.3g} | {report['compiler_bytes_accessed'] / 1e9:.2f} |",
                  f"| ours (glm5_jax.cost.hlo_cost) | {once['flops']:.3g} | {once['bytes_accessed'] / 1e9:.2f} |"]
    if "routed_expert_passes" in report:
        lines += ["", "| routed experts, pass | HLO FLOPs / chip | model FLOPs / chip | HLO / model |", "|---|---|---|---|"]
        for p, c in report["routed_expert_passes"].items():
            ratio = "-" if c["hlo_per_model_flop"] is None else f"{c['hlo_per_model_flop']:.2f}x"
            lines.append(f"| {p} | {c['hlo_flops']:.3g} | {c['model_flops']:.3g} | {ratio} |")
    lines += ["", "| collective | mesh axes | category | async | per step | GB / chip | seconds |",
              "|---|---|---|---|---|---|---|"]
    for r in report["communication"]["collectives"][:top_collectives]:
        lines.append(f"| {r['kind']} | {r['mesh_axes']} | {r['category']} | {r['async']} | {r['count']:.0f} | "
                     f"{r['bytes_per_chip'] / 1e9:.2f} | {r['seconds']:.3f} |")
    if report.get("top_instructions"):
        lines += ["", "| instruction | category | opcode | per step | HBM GB / chip | TFLOPs / chip | roofline s | "
                  "source (op_name) |", "|---|---|---|---|---|---|---|---|"]
        for t in report["top_instructions"][:top_instructions]:
            source = t["op_name"].split("/")
            source = "/".join(source[-3:]) if len(source) > 3 else t["op_name"]
            lines.append(f"| {t['name']} | {t['category']} | {t['opcode']} | {t['executions']:.0f} | "
                         f"{t['bytes'] / 1e9:.1f} | {t['flops'] / 1e12:.1f} | {t['seconds']:.3f} | {source} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    """python -m glm5_jax.train.compile_report --config=C --topology=T --workdir=DIR [--set=k=v ...]: reanalyse
    DIR's saved compile (what train.py --compile_only wrote there) with the current measuring modules."""
    skip_absent_tpu()
    import argparse

    from glm5_jax.train.experiment import apply_overrides, load_config_file

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--topology", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--markdown", action="store_true", help="also print the breakdown / collective tables")
    args = ap.parse_args(argv)
    report = reanalyse(apply_overrides(load_config_file(args.config), args.set), args.topology, args.workdir)
    if args.markdown:
        print(markdown_tables(report))
    print(f"{args.workdir}: step {report['estimated_step_seconds']:.3g} s, MFU {report['mfu']:.3g}, "
          f"{report['flops_per_model_flop']:.2f}x model FLOPs")


if __name__ == "__main__":
    main()
