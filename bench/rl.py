"""Async RL benchmark and crash check on the sorting task (configs/rl_sort.py), all through the supervisor.

    python bench/rl.py --out=bench/results/rl.json [--workdir=/tmp/glm5_rl_bench] [--kills=10]

1. SFT checkpoint (made once, shared), then a 2-version warm-up that fills a shared XLA compilation
   cache, so every timed run below starts equally warm.
2. async (tau=2) and strict alternation (tau=0) runs of the same config: seconds from version 0 until the
   sampled exact match on 512 held-out prompts first reaches --target.
3. lockstep (tau=2) uninterrupted vs the same run with --kills random SIGKILLs of learner and generator:
   final params sha256 must be equal, every batch consumed exactly once (or counted dropped/rejected),
   staleness <= tau.
Writes --out (JSON), copies both metrics files next to it and plots the reward curves (bench/plot_rl.py).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glm5_jax.rl.run import Supervisor, child_env  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "rl_sort.py")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def seconds_to_target(metrics, target):
    hit = [r for r in metrics if r.get("eval_exact_match", -1) >= target]
    return hit[0]["elapsed"] if hit else None


def run(workdir, overrides, kills=0, seed=0):
    shutil.rmtree(workdir, ignore_errors=True)
    start = time.time()
    report = Supervisor(CONFIG, workdir, overrides, num_generators=1).run(
        chaos_kills=kills, chaos_interval=(2.0, 5.0), chaos_seed=seed)
    metrics = read_jsonl(os.path.join(workdir, "rl_metrics.jsonl"))
    with open(os.path.join(workdir, "rl_summary.json")) as f:
        summary = json.load(f)
    return {"wall_seconds": time.time() - start, "report": report, "metrics": metrics, "summary": summary}


def check_ledger(summary, tau):
    ordinals = [e["ordinal"] for e in summary["consumed"]]
    used = [e for e in summary["consumed"] if e["status"] == "used"]
    return {"exactly_once": ordinals == list(range(len(ordinals))),
            "used": len(used), "dropped_stale": summary["dropped_stale"],
            "rejected_corrupt": summary["rejected_corrupt"],
            "staleness_max": max((e["trained_at"] - e["sampled_with"] for e in used), default=0),
            "staleness_within_tau": all(e["trained_at"] - e["sampled_with"] <= tau for e in used)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "rl.json"))
    parser.add_argument("--workdir", default="/tmp/glm5_rl_bench")
    parser.add_argument("--versions", type=int, default=60)
    parser.add_argument("--lockstep_versions", type=int, default=40)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.85)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(args.workdir, "jax_cache")   # shared by all runs
    sft = [f"sft_workdir={os.path.join(args.workdir, 'sft')}"]
    common = sft + [f"rl.num_versions={args.versions}"]
    results = {"target": args.target, "config": "configs/rl_sort.py"}

    t0 = time.time()
    subprocess.check_call([sys.executable, "-m", "glm5_jax.rl.sft", f"--config={CONFIG}",
                           f"--workdir={args.workdir}", *[f"--set={s}" for s in sft]], env=child_env(), cwd=ROOT)
    results["sft_seconds"] = time.time() - t0
    print(f"SFT ready ({results['sft_seconds']:.0f} s)", flush=True)
    warm = run(os.path.join(args.workdir, "warmup"), sft + ["rl.num_versions=2", "rl.eval_every=1"])
    print(f"warm-up done ({warm['wall_seconds']:.0f} s)", flush=True)

    for label, tau in (("async", 2), ("sync", 0)):
        r = run(os.path.join(args.workdir, label), common + [f"rl.tau={tau}"])
        evals = [(m["version"], m["elapsed"], m["eval_exact_match"]) for m in r["metrics"] if "eval_exact_match" in m]
        results[f"{label}_seconds_to_target"] = seconds_to_target(r["metrics"], args.target)
        results[label] = {"tau": tau, "wall_seconds": r["wall_seconds"],
                          "seconds_to_last_version": r["metrics"][-1]["elapsed"], "evals": evals,
                          **check_ledger(r["summary"], tau)}
        shutil.copy(os.path.join(args.workdir, label, "rl_metrics.jsonl"),
                    os.path.join(os.path.dirname(args.out), f"rl_{label}_metrics.jsonl"))
        print(f"{label} (tau={tau}): {results[f'{label}_seconds_to_target']} s to eval >= {args.target}; "
              f"{r['metrics'][-1]['elapsed']:.1f} s for {args.versions} versions; evals {evals}", flush=True)
    results["final_eval_exact_match"] = results["async"]["evals"][-1][2]
    results["initial_eval_exact_match"] = results["async"]["evals"][0][2]

    lock = sft + [f"rl.num_versions={args.lockstep_versions}", "rl.lockstep=True", "rl.tau=2", "rl.eval_every=0"]
    clean = run(os.path.join(args.workdir, "lockstep_clean"), lock)
    killed = run(os.path.join(args.workdir, "lockstep_killed"), lock, kills=args.kills, seed=1)
    results["lockstep"] = {
        "versions": args.lockstep_versions, "clean_sha256": clean["summary"]["params_sha256"],
        "killed_sha256": killed["summary"]["params_sha256"],
        "identical": clean["summary"]["params_sha256"] == killed["summary"]["params_sha256"],
        "same_consumed_ledger": clean["summary"]["consumed"] == killed["summary"]["consumed"],
        "kills": killed["report"]["kills"], "restarts": killed["report"]["restarts"],
        "clean_wall_seconds": clean["wall_seconds"], "killed_wall_seconds": killed["wall_seconds"],
        "clean": check_ledger(clean["summary"], 2), "killed": check_ledger(killed["summary"], 2)}
    print(f"lockstep: {len(killed['report']['kills'])} kills, identical params: {results['lockstep']['identical']}, "
          f"ledger {results['lockstep']['killed']}", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: results[k] for k in ("async_seconds_to_target", "sync_seconds_to_target",
                                              "final_eval_exact_match")}))
    subprocess.call([sys.executable, os.path.join(ROOT, "bench", "plot_rl.py"),
                     f"async (tau=2)={os.path.join(args.workdir, 'async')}",
                     f"sync (tau=0)={os.path.join(args.workdir, 'sync')}", f"--target={args.target}",
                     f"--out={os.path.join(os.path.dirname(os.path.abspath(args.out)), 'rl_reward.png')}"])


if __name__ == "__main__":
    main()
