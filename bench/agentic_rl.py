"""Multi-turn RL through a policy server (configs/rl_guess.py): the demo, asynchrony vs lockstep, and the kill test.

    python bench/agentic_rl.py --out=bench/results/agentic_rl.json [--workdir=/tmp/glm5_agentic_bench] [--kills=10]
        [--parts=compare,kill] [--set=agentic.step_latency_s=0.3] [--async_generators=3]

Every run goes through the supervisor: learner, policy server, router and 2 generators as processes,
number guessing played over HTTP with agentic.step_latency_s of tool latency per step.
1. SFT on the noisy teacher (made once, shared), then a 2-version warm-up that fills a shared XLA
   compilation cache, so every timed run starts equally warm.
2. async (tau=2, in-flight weight updates: the server swaps versions between decode steps and keeps the
   episodes' cache rows, the learner bounds staleness per token; --async_generators generators) and lockstep
   (tau=0: batch o played by exactly version o; 2 generators) runs of the same config and
   seeds (episodes are a function of the batch ordinal): success rate per version (the mean reward of the
   batch a version was trained on, averaged over --window versions) and seconds from version 0 until it
   first reaches --target.
3. lockstep uninterrupted vs the same run with --kills random SIGKILLs of learner, generators, server and
   router (restarted by the supervisor): same ledger (every batch and every episode consumed exactly once,
   same versions), staleness within tau.
Prints tables and writes --out (JSON) with the per-version curves.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.rl import check_ledger, read_jsonl  # noqa: E402
from glm5_jax.rl.run import Supervisor, child_env  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "rl_guess.py")
LEDGER_FIELDS = ("ordinal", "generator", "seq", "status", "sampled_with", "trained_at", "episodes")


def run(workdir, overrides, kills=0, seed=0, generators=2):
    shutil.rmtree(workdir, ignore_errors=True)
    start = time.time()
    report = Supervisor(CONFIG, workdir, overrides, num_generators=generators).run(
        chaos_kills=kills, chaos_interval=(2.0, 5.0), chaos_seed=seed, chaos_after_version=1 if kills else 0)
    metrics = read_jsonl(os.path.join(workdir, "rl_metrics.jsonl"))
    with open(os.path.join(workdir, "rl_summary.json")) as f:
        summary = json.load(f)
    return {"wall_seconds": time.time() - start, "report": report, "metrics": metrics, "summary": summary}


def success_curve(metrics, window):
    """[(version, elapsed s, batch success, success averaged over the last `window` versions)]."""
    rows, recent = [], []
    for m in metrics[1:]:
        recent = (recent + [m["mean_reward"]])[-window:]
        rows.append((m["version"], m["elapsed"], m["mean_reward"], float(np.mean(recent))))
    return rows


def seconds_to_target(curve, target, window):
    hit = [r for r in curve if r[0] >= window and r[3] >= target]
    return (hit[0][1], hit[0][0]) if hit else (None, None)


def ledger_view(summary):
    return [{k: e.get(k) for k in LEDGER_FIELDS} for e in summary["consumed"]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "agentic_rl.json"))
    parser.add_argument("--workdir", default="/tmp/glm5_agentic_bench")
    parser.add_argument("--versions", type=int, default=25)
    parser.add_argument("--kill_versions", type=int, default=20)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--chaos_seed", type=int, default=4, help="which roles are killed, and when (4: all five)")
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--set", action="append", default=[],
                        help="extra config override, e.g. agentic.step_latency_s=0.3")
    parser.add_argument("--async_generators", type=int, default=3,
                        help="generators of the async run: with tau=2 up to 3 batches are played at once "
                             "(back-pressure: batch o starts while o <= consumed + tau); lockstep plays one")
    parser.add_argument("--parts", default="compare,kill", help="which parts to run: compare (demo + async vs "
                        "lockstep), kill")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(args.workdir, "jax_cache")   # shared by all runs
    sft = [f"sft_workdir={os.path.join(args.workdir, 'sft')}"] + args.set
    results = {"config": "configs/rl_guess.py", "overrides": args.set, "target": args.target, "window": args.window}

    t0 = time.time()
    subprocess.check_call([sys.executable, "-m", "glm5_jax.rl.sft", f"--config={CONFIG}", f"--workdir={args.workdir}",
                           *[f"--set={s}" for s in sft]], env=child_env(), cwd=ROOT)
    results["sft_seconds"] = time.time() - t0
    print(f"SFT ready ({results['sft_seconds']:.0f} s)", flush=True)
    warm = run(os.path.join(args.workdir, "warmup"), sft + ["rl.num_versions=2"])
    print(f"warm-up done ({warm['wall_seconds']:.0f} s)", flush=True)

    modes = {"async": ["rl.tau=2", "rl.lockstep=False", "rl.inflight_updates=True"],
             "lockstep": ["rl.tau=0", "rl.lockstep=True"]}
    parts = args.parts.split(",")
    if "compare" in parts:
        compare(args, sft, modes, results)
    if "kill" in parts:
        kill_test(args, sft, modes, results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def compare(args, sft, modes, results):
    for label, mode in modes.items():
        generators = args.async_generators if label == "async" else 2
        r = run(os.path.join(args.workdir, label), sft + mode + [f"rl.num_versions={args.versions}"],
                generators=generators)
        curve = success_curve(r["metrics"], args.window)
        seconds, version = seconds_to_target(curve, args.target, args.window)
        tau = 2 if label == "async" else 0
        first = curve[0][1]            # elapsed at version 1: servers up, compiled, one batch trained
        results[label] = {"overrides": mode, "generators": generators, "seconds_to_target": seconds,
                          "version_at_target": version,
                          "seconds_to_target_after_v1": None if seconds is None else seconds - first,
                          "seconds_for_all_versions": r["metrics"][-1]["elapsed"], "wall_seconds": r["wall_seconds"],
                          "curve": curve, **check_ledger(r["summary"], tau)}
        print(f"{label}: {seconds} s to success >= {args.target} (version {version}); "
              f"{r['metrics'][-1]['elapsed']:.1f} s for {args.versions} versions; "
              f"exactly once {results[label]['exactly_once']}, staleness max {results[label]['staleness_max']} "
              f"<= {tau}: {results[label]['staleness_within_tau']}, dropped {results[label]['dropped_stale']}",
              flush=True)
    for key in ("seconds_to_target", "seconds_to_target_after_v1"):
        a, b = results["async"][key], results["lockstep"][key]
        results[f"speedup_{key}"] = b / a if a and b else None
    print_compare(results, args.versions)


def print_compare(results, versions):
    """The comparison's tables (also: python -c 'import json, bench.agentic_rl as b;
    b.print_compare(json.load(open("OUT.json")), VERSIONS)')."""
    modes = ("async", "lockstep")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"   # noqa: E731
    print("\n| run | s to success >= %.2f (from v0) | (from v1) | version | s for %d versions | staleness max | "
          "dropped |" % (results["target"], versions))
    print("|---|---|---|---|---|---|---|")
    for label in modes:
        r = results[label]
        print(f"| {label} ({' '.join(r['overrides'])}, {r.get('generators', 2)} generators) | "
              f"{fmt(r['seconds_to_target'])} | "
              f"{fmt(r['seconds_to_target_after_v1'])} | {r['version_at_target']} | "
              f"{r['seconds_for_all_versions']:.1f} | {r['staleness_max']} | {r['dropped_stale']} |")
    print(f"\nspeedup to target, lockstep / async: {fmt(results['speedup_seconds_to_target'])}x from version 0, "
          f"{fmt(results['speedup_seconds_to_target_after_v1'])}x from version 1")
    print("\n| version | async success (batch, window) | lockstep success (batch, window) |")
    print("|---|---|---|")
    curves = {label: {v: (s, w) for v, _, s, w in results[label]["curve"]} for label in modes}
    for v in range(1, versions + 1, 3):
        cells = [f"{curves[m][v][0]:.3f}, {curves[m][v][1]:.3f}" if v in curves[m] else "-" for m in modes]
        print(f"| {v} | {cells[0]} | {cells[1]} |", flush=True)


