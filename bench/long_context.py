"""Long-context cost of a small GLM-5 on CPU: the train step with DSA vs dense attention, and the prefill
of `glm5_jax.generate.decoding` chunked vs the whole prompt at once.

* train: one train step (forward + backward + AdamW) of configs/bench_small.py cut to a few layers and a
  small width, batch 1, at T tokens, with train.stage="sparse" (DSA: indexer top-k attention, indexer KL)
  and train.stage="dense" (plain causal attention, no indexer loss). MTP off.
* prefill: `generate` over one T-token prompt with max_new_tokens=1 (the prefill and the first token),
  prefill_chunk=--chunk vs prefill_chunk=0 (the whole prompt in one step).

Each point runs in a fresh subprocess (so memory numbers do not carry over) and reports the median
seconds of --reps calls after one untimed call, tokens/s, and two peak-memory measures:
``xla_peak``: the compiled program's ``memory_analysis()`` argument + output + temp bytes (what XLA
allocates for the program: weights, optimizer state, cache, activations), and ``max_rss``: the process's
``ru_maxrss`` (everything it ever held: runtime, compiler, host copies; an upper bound).

    python bench/long_context.py --out=bench/results/long_context.json            # T = 4K..32K
    python bench/long_context.py --train_t=4096,8192,16384,32768,65536 --prefill_t=16384,32768,65536
    python bench/long_context.py --train_t=4096,8192,16384,32768,65536 --dense_max_t=32768   # DSA alone at 64K
    python bench/long_context.py --quick --out=/tmp/long_context.json              # smoke run (minutes)

Timings on a shared machine are a smoke check only; compare sides within one run.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "bench_small.py")
# a 3-layer (1 dense + 2 MoE) GLM-5 at width 256 with GLM-5's DSA structure; index_topk 512
FULL = ["model.num_hidden_layers=3", "model.hidden_size=256", "model.num_attention_heads=4",
        "model.q_lora_rank=128", "model.kv_lora_rank=128", "model.intermediate_size=512",
        "model.moe_intermediate_size=128", "model.index_topk=512", "model.mtp_depth=0",
        "model.num_nextn_predict_layers=0", "model.max_position_embeddings=131072", "data.batch_size=1"]
QUICK = ["model.num_hidden_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.intermediate_size=128",
         "model.moe_intermediate_size=32", "model.index_topk=256", "model.vocab_size=512", "data.vocab_size=512",
         "model.mtp_depth=0", "model.num_nextn_predict_layers=0", "model.max_position_embeddings=131072",
         "data.batch_size=1"]


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux reports KiB


def _xla_peak(compiled) -> int:
    mem = compiled.memory_analysis()
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)


def _median_seconds(run, reps) -> float:
    run()                                                             # untimed: first-call overheads
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def train_point(overrides, T, stage, reps):
    import jax
    import numpy as np

    from bench.train_step import random_batch
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.train.experiment import apply_overrides, load_config_file
    from glm5_jax.train.step import Trainer

    exp = apply_overrides(load_config_file(CONFIG), overrides + [f"data.seq_len={T}", f"train.stage={stage}"])
    exp = exp.validate()
    trainer = Trainer(exp, build_mesh(exp.mesh))
    state = trainer.init_state(0)
    batch = trainer.put_batch(random_batch(1, T, exp.model.vocab_size))
    with trainer.context():
        compiled = trainer._step.lower(state, batch).compile()
    holder = {"state": state}

    def run():
        holder["state"], metrics = compiled(holder["state"], batch)
        loss = float(jax.block_until_ready(metrics["loss"]))
        if not np.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss}")

    seconds = _median_seconds(run, reps)
    return {"kind": "train", "T": T, "stage": stage, "seconds": seconds, "tokens_per_s": T / seconds,
            "xla_peak_bytes": _xla_peak(compiled), "max_rss_bytes": _max_rss_bytes()}


def prefill_point(overrides, T, chunk, reps):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax.core import meta

    from glm5_jax.generate.decoding import prepare_generate
    from glm5_jax.model.transformer import Transformer
    from glm5_jax.train.experiment import apply_overrides, load_config_file

    cfg = apply_overrides(load_config_file(CONFIG), overrides).model
    variables = meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, (1, T)).astype(np.int32)
    fn, args = prepare_generate(cfg, variables, prompt, [T], max_new_tokens=1, temperature=0.0, prefill_chunk=chunk)
    compiled = fn.lower(*args).compile()
    seconds = _median_seconds(lambda: jax.block_until_ready(compiled(*args)), reps)
    return {"kind": "prefill", "T": T, "chunk": chunk, "seconds": seconds, "tokens_per_s": T / seconds,
            "xla_peak_bytes": _xla_peak(compiled), "max_rss_bytes": _max_rss_bytes()}


def run_point(spec, timeout):
    """One measurement in a fresh process -> its result dict (or an "error" entry)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--point", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return dict(spec, error=(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"])
    return json.loads(lines[-1][len("RESULT "):])


