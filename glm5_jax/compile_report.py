"""Ahead-of-time compile of the real train step for a TPU topology, from a CPU host (no TPU, nothing allocated).

The mesh is built from `jax.experimental.topologies` device descriptions; the step is lowered with the
Trainer's abstract state and an abstract batch and compiled by libtpu. The report gives per-chip memory
(XLA's memory analysis) and whether it fits the chip's HBM, and a step-time estimate turned into an
implied MFU.

How the FLOPs are obtained (report key ``flops_source``): XLA's ``cost_analysis()`` visits each ``while``
body once, so for this model, whose layers run in ``nn.scan`` loops (and attention chunks in a
``lax.map``), it counts about one layer of each scanned segment; it is kept as ``compiler_flops`` /
``compiler_bytes_accessed`` for reference only. ``flops`` and ``bytes_accessed`` come from the compiled
(optimized, partitioned: per device) HLO via `glm5_jax.hlo_cost`: matmul FLOPs (dot / convolution /
ragged-dot; elementwise work not counted) and per-instruction bytes, with every loop body multiplied by
its trip count. ``estimated_step_seconds`` is the roofline max(flops / peak, bytes / HBM bandwidth):
no communication, no overlap modelling, so it is a lower bound on the step time and ``mfu`` (model
FLOPs from `glm5_jax.flops` over chips x peak x that time) an upper bound. ``hlo_loop_trip_counts`` lists
the loops found; a loop whose trip count could not be read is counted once and shows as null there.
"""
from __future__ import annotations

import json
import logging
import os
import time

import jax
import jax.numpy as jnp

from glm5_jax.flops import train_flops_per_token
from glm5_jax.hlo_cost import hlo_cost
from glm5_jax.sharding import build_mesh, check_mesh_fits_model
from glm5_jax.train_step import Trainer

log = logging.getLogger("glm5_jax.compile")

# (bf16 dense peak FLOP/s, HBM bytes, HBM bytes/s) per chip, keyed by the topology-name prefix
TPU_CHIPS = {
    "v5p": (459e12, 95 * 10**9, 2765e9),
    "v5e": (197e12, 16 * 10**9, 819e9),
    "v6e": (918e12, 32 * 10**9, 1640e9),
}


def chip_spec(topology: str) -> tuple[float, int, float]:
    kind = topology.split(":")[0]
    if kind not in TPU_CHIPS:
        raise ValueError(f"--topology={topology}: unknown chip {kind!r}; known: {sorted(TPU_CHIPS)}")
    return TPU_CHIPS[kind]


def topology_devices(topology: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices


def abstract_batch(trainer: Trainer, batch_size: int, seq_len: int) -> dict:
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=trainer.batch_sharding)
    return {"tokens": spec, "positions": spec, "segment_ids": spec}


def compile_train_step(exp_cfg, topology: str) -> dict:
    """Lower + compile one train step of `exp_cfg` on `topology`; returns the report dict."""
    exp_cfg.validate()
    peak, hbm, hbm_bandwidth = chip_spec(topology)
    devices = topology_devices(topology)
    mesh = build_mesh(exp_cfg.mesh, devices=devices)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    check_mesh_fits_model(sizes, exp_cfg.model, exp_cfg.data.batch_size)
    trainer = Trainer(exp_cfg, mesh)
    batch = abstract_batch(trainer, exp_cfg.data.batch_size, exp_cfg.data.seq_len)
    t0 = time.perf_counter()
    with trainer._context():
        lowered = trainer._step.lower(trainer.abstract_state, batch)
    t_lower = time.perf_counter() - t0
    log.info("lowered in %.1f s; compiling for %s (%d devices, mesh %s)", t_lower, topology, len(devices), sizes)
    header = {"topology": topology, "num_devices": len(devices), "mesh": sizes,
              "batch_size": exp_cfg.data.batch_size, "seq_len": exp_cfg.data.seq_len,
              "remat_policy": exp_cfg.model.remat_policy, "moe_ep": exp_cfg.model.moe_ep,
              "hbm_bytes_per_device": hbm}
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # the TPU compiler refuses programs that cannot fit HBM: report that instead of failing
        return {**header, "fits": False, "compile_error": str(e).splitlines()[0],
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
    hlo = hlo_cost(compiled.as_text())
    step_seconds = max(hlo.flops / peak, hlo.bytes_accessed / hbm_bandwidth)
    tokens = exp_cfg.data.batch_size * exp_cfg.data.seq_len
    model_flops = tokens * train_flops_per_token(trainer.model_cfg, exp_cfg.data.seq_len,
                                                 sparse=trainer.model_cfg.attention_mode == "sparse",
                                                 params=trainer.abstract_state.params)["total"]
    n = len(devices)
    return {
        "topology": topology,
        "num_devices": n,
        "device_kind": getattr(devices[0], "device_kind", ""),
        "mesh": sizes,
        "batch_size": exp_cfg.data.batch_size,
        "seq_len": exp_cfg.data.seq_len,
        "grad_accum": exp_cfg.train.grad_accum,
        "remat_policy": exp_cfg.model.remat_policy,
        "moe_ep": exp_cfg.model.moe_ep,
        "num_hidden_layers": exp_cfg.model.num_hidden_layers,
        "n_routed_experts": exp_cfg.model.n_routed_experts,
        "per_device_bytes": per_device,
        "hbm_bytes_per_device": hbm,
        "fits": per_device["total"] <= hbm,
        # per device, from the optimized HLO with loop bodies x trip counts (module docstring)
        "flops": hlo.flops,
        "bytes_accessed": hlo.bytes_accessed,
        "flops_source": "hlo_matmuls_x_loop_trip_counts",
        "hlo_loop_trip_counts": [t for _, t in hlo.loops],
        "estimated_step_seconds": step_seconds,
        "estimated_step_seconds_source": "roofline(flops / peak, bytes_accessed / HBM bandwidth)",
        # XLA's cost analysis as it comes: each loop body counted once (not used for the estimate)
        "compiler_flops": float(cost.get("flops", 0.0)),
        "compiler_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "compiler_optimal_seconds": float(cost.get("optimal_seconds", 0.0)),
        "peak_flops_per_device": peak,
        "hbm_bytes_per_second": hbm_bandwidth,
        # implied MFU: model FLOPs of one step over (chips x peak x the estimated step time)
        "model_flops_per_step": model_flops,
        # executed matmul FLOPs (all chips) per model FLOP: remat recompute, MTP, capacity padding
        "flops_per_model_flop": hlo.flops * n / model_flops,
        "mfu": model_flops / (n * peak * step_seconds) if step_seconds > 0 else None,
        "lower_seconds": round(t_lower, 1),
        "compile_seconds": round(t_compile, 1),
    }


def write_compile_report(exp_cfg, topology: str, workdir: str) -> dict:
    os.makedirs(workdir, exist_ok=True)
    report = compile_train_step(exp_cfg, topology)
    path = os.path.join(workdir, "compile_report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    if "compile_error" in report:
        log.info("%s: does not fit -> %s: %s", topology, path, report["compile_error"])
        return report
    gib = report["per_device_bytes"]["total"] / 2**30
    log.info("%s: %.2f GiB per chip of %.0f GiB (fits=%s); roofline step %.3g s, MFU <= %.3g -> %s", topology, gib,
             report["hbm_bytes_per_device"] / 2**30, report["fits"], report["estimated_step_seconds"],
             report["mfu"], path)
    return report
