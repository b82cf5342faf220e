"""A/B of two settings of one train step, timed alternately in one process.

Step times on a shared or throttling host drift by 5-30% over minutes; timing A then B in separate runs
mixes that drift into the comparison. Here both trainers are built and compiled first, then their steps
alternate (A, B, A, B, ...), so both medians see the same machine state.

    python bench/step_ab.py --seq_len=4096 --a=model.sparse_xla_form=gather --b=model.sparse_xla_form=auto
    python bench/step_ab.py --a=model.moe_impl=ragged_dot --out=/tmp/ab.json      # B: the config as is

Each of --a / --b is a comma-separated list of --set style overrides (empty: the config unchanged). Like
bench/train_step.py, MTP is off unless --mtp.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.timing import interleaved_seconds  # noqa: E402
from bench.train_step import CONFIG, QUICK, OursStep  # noqa: E402
from glm5_jax.train.experiment import apply_overrides, load_config_file  # noqa: E402


def overrides(text):
    return [s for s in text.split(",") if s]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--a", default="", help="overrides of setting A, comma-separated")
    p.add_argument("--b", default="", help="overrides of setting B, comma-separated")
    p.add_argument("--steps", type=int, default=4, help="timed steps per setting (alternating)")
    p.add_argument("--mtp", action="store_true", help="keep the config's MTP module")
    p.add_argument("--quick", action="store_true", help="tiny dims, for a smoke run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.a == args.b:
        raise SystemExit("--a and --b are the same setting")

    base = (QUICK if args.quick else []) + [f"data.seq_len={args.seq_len}"]
    if not args.mtp:
        base += ["model.mtp_depth=0", "model.num_nextn_predict_layers=0"]
    runs = {}
    for name, extra in (("A", overrides(args.a)), ("B", overrides(args.b))):
        cfg = apply_overrides(load_config_file(args.config), base + extra).validate()
        runs[name] = {"step": OursStep(cfg), "overrides": extra, "tokens": cfg.data.batch_size * args.seq_len}
        runs[name]["step"]()                                   # compile + one untimed step
        runs[name]["first_loss"] = runs[name]["step"].loss
    times = interleaved_seconds({name: run["step"] for name, run in runs.items()}, args.steps, warmup=0)
    for name, run in runs.items():
        run["times"] = times[name]

    rows = []
    print(f"{'':2} {'median s/step':>14} {'tok/s':>8} {'first loss':>11}  steps (s)            overrides")
    for name, run in runs.items():
        median = statistics.median(run["times"])
        rows.append({"setting": name, "overrides": run["overrides"], "median_step_s": median,
                     "tokens_per_sec": run["tokens"] / median, "step_s": run["times"], "first_loss": run["first_loss"]})
        print(f"{name:2} {median:>14.3f} {run['tokens'] / median:>8.0f} {run['first_loss']:>11.5f}  "
              f"{' '.join(f'{t:.2f}' for t in run['times']):20} {','.join(run['overrides']) or '(config)'}")
    ratio = rows[1]["median_step_s"] / rows[0]["median_step_s"]
    print(f"B/A step time: {ratio:.3f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": os.path.basename(args.config), "seq_len": args.seq_len, "quick": args.quick,
                       "rows": rows, "b_over_a": ratio}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