def _mib(r, key):
    return f"{r[key] / 2**20:.0f}" if key in r else "-"


def print_tables(rows):
    tables = (("train", "stage", "train step (forward + backward + AdamW), batch 1", "s/step"),
              ("prefill", "chunk", "prefill (generate, max_new_tokens=1), batch 1; chunk 0 = the whole prompt in one step",
               "s"))
    for kind, column, title, seconds in tables:
        print(f"\n{title}")
        print(f"| T | {column} | {seconds} | tokens/s | XLA peak MiB | max RSS MiB |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["kind"] == kind:
                timing = f"{r['seconds']:.2f} | {r['tokens_per_s']:.0f}" if "seconds" in r else f"{r['error']} | -"
                print(f"| {r['T']} | {r[column]} | {timing} | {_mib(r, 'xla_peak_bytes')} | {_mib(r, 'max_rss_bytes')} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and short sequences (a smoke run)")
    p.add_argument("--train_t", default=None, help="comma-separated train-step lengths (default 4K..32K)")
    p.add_argument("--prefill_t", default=None, help="comma-separated prompt lengths (default 16K, 32K)")
    p.add_argument("--chunk", type=int, default=None, help="prefill_chunk of the chunked side (default 4096)")
    p.add_argument("--stages", default="sparse,dense")
    p.add_argument("--dense_max_t", type=int, default=None,
                   help="skip dense-stage train points above this T (dense attention is quadratic in T on CPU)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per point (median reported)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per point before it is abandoned")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)   # internal: run one point, print RESULT
    args = p.parse_args()

    overrides = QUICK if args.quick else FULL
    if args.point:
        spec = json.loads(args.point)
        if spec["kind"] == "train":
            result = train_point(overrides, spec["T"], spec["stage"], spec["reps"])
        else:
            result = prefill_point(overrides, spec["T"], spec["chunk"], spec["reps"])
        print("RESULT " + json.dumps(result), flush=True)
        return

    train_t = [int(t) for t in (args.train_t or ("2048,4096" if args.quick else "4096,8192,16384,32768")).split(",")
               if t]
    prefill_t = [int(t) for t in (args.prefill_t or ("8192" if args.quick else "16384,32768")).split(",") if t]
    chunk = args.chunk or (2048 if args.quick else 4096)
    specs = [dict(kind="train", T=T, stage=s, reps=args.reps) for T in train_t for s in args.stages.split(",")]
    specs += [dict(kind="prefill", T=T, chunk=c, reps=args.reps) for T in prefill_t for c in (chunk, 0)]
    print(f"overrides: {' '.join(overrides)}; {os.cpu_count()} CPUs; median of {args.reps}", flush=True)
    rows = []
    for spec in specs:
        if spec["kind"] == "train" and spec["stage"] == "dense" and args.dense_max_t and spec["T"] > args.dense_max_t:
            rows.append(dict(spec, error=f"not run (--dense_max_t={args.dense_max_t})"))
            continue
        t0 = time.perf_counter()
        rows.append(run_point(spec, args.timeout))
        print(f"{spec}: {time.perf_counter() - t0:.0f} s wall -> {rows[-1]}", flush=True)
    print_tables(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": os.path.basename(CONFIG), "overrides": overrides, "quick": args.quick,
                       "reps": args.reps, "statistic": "median", "cpus": os.cpu_count(),
                       "memory": {"xla_peak_bytes": "compiled memory_analysis(): argument + output + temp",
                                  "max_rss_bytes": "ru_maxrss of the point's own process"},
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