def kill_test(args, sft, modes, results):
    kill_mode = sft + modes["lockstep"] + [f"rl.num_versions={args.kill_versions}"]
    clean = run(os.path.join(args.workdir, "kill_clean"), kill_mode)
    killed = run(os.path.join(args.workdir, "kill_killed"), kill_mode, kills=args.kills, seed=args.chaos_seed)
    same_content = sum(x["sha256"] == y["sha256"] for x, y in zip(clean["summary"]["consumed"],
                                                                   killed["summary"]["consumed"]))
    episodes = [(e["ordinal"], s) for e in killed["summary"]["consumed"] for s in e.get("episodes", [])]
    results["kill"] = {
        "versions": args.kill_versions, "kills": killed["report"]["kills"], "restarts": killed["report"]["restarts"],
        "same_ledger": ledger_view(clean["summary"]) == ledger_view(killed["summary"]),
        "batches_with_identical_content": same_content, "episodes_consumed": len(episodes),
        "episodes_unique": len(set(episodes)) == len(episodes),
        "clean_wall_seconds": clean["wall_seconds"], "killed_wall_seconds": killed["wall_seconds"],
        "clean": check_ledger(clean["summary"], 0), "killed": check_ledger(killed["summary"], 0)}
    k = results["kill"]
    roles = sorted({x["role"] for x in k["kills"]})
    print(f"\nkill test: {len(k['kills'])} SIGKILLs ({', '.join(roles)}), same ledger as the uninterrupted run: "
          f"{k['same_ledger']}; {k['episodes_consumed']} episodes, each once: {k['episodes_unique']}; batches "
          f"with bit-identical content {k['batches_with_identical_content']}/{args.kill_versions}; "
          f"wall {k['clean_wall_seconds']:.0f} s clean vs {k['killed_wall_seconds']:.0f} s killed")


if __name__ == "__main__":
    main()
