"""Sweep mesh splits, remat / offload policies, expert-parallel forms and micro-batching of a config by
AOT-compiling its train step for a TPU topology (train.py --compile_only; libtpu on this CPU host, no TPU),
and tabulate what each compiled step costs (glm5_jax.train.compile_report): per-chip memory and whether it fits,
executed FLOPs per model FLOP, communication bytes and seconds (v5p ICI model), estimated step seconds
and MFU.

    python bench/mesh_sweep.py --config=configs/glm5_744b.py --topology=v5p:8x16x16 \\
        --out=bench/results/mesh_sweep.json [--jobs=2] [--only=baseline,remat_offload_dots]

--topology=v5p:4x4x8 sweeps 128 chips at a 4x smaller batch (256 x 4096), v5p:4x8x8 256 chips at 512 x 4096.
--topology=v5p:8x16x16/dense sweeps layouts of the pretraining (dense-attention) stage and its warm-up,
v5p:4x8x8/dense the same on 256 chips; --topology=v5p:8x16x16/tokens sweeps tokens per chip (1024 to 8192
sequences of 4K per step, in micro-batches under the config's remat policy or in one batch under full remat)
for the dense and the sparse stage and plots estimated MFU against tokens per chip (``OUT_mfu.png``).
Every point compiles the TPU path (model.attention_impl=pallas). Each point is a separate process (at most
--jobs at once: a 744B compile holds ~10 GB of host memory and takes 13+ minutes of one core) whose report is cached under --cache_dir by a hash of the resolved config, the topology and the
model sources (glm5_jax/ and pallas_kernels/, the measuring modules excluded), with the compiled HLO, so
a rerun compiles only the points whose inputs changed and, when only the measuring modules changed
(glm5_jax/cost/hlo_cost/, compile_report.py, ...), re-reads the cached HLO instead of compiling.
Writes the table as JSON (--out) and markdown (same name, .md) and a plot (.png).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glm5_jax.cost.ici import torus_dims  # noqa: E402

# what measures the compiled step (the cost model and the report): changing it does not change what is compiled
MEASURING_DIRS = ("glm5_jax/cost",)
MEASURING_FILES = ("glm5_jax/train/compile_report.py",)


def _is_measuring(relpath: str) -> bool:
    return relpath in MEASURING_FILES or os.path.dirname(relpath) in MEASURING_DIRS


def _mesh(fsdp: int, expert: int, tensor: int, context: int = 1, remat: str = "full") -> list[str]:
    # every point compiles the TPU path (the Pallas DSA kernels; the config file's default is the XLA form) and
    # names its remat policy (a later override in the point wins): the sweeps committed before the config
    # moved to "moe_saveable" were measured under "full". Expert groups aligned to the grouped matmul's row tile
    # (the config's moe_group_align) only where the expert all-to-all spans 32 chips or more: there each local
    # expert's room (sources x capacity slots) is a whole number of 256-row tiles; with fewer, more experts per
    # chip share the buffer and aligning each would need up to 60% more rows
    align = [] if expert >= 32 else ["model.moe_group_align=1"]
    return [f"mesh.fsdp={fsdp}", f"mesh.expert={expert}", f"mesh.tensor={tensor}", "mesh.data=1",
            f"mesh.context={context}", "model.attention_impl=pallas", f"model.remat_policy={remat}"] + align


# 128 chips: 744B parameters with float32 weights, float32 Adam moments and float32 gradients are 12 TB,
# the whole pod's HBM (128 x 95 GB); the points that can fit keep the weights (and so the gradients) and
# Adam's first moment in bfloat16 (6 TB of state, 1.5 TB of gradients). The batch is 4x smaller (256 x 4096).
_BF16 = ["model.param_dtype=bfloat16", "train.mu_dtype=bfloat16"]
_SMALL = ["data.batch_size=256"]
_BF16_STATE = _SMALL + _BF16
_BF16_STATE_256 = ["data.batch_size=512"] + _BF16
_DENSE = ["train.stage=dense"]
_MOE = "moe_attention_saveable"     # configs/glm5_744b.py's policy (the sweeps before 2026-12-05: moe_saveable)
# the ragged transport chunks tokens only (the config's expert chunks are the a2a transport's)
_RAGGED = ["model.moe_ep=ragged_a2a", "model.moe_a2a_chunk_by=tokens"]

# name -> overrides; every point names its mesh so a point means the same thing whatever the config's mesh
SWEEPS = {
    "v5p:8x16x16": {          # 2048 chips, the config's 1024 x 4096 batch
        "baseline": _mesh(128, 8, 2),
        "remat_selection_saveable": _mesh(128, 8, 2) + ["model.remat_policy=selection_saveable"],
        "fsdp64_ep16_tp2": _mesh(64, 16, 2),
        "fsdp64_ep8_tp4": _mesh(64, 8, 4),
        "fsdp32_ep16_tp4": _mesh(32, 16, 4),
        "ragged_a2a": _mesh(128, 8, 2) + _RAGGED,
        "remat_offload_dots": _mesh(128, 8, 2) + ["model.remat_policy=offload_dots"],
        "grad_accum2": _mesh(64, 8, 4) + ["train.grad_accum=2"],
        "remat_dots_attention_saveable": _mesh(128, 8, 2) + ["model.remat_policy=dots_attention_saveable"],
        # no tensor split: 1024 sequences over 1,024 token shards, each sequence over 2 chips (context)
        "fsdp128_cp2_ep8_tp1": _mesh(128, 8, 1, context=2),
    },
    "v5p:4x4x8": {            # 128 chips, 256 x 4096
        "bf16_fsdp8_ep8_tp2_accum4": _mesh(8, 8, 2) + _BF16_STATE + ["train.grad_accum=4"],
        "bf16_fsdp16_ep8_tp1_accum2": _mesh(16, 8, 1) + _BF16_STATE + ["train.grad_accum=2"],
        "fp32_fsdp8_ep8_tp2_accum4": _mesh(8, 8, 2) + _SMALL + ["train.grad_accum=4"],
        "bf16_fsdp32_ep4_tp1_accum2": _mesh(32, 4, 1) + _BF16_STATE + ["train.grad_accum=2"],
        "bf16_fsdp8_ep8_tp2_accum4_selection": _mesh(8, 8, 2) + _BF16_STATE + [
            "train.grad_accum=4", "model.remat_policy=selection_saveable"],
        "bf16_fsdp8_ep8_tp2_accum4_ragged": _mesh(8, 8, 2) + _BF16_STATE + [
            "train.grad_accum=4"] + _RAGGED,
        "bf16_fsdp8_ep8_tp2_accum2": _mesh(8, 8, 2) + _BF16_STATE + ["train.grad_accum=2"],
        "bf16_fsdp8_ep8_tp2_accum4_offload": _mesh(8, 8, 2) + _BF16_STATE + [
            "train.grad_accum=4", "model.remat_policy=offload_dots"],
    },
    "v5p:8x16x16/dense": {    # the pretraining stage: dense MLA attention (flash kernel), no indexer
        "dense_fsdp128_cp2_ep8": _mesh(128, 8, 1, context=2, remat=_MOE) + _DENSE,
        "dense_fsdp64_cp4_ep8": _mesh(64, 8, 1, context=4, remat=_MOE) + _DENSE,
        "dense_fsdp128_ep8_tp2": _mesh(128, 8, 2, remat=_MOE) + _DENSE,
        "dense_fsdp64_cp2_ep16": _mesh(64, 16, 1, context=2, remat=_MOE) + _DENSE,
        "dense_fsdp32_cp2_ep32": _mesh(32, 32, 1, context=2, remat=_MOE) + _DENSE,
        "dense_fsdp16_cp2_ep64": _mesh(16, 64, 1, context=2, remat=_MOE) + _DENSE,
        # under full remat, the layouts whose moe_saveable step does not fit
        "dense_fsdp64_cp4_ep8_full": _mesh(64, 8, 1, context=4) + _DENSE,
        "dense_fsdp128_ep8_tp2_full": _mesh(128, 8, 2) + _DENSE,
        "warmup_fsdp32_cp2_ep32": _mesh(32, 32, 1, context=2, remat=_MOE) + ["train.stage=warmup"],
    },
    "v5p:4x8x8/dense": {      # 256 chips, 512 x 4096, bf16 weights and first moment
        # (with bf16 weights the gradient all-reduce is bf16, which libtpu does not compile on the SparseCores)
        "dense_bf16_fsdp32_ep8_accum2": _mesh(32, 8, 1) + _BF16_STATE_256 + ["train.grad_accum=2"] + _DENSE
        + ["train.tpu_flags=sparsecore_offload_tc_all_reduce"],
        "dense_bf16_fsdp16_cp2_ep8_accum2": _mesh(16, 8, 1, context=2) + _BF16_STATE_256
        + ["train.grad_accum=2"] + _DENSE,
    },
    "v5p:8x16x16/tokens": {   # tokens per chip: 1024 ... 8192 sequences of 4096 over 2048 chips, the config's layout
        # (fsdp 32 x context 2 x expert 32). The config's policy keeps ~60 GiB per chip more than full remat at 1024
        # sequences, so a larger batch either runs in micro-batches of 1024 (the weights gathered again per
        # micro-batch, the same work per token) or in one batch under full remat (the weight gathers and gradient
        # reductions paid once)
        **{f"{stage}_b{b}_saveable": _mesh(32, 32, 1, context=2, remat=_MOE) + [
            f"train.stage={stage}", f"data.batch_size={b}", f"train.grad_accum={b // 1024}"]
           for stage in ("dense", "sparse") for b in (1024, 2048, 4096)},
        **{f"{stage}_b{b}_full": _mesh(32, 32, 1, context=2) + [
            f"train.stage={stage}", f"data.batch_size={b}", "train.grad_accum=1"]
           for stage, batches in (("dense", (1024, 2048, 4096, 8192)), ("sparse", (2048, 4096))) for b in batches},
    },
    "v5p:4x8x8": {            # 256 chips, 512 x 4096: the smallest pod the sweep on 128 chips leaves
        "bf16_fsdp16_ep8_tp2_accum4": _mesh(16, 8, 2) + _BF16_STATE_256 + ["train.grad_accum=4"],
        "fp32_fsdp16_ep8_tp2_accum4": _mesh(16, 8, 2) + ["data.batch_size=512", "train.grad_accum=4"],
        "bf16_fsdp32_ep8_tp1_accum2": _mesh(32, 8, 1) + _BF16_STATE_256 + ["train.grad_accum=2"],
    },
}


def source_digest(measuring: bool = False) -> str:
    """Hash of the sources that decide what is compiled (or, `measuring`, of the measuring modules)."""
    h = hashlib.sha256()
    for top in ("glm5_jax", "pallas_kernels"):
        for dirpath, _, files in sorted(os.walk(os.path.join(ROOT, top))):
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                if name.endswith(".py") and _is_measuring(rel) == measuring:
                    h.update(rel.encode())
                    h.update(open(path, "rb").read())
    return h.hexdigest()


def point_key(config: str, overrides: list[str], topology: str, sources: str) -> str:
    """Cache key of one point: the resolved config (after overrides), the topology, the sources."""
    from glm5_jax.train.experiment import apply_overrides, load_config_file

    cfg = apply_overrides(load_config_file(config), overrides)
    return hashlib.sha256(f"{cfg!r}|{topology}|{sources}".encode()).hexdigest()[:16]


def compile_point(config: str, topology: str, overrides: list[str], workdir: str, timeout: int,
                  measuring: str) -> dict:
    """The point's report: cached, reanalysed from its cached HLO when the measuring modules changed
    (`measuring` is their digest), else compiled."""
    report_path = os.path.join(workdir, "compile_report.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    sets = [f"--set={s}" for s in overrides]
    if os.path.exists(report_path):
        report = json.load(open(report_path))
        if report.get("measuring_sha256") == measuring or "compile_error" in report:
            return report
        args = [sys.executable, "-m", "glm5_jax.train.compile_report", f"--config={config}", f"--topology={topology}",
                f"--workdir={workdir}"] + sets
    else:
        args = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={config}", "--compile_only",
                f"--topology={topology}", f"--workdir={workdir}"] + sets
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:      # not cached: a rerun tries again
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:300],
                "wall_seconds": round(time.time() - t0)}
    report = json.load(open(report_path))
    report["measuring_sha256"] = measuring
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    return report


def row(name: str, overrides: list[str], report: dict) -> dict:
    out = {"name": name, "overrides": overrides}
    if "error" in report:
        return {**out, "error": report["error"]}
    mem = report.get("per_device_bytes", {})
    comm = report.get("communication", {})
    return {**out, "mesh": report["mesh"], "remat_policy": report["remat_policy"], "moe_ep": report["moe_ep"],
            "grad_accum": report.get("grad_accum"), "batch_size": report["batch_size"],
            "gb_per_chip": mem["total"] / 1e9 if mem else None, "fits": report["fits"],
            "compile_error": report.get("compile_error"),
            "flops_per_model_flop": report.get("flops_per_model_flop"),
            "comm_gb_per_chip": comm["bytes_per_chip"] / 1e9 if comm else None,
            "comm_seconds": comm.get("seconds"), "exposed_comm_seconds": comm.get("exposed_seconds"),
            "estimated_step_seconds": report.get("estimated_step_seconds"), "mfu": report.get("mfu"),
            "compile_seconds": report.get("compile_seconds")}


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict], topology: str) -> str:
    lines = [f"Mesh sweep on {topology} (AOT compiles on a loaded CPU host; times are the model's, not measured)",
             "", "| point | mesh (fsdp x expert x tensor) | remat | moe_ep | accum | GB/chip | fits | FLOPs / model "
             "| comm GB/chip | comm s | exposed s | step s | MFU |", "|" + "---|" * 13]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " |" * 11)
            continue
        m = r["mesh"]
        cp = f" (context {m['context']})" if m.get("context", 1) > 1 else ""
        lines.append(f"| {r['name']} | {m['fsdp']} x {m['expert']} x {m['tensor']}{cp} | {r['remat_policy']} | "
                     f"{r['moe_ep']} | {r['grad_accum']} | {_fmt(r['gb_per_chip'], '.1f')} | {r['fits']} | "
                     f"{_fmt(r['flops_per_model_flop'], '.2f')} | {_fmt(r['comm_gb_per_chip'], '.1f')} | "
                     f"{_fmt(r['comm_seconds'], '.2f')} | {_fmt(r['exposed_comm_seconds'], '.2f')} | "
                     f"{_fmt(r['estimated_step_seconds'], '.2f')} | {_fmt(r['mfu'], '.3f')} |")
    errors = [f"* {r['name']}: {r['compile_error']}" for r in rows if r.get("compile_error")]
    if errors:
        lines += ["", "Did not compile:", *errors]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, hbm_gb: float = 95.0):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r.get("estimated_step_seconds") is not None]
    if not ok:
        return
    names = [r["name"] for r in ok]
    fig, axes = plt.subplots(1, 4, figsize=(18, 0.5 * len(ok) + 2), sharey=True)
    for ax, key, title in zip(axes, ("gb_per_chip", "flops_per_model_flop", "comm_seconds", "mfu"),
                              ("GB per chip (line: 95 GB HBM)", "executed FLOPs / model FLOPs",
                               "communication s (dark: exposed)", "MFU (estimated)")):
        ax.barh(names, [r[key] or 0 for r in ok], color=["C0" if r["fits"] else "C3" for r in ok])
        if key == "comm_seconds":
            ax.barh(names, [r["exposed_comm_seconds"] or 0 for r in ok], color="k", alpha=0.5)
        if key == "gb_per_chip":
            ax.axvline(hbm_gb, color="k", ls="--")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_tokens(rows: list[dict], path: str, n_chips: int, seq_len: int = 4096):
    """Estimated MFU against tokens per chip per step: one line per stage (the point name's prefix) and remat
    policy, labelled with its micro-batch (sequences per pass) where all its points share one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("mfu") is not None and r.get("fits"):
            groups.setdefault((r["name"].split("_b")[0], r["remat_policy"]), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (stage, remat), pts in sorted(groups.items()):
        micro = {r["batch_size"] // r["grad_accum"] for r in pts}
        batching = f"micro-batches of {micro.pop()} sequences" if len(micro) == 1 and len(pts) > 1 else "one batch"
        xy = sorted((r["batch_size"] * seq_len / n_chips, r["mfu"]) for r in pts)
        ax.plot(*zip(*xy), "o-" if batching == "one batch" else "s--", label=f"{stage} stage, {remat}, {batching}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per chip per step")
    ax.set_ylabel("estimated MFU")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--topology", default="v5p:8x16x16", choices=sorted(SWEEPS))
    ap.add_argument("--out", required=True, help="JSON path; the .md table and .png plot go beside it")
    ap.add_argument("--cache_dir", default=os.path.join(ROOT, "bench", "results", "mesh_sweep_cache"))
    ap.add_argument("--jobs", type=int, default=2, help="compiles at once (each ~10 GB of host memory at 744B)")
    ap.add_argument("--only", default="", help="comma-separated point names (default: all)")
    ap.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per compile")
    ap.add_argument("--sources_sha256", default="",
                    help="tabulate the points cached for these model sources (an earlier sweep's "
                         "sources_sha256) instead of the current ones")
    args = ap.parse_args(argv)
    points = SWEEPS[args.topology]
    sweep, args.topology = args.topology, args.topology.split("/")[0]
    names = [n for n in args.only.split(",") if n] or list(points)
    unknown = sorted(set(names) - set(points))
    if unknown:
        raise SystemExit(f"--only: unknown points {unknown}; known: {sorted(points)}")
    sources = args.sources_sha256 or source_digest()
    workdirs = {n: os.path.join(args.cache_dir, f"{n}-{point_key(args.config, points[n], args.topology, sources)}")
                for n in names}
    cached = [n for n in names if os.path.exists(os.path.join(workdirs[n], "compile_report.json"))]
    if args.sources_sha256 and args.sources_sha256 != source_digest() and len(cached) < len(names):
        raise SystemExit(f"--sources_sha256: {sorted(set(names) - set(cached))} not cached for those sources, and "
                         "compiling them now would file today's code under them")
    print(f"{len(names)} points on {args.topology}: {len(cached)} cached, compiling {len(names) - len(cached)} "
          f"({args.jobs} at a time)", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {n: pool.submit(compile_point, args.config, args.topology, points[n], workdirs[n], args.timeout,
                                  source_digest(measuring=True)) for n in names}
        rows = [row(n, points[n], futures[n].result()) for n in names]
    result = {"config": args.config, "topology": args.topology, "sweep": sweep, "sources_sha256": sources,
              "points": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    stem = os.path.splitext(args.out)[0]
    table = markdown(rows, args.topology)
    with open(stem + ".md", "w") as f:
        f.write(table)
    plot(rows, stem + ".png")
    if sweep.endswith("/tokens"):
        plot_tokens(rows, stem + "_mfu.png", n_chips=math.prod(torus_dims(args.topology)))
    print(table)
    return result


if __name__ == "__main__":
    main()
