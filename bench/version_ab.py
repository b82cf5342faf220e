"""A/B of two code versions' train step: our step of bench/train_step.py, run in alternating processes.

bench/step_ab.py compares two settings of one code version in one process. Two versions of the package cannot
share a process, so here each run is a fresh `python bench/train_step.py --skip_hf` inside a git worktree of
that version, and the runs alternate (base, head, head, base, ... for --rounds) so slow drift of the host
hits both sides alike. Each side's reported step time is the median over all its timed steps.

    python bench/version_ab.py --base=9cc943f --out=bench/results/version_ab.json
    python bench/version_ab.py --base=HEAD~3 --head=WORKTREE --seq_lens=1024 --rounds=1

--head=WORKTREE times the working tree as it is (uncommitted changes included). MTP is off (the
train-step benchmark's HF-comparable model); --set overrides go to both sides.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout(rev: str, scratch: str) -> str:
    """A detached worktree of ``rev`` under ``scratch`` (or the repository itself for WORKTREE) -> its path."""
    if rev == "WORKTREE":
        return REPO
    path = os.path.join(scratch, rev.replace("/", "_").replace("~", "_"))
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-f", path, rev], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def run_side(tree: str, seq_lens: str, steps: int, warmup: int, sets: list) -> dict:
    """One `bench/train_step.py --skip_hf` run inside ``tree`` -> {T: [step seconds]}."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.join(tree, "bench", "train_step.py"), "--skip_hf", f"--seq_lens={seq_lens}",
           f"--steps={steps}", f"--warmup={warmup}", f"--out={out}",
           "--set=model.mtp_depth=0", "--set=model.num_nextn_predict_layers=0"] + [f"--set={s}" for s in sets]
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    subprocess.run(cmd, check=True, cwd=tree, env=env)
    with open(out) as f:
        rows = json.load(f)["rows"]
    os.unlink(out)
    return {str(r["T"]): r["step_seconds"]["ours"] for r in rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision of side A")
    p.add_argument("--head", default="HEAD", help="git revision of side B, or WORKTREE")
    p.add_argument("--seq_lens", default="1024,4096")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run (the first compiles)")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating (ABBA order)")
    p.add_argument("--set", action="append", default=[], help="config override for both sides (repeatable)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    scratch = tempfile.mkdtemp(prefix="version_ab_")
    trees = {"base": checkout(args.base, scratch), "head": checkout(args.head, scratch)}
    revs = {side: (rev if rev == "WORKTREE" else subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip())
        for side, rev in (("base", args.base), ("head", args.head))}
    order = [("base", "head") if r % 2 == 0 else ("head", "base") for r in range(args.rounds)]
    times = {side: {} for side in trees}
    try:
        for pair in order:
            for side in pair:
                print(f"--- {side} ({revs[side]})", flush=True)
                for T, ts in run_side(trees[side], args.seq_lens, args.steps, args.warmup, args.set).items():
                    times[side].setdefault(T, []).extend(ts)
    finally:
        for side, tree in trees.items():
            if tree != REPO:
                subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    print(f"{'T':>6} {'base s/step':>12} {'head s/step':>12} {'head/base':>10}   base {revs['base']}, head {revs['head']}")
    for T in times["base"]:
        base, head = statistics.median(times["base"][T]), statistics.median(times["head"][T])
        rows.append({"T": int(T), "base_step_s": base, "head_step_s": head, "head_over_base": head / base,
                     "base_steps": times["base"][T], "head_steps": times["head"][T]})
        print(f"{T:>6} {base:>12.3f} {head:>12.3f} {head / base:>10.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"base": revs["base"], "head": revs["head"], "overrides": args.set, "rounds": args.rounds,
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
